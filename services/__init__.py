"""The process entry points, for a checkout: each forwards to ``dd_queue.services.<name>``.

The real modules ship in the wheel as ``dd_queue.services`` (use those names outside a checkout).
"""
