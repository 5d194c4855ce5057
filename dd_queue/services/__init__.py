"""Thin process entry points (``python -m services.<name> --config ...``).

Each parses its flags, builds the library objects from the config and runs them; the logic lives
in ``dd_queue``. The learner, synchronizer and control-plane entry points land with their issues.
"""
