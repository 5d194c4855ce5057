"""``ddq report RUN_DIR``: write a finished run's report, one self-contained HTML file.

    ddq report runs/demo-20261204-031500                  → runs/demo-.../report.html
    ddq report runs/demo-20261204-031500 --out r.html --json

The run's data is in its Redis AOF (``RUN_DIR/appendonlydir``, which ``ddq up`` keeps): the
command copies it to a temporary directory, loads the copy into a private ``redis-server`` on a
free loopback port (the same binary search as ``ddq up``), reads the run, stops the server and
removes the copy, so the run directory is never written to except for the report. It also reads
``RUN_DIR/summary.json`` (``ddq up``'s summary) for goodput, uptime and tokens trained.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from contextlib import closing
from pathlib import Path
from typing import Any

import redis

from dd_queue.bus import RedisBus
from dd_queue.config import validate_config
from dd_queue.errors import ConfigError
from dd_queue.report.data import read_report
from dd_queue.report.page import render
from dd_queue.up.procs import RedisServer
from dd_queue.up.servers import INSTALL_HINT, find_server
from dd_queue.up.summary import SUMMARY_NAME

__all__ = ["register", "write_report"]

AOF_DIR = "appendonlydir"
REPORT_NAME = "report.html"


def register(sub: Any) -> None:
    """Add the ``report`` subcommand."""
    p = sub.add_parser("report", help="write a finished run's report (one HTML file)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory ddq up wrote")
    p.add_argument("--out", help=f"where to write it (default: RUN_DIR/{REPORT_NAME})")
    p.add_argument("--run-id", help="the run to report (default: the one the AOF holds)")
    p.add_argument("--redis", metavar="PATH", help="redis-server binary (default: as ddq up)")
    p.add_argument("--json", action="store_true", help="print what was written as JSON, last")
    p.set_defaults(func=_cmd_report)


def _summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / SUMMARY_NAME
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a ddq up summary: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _run_ids(url: str) -> set[str]:
    client = redis.Redis.from_url(url)
    try:
        return {key.decode().split(":")[1] for key in client.scan_iter(match="ddq:*", count=1000)}
    finally:
        client.close()


def write_report(
    run_dir: Path, out: Path, *, run_id: str | None = None, binary: str | None = None
) -> dict[str, Any]:
    """Read the run in ``run_dir`` and write its report to ``out``; returns what was written.

    Raises:
        ConfigError: Not a run directory (no AOF), no usable redis-server, or no single run.
    """
    aof = run_dir / AOF_DIR
    if not aof.is_dir():
        raise ConfigError(
            f"{run_dir} holds no {AOF_DIR}/: give the run directory ddq up printed "
            "(runs/<run_id>-<time>/)"
        )
    server, skipped = find_server(binary)
    if server is None:
        raise ConfigError(f"no redis-server to read the run with ({'; '.join(skipped)}); "
                          f"{INSTALL_HINT}")  # fmt: skip
    summary = _summary(run_dir)
    with tempfile.TemporaryDirectory(prefix="ddq-report-") as tmp:
        shutil.copytree(aof, Path(tmp) / AOF_DIR)
        redis_server = RedisServer(server.path, Path(tmp)).start()
        try:
            found = _run_ids(redis_server.url)
            chosen = run_id or summary.get("run_id")
            if chosen is None:
                if len(found) != 1:
                    raise ConfigError(f"the AOF holds runs {sorted(found)}: pick one with --run-id")
                chosen = found.pop()
            if chosen not in found:
                raise ConfigError(f"run {chosen!r} is not in {aof} (it holds {sorted(found)})")
            limits = validate_config({"run": {"run_id": chosen}}).wire.message_limits()
            with closing(RedisBus(redis_server.url, chosen)) as bus:
                report = read_report(bus, limits, summary)
        finally:
            redis_server.stop()
    page = render(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return {
        "report": str(out),
        "run_id": report.run_id,
        "bytes": len(page.encode()),
        "rounds": len(report.rounds),
        "evals": len(report.evals),
        "faults": len(report.faults),
        "merged_token_share": report.merged_token_share,
    }


def _cmd_report(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / REPORT_NAME
    written = write_report(run_dir, out, run_id=args.run_id, binary=args.redis)
    sys.stdout.write(
        f"ddq report: {written['report']} ({written['rounds']} rounds, {written['evals']} "
        f"evaluations, {written['faults']} faults; open it in any browser, offline)\n"
    )
    if args.json:
        sys.stdout.write(json.dumps(written, sort_keys=True) + "\n")
    return 0
