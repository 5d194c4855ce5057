"""dd_queue: Decoupled DiLoCo over Redis Streams.

Independent learners train without waiting; a synchronizer merges their fragment contributions
under a minimum quorum and an adaptive grace window (Douillard et al., arXiv 2604.21428).
"""

from dd_queue.errors import DDQError

__version__ = "0.1.0"

__all__ = ["DDQError", "__version__"]
