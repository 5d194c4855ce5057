"""``ddq report RUN_DIR``: one self-contained HTML page of a finished run (``report.cli``).

``data`` reads a run out of its Redis (the run directory's AOF, loaded by a private server on a
copy) into a :class:`~dd_queue.report.data.RunReport`; ``page`` renders it, pure, as HTML with
inline SVG charts and no script, font or image from anywhere else.
"""

from dd_queue.report.data import RunReport, read_report
from dd_queue.report.page import render

__all__ = ["RunReport", "read_report", "render"]
