"""``ddq up``: one command that starts a whole local run and watches it.

A private ``redis-server`` with AOF in a run directory, the synchronizer, the evaluator, N
learners and the control plane, each a separate process (the same commands the Procfile runs);
progress lines while it trains; a summary at the end. See ``dd_queue.up.cli``.
"""
