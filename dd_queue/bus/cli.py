"""``ddq slots``: where a run's keys live on a Redis Cluster.

    ddq slots --config demo                    # over an even split of 3 masters (no server)
    ddq slots --config demo --masters 6
    ddq slots --config run.yaml --live         # the cluster redis.url names, as it is now
    ddq slots --config demo --json

One row per key family (each fragment, the heartbeats, events, round openings, the control
stream and a counters hash: ``dd_queue.bus.slots``), with its slot and the master serving it,
then the count of fragments per master.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from dd_queue.bus.slots import NodeSlots, even_split, placement, run_slots
from dd_queue.config import CONFIG_HELP, load_config
from dd_queue.errors import ConfigError
from dd_queue.keys import Keys

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``slots`` subcommand to the ``ddq`` parser."""
    p = sub.add_parser(
        "slots",
        help="show which Redis Cluster slot and master each of a run's key families uses",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--config", default="base", help=CONFIG_HELP)
    p.add_argument(
        "--masters", type=int, default=3, help="masters of the even split (default %(default)s)"
    )
    p.add_argument(
        "--live", action="store_true", help="ask the cluster of redis.url for its slot ranges"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    p.set_defaults(func=_cmd_slots)


def _live_nodes(url: str, cfg: Any) -> list[NodeSlots]:
    from dd_queue.bus.redis_streams import RedisBus  # a server to ask: import only then

    bus = RedisBus(url, cfg.run.run_id, options=cfg.redis.options())
    try:
        if not bus.cluster:
            raise ConfigError(f"--live needs a cluster URL (redis+cluster://...), not {url!r}")
        ranges: dict[str, list[tuple[int, int]]] = {}
        for (lo, hi), node in bus.slot_ranges():
            ranges.setdefault(node, []).append((lo, hi))
        return [NodeSlots(node, tuple(sorted(r))) for node, r in sorted(ranges.items())]
    finally:
        bus.close()


def _cmd_slots(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, os.environ)
    if args.masters < 1:
        raise ConfigError("--masters must be >= 1")
    nodes = _live_nodes(cfg.redis.url, cfg) if args.live else even_split(args.masters)
    slots = run_slots(Keys(cfg.run.run_id), cfg.synchronizer.n_fragments)
    held = placement(slots, nodes)
    where = {family: node for node, families in held.items() for family in families}
    out = sys.stdout
    out.write(f"run {cfg.run.run_id!r}, {cfg.synchronizer.n_fragments} fragments, ")
    out.write(f"{len(nodes)} masters ({'live' if args.live else 'even split'})\n\n")
    out.write("| keys | slot | master |\n|---|---:|---|\n")
    for family, slot in slots.items():
        out.write(f"| {family} | {slot} | {where[family]} |\n")
    per_master = {
        node: sum(f.startswith("fragment ") for f in families) for node, families in held.items()
    }
    out.write("\nfragments per master: ")
    out.write(", ".join(f"{node} {n}" for node, n in per_master.items()) + "\n")
    if args.json:
        out.write(
            json.dumps({"slots": slots, "master_of": where, "fragments_per_master": per_master})
            + "\n"
        )
    return 0
