"""The pure Decoupled DiLoCo core: math and policy with no I/O.

Nothing in this package imports redis, fastapi, asyncio, threading, concurrent, time, os or socket
(``tests/unit/test_architecture.py`` enforces it). Time is always an argument (``now``, seconds).
Arrays are numpy; the learner converts torch tensors at its boundary.
"""
