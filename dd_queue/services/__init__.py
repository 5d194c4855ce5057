"""Thin process entry points: ``python -m dd_queue.services.<name> --config ...``.

``learner``, ``synchronizer`` and ``control_plane`` each parse their flags, build the library
objects from the config and run them; the logic lives in the rest of ``dd_queue``. They ship in
the wheel, so the Procfile, ``compose.yaml`` and ``torchrun -m`` work outside a checkout too.
The checkout's top-level ``services/`` package forwards to these (``python -m services.learner``).
"""
