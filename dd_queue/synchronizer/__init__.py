"""The synchronizer: quorum, grace window, token-weighted merge and exactly-once commits.

    sync = Synchronizer(cfg, bus=RedisBus(...), clock=SystemClock(), synchronizer_id="sync-0")
    sync.start()                       # take fragments: create version 0 or load the state
    while running:
        sync.pump(block_ms=500)        # one iteration; returns the next wake-up time
    sync.close()                       # release leases

See :mod:`dd_queue.synchronizer.synchronizer` for the loop, ``docs/protocol.md`` for what it
reads and writes.
"""

from typing import TYPE_CHECKING

from dd_queue._lazy import lazy_exports
from dd_queue.fragment_state import FragmentState, SegmentRecord, VersionRef

if TYPE_CHECKING:
    from dd_queue.synchronizer.context import hard_kill
    from dd_queue.synchronizer.runtime import FragmentStatus
    from dd_queue.synchronizer.source import ArraySource, ConfigModelSource, ModelSource, plan_of
    from dd_queue.synchronizer.synchronizer import Synchronizer

# Lazy, so that a fetch process (``python -m dd_queue.synchronizer.fetchers``) loads only what
# it reads with, not the whole synchronizer.
__getattr__ = lazy_exports(
    __name__,
    {
        "hard_kill": "context",
        "FragmentStatus": "runtime",
        "ArraySource": "source",
        "ConfigModelSource": "source",
        "ModelSource": "source",
        "plan_of": "source",
        "Synchronizer": "synchronizer",
    },
)

__all__ = [
    "ArraySource",
    "ConfigModelSource",
    "FragmentState",
    "FragmentStatus",
    "ModelSource",
    "SegmentRecord",
    "Synchronizer",
    "VersionRef",
    "hard_kill",
    "plan_of",
]
