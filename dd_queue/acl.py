"""Redis ACL users of one run: each role gets only its keys and its commands.

    ddq acl --config demo --out acl/          # acl/users.acl + one password file per user
    redis-server --aclfile acl/users.acl ...
    DDQ__REDIS__URL=redis://demo-learner-L0@redis-host:6379/0 \\
      DDQ__REDIS__PASSWORD_FILE=acl/demo-learner-L0.password ddq learner --learner-id L0 ...

The rules are data (:func:`roles`): every grant carries the reason it is there, written beside
the aclfile in ``roles.md`` (Redis allows no comments in an aclfile). Key patterns follow the
key table of :mod:`dd_queue.keys` (``%R~`` read, ``%W~`` write, ``~`` both). Commands are an
allow-list per role, never a category: a keyless write (``FLUSHALL``) is refused to every role
but ``admin``. Scripts run with the caller's rights (Redis 7 checks each command a script runs),
so ``EVALSHA`` opens nothing the role could not do by hand.

What the roles may do:

=============  ===========================================================================
role           may
=============  ===========================================================================
learner        read global fragments, fragment states, version notices, round openings and
(one per id)   its own and the ``all`` control stream; append contributions; write its own
               payload keys; heartbeat; append events. Never: global or momentum blobs,
               fragment state, leases, another learner's payloads, any control stream.
synchronizer   every key of the run's fragments (leases, commits, globals, dead letters);
               round openings, heartbeats, events; read the control streams.
control        read every key of the run; write control streams (faults) and events;
               heartbeat.
evaluator      read global fragments and their notices; append events.
admin          everything (operators, ``ddq up``-style tooling).
=============  ===========================================================================

What ACLs cannot do: the heartbeat keys and a fragment's ``up`` stream are shared by every
learner, so a learner could still forge another learner's heartbeat or contribution entry.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dd_queue.config import CONFIG_HELP, load_config
from dd_queue.keys import Keys, check_name

__all__ = ["Grant", "Role", "aclfile", "register", "roles"]

ACL_FILE = "users.acl"
EXPLAINED = "roles.md"


@dataclass(frozen=True, slots=True)
class Grant:
    """One ACL rule of a role (``%R~pattern``, ``+command``) and why the role has it."""

    rule: str
    reason: str


@dataclass(frozen=True, slots=True)
class Role:
    """An ACL user: its role, its name and its grants."""

    role: str
    user: str
    grants: tuple[Grant, ...]

    @property
    def commands(self) -> list[str]:
        return [g.rule for g in self.grants if g.rule.startswith(("+", "-"))]

    @property
    def keys(self) -> list[str]:
        return [g.rule for g in self.grants if not g.rule.startswith(("+", "-"))]


def _cmds(reason: str, *names: str) -> list[Grant]:
    return [Grant(f"+{n}", reason) for n in names]


_CONNECT = _cmds(
    "connect: AUTH/HELLO, name the client, PING health checks, INFO for the server version",
    *("hello", "client|setname", "ping", "info", "select"),
)
_CLUSTER = _cmds(
    "on a Redis Cluster, read the slot map (the client routes every key by it); harmless on one "
    "server",
    *("cluster|slots", "cluster|shards", "cluster|nodes", "cluster|info", "command"),
)
_SCRIPTS = _cmds(
    "run dd_queue's Lua scripts (each command inside is checked against these rules)",
    *("evalsha", "eval", "script|load", "script|exists"),
)
_HEARTBEAT = _cmds(
    "heartbeat script: member → last beat, expiry and payload; drop expired members",
    *("zadd", "zrem", "zrange", "zrangebyscore", "hset", "hdel", "hget", "hgetall", "time"),
)
_READ_BLOBS = _cmds("read payloads (chunked values)", "get", "mget", "exists", "type")
_READ_STREAMS = _cmds("read streams (notices, openings, commands)", "xread", "xrevrange", "xrange")


def roles(run_id: str, learner_ids: Sequence[str], *, prefix: str | None = None) -> list[Role]:
    """The ACL users of run ``run_id``: one per learner id, and one each for the synchronizer,
    the control plane, the evaluator and an admin. User names are ``<prefix>-<role>`` (learners
    ``<prefix>-learner-<id>``); ``prefix`` defaults to the run id.
    """
    run = check_name("run_id", run_id)
    prefix = check_name("prefix", prefix or run)
    p, keys = f"ddq:{run}:", Keys(run)
    frag = f"{p}{{{run}.f*}}:"
    beats = Grant(
        f"~{keys.heartbeat_pattern()}", "heartbeat keys (its own beat; everyone's liveness)"
    )
    events = Grant(f"~{keys.events()}", "the run's event log (dashboard)")
    read_globals = [
        Grant(f"%R~{frag}global:*", "global fragments Θ_p (payload and chunks)"),
        Grant(f"%R~{frag}state", "fragment state: the current version and its blob"),
        Grant(f"%R~{frag}down", "version notices of every fragment"),
    ]
    out = []
    for learner in learner_ids:
        lid = check_name("learner_id", learner)
        grants = [
            *read_globals,
            Grant(f"%R~{keys.opened_rounds()}", "round openings (when to contribute)"),
            Grant(f"%R~{p}control:{lid}", "its own fault commands"),
            Grant(f"%R~{p}control:all", "fault commands for every member"),
            Grant(f"%W~{frag}up", "append contributions (metadata entries)"),
            Grant(f"~{frag}blob:up:*:{lid}", "its own contribution payloads"),
            Grant(f"~{frag}blob:up:*:{lid}:c*", "its own contribution payload chunks"),
            beats,
            events,
            *_CONNECT,
            *_CLUSTER,
            *_SCRIPTS,
            *_HEARTBEAT,
            *_READ_BLOBS,
            *_READ_STREAMS,
            *_cmds("write its payloads (SET PX) and drop them", "set", "del", "unlink", "pexpire"),
            *_cmds("append contributions and events", "xadd"),
            Grant(f"~{p}counts:refused", "count the messages it refused"),
            Grant(f"~{p}counts:tokens", "count the tokens it computed, published, dropped"),
            *_cmds("count refused messages and its tokens", "hincrby"),
        ]
        out.append(Role("learner", f"{prefix}-learner-{lid}", tuple(grants)))
    out.append(
        Role(
            "synchronizer",
            f"{prefix}-synchronizer",
            (
                Grant(f"~{frag}*", "every key of the run's fragments: leases, commits, blobs"),
                Grant(f"~{keys.opened_rounds()}", "round openings"),
                Grant(f"%R~{p}control:*", "fault commands (synchronizer, all)"),
                beats,
                events,
                *_CONNECT,
                *_CLUSTER,
                *_CLUSTER,
                *_SCRIPTS,
                *_HEARTBEAT,
                *_READ_BLOBS,
                *_READ_STREAMS,
                *_cmds(
                    "stage, commit and expire blobs; fenced leases",
                    *("set", "del", "unlink", "pexpire", "pttl", "incr"),
                ),
                *_cmds(
                    "the contribution group: read, ack, reclaim, dead-letter",
                    *("xadd", "xreadgroup", "xack", "xautoclaim", "xclaim", "xpending"),
                    *("xgroup|create", "xgroup|createconsumer", "xlen", "xtrim", "xdel"),
                ),
                Grant(f"~{p}counts:refused", "count the messages it refused"),
                *_cmds("count refused messages", "hincrby"),
            ),
        )
    )
    out.append(
        Role(
            "control",
            f"{prefix}-control",
            (
                Grant(f"%R~{p}*", "read every key of the run (dashboard, API, metrics)"),
                Grant(f"%W~{p}control:*", "send fault commands"),
                Grant(f"~{p}counts:*", "count faults sent and heartbeats refused"),
                beats,
                events,
                *_CONNECT,
                *_CLUSTER,
                *_CLUSTER,
                *_SCRIPTS,
                *_HEARTBEAT,
                *_READ_BLOBS,
                *_READ_STREAMS,
                *_cmds("send commands and events", "xadd"),
                *_cmds("inspect streams and the contribution group", "xlen", "xpending"),
                *_cmds("stream and group facts for the dashboard", "xinfo|stream", "xinfo|groups"),
                *_cmds("count faults and refusals", "hincrby"),
            ),
        )
    )
    out.append(
        Role(
            "evaluator",
            f"{prefix}-evaluator",
            (
                *read_globals,
                Grant(f"{beats.rule.replace('~', '%R~', 1)}", "liveness (start waits)"),
                events,
                *_CONNECT,
                *_CLUSTER,
                *_CLUSTER,
                *_READ_BLOBS,
                *_READ_STREAMS,
                *_cmds("heartbeat reads (start waits)", "zrangebyscore", "zrange", "hgetall"),
                *_cmds("append eval results to the event log", "xadd"),
            ),
        )
    )
    out.append(Role("admin", f"{prefix}-admin", (Grant("~* &* +@all", "operators: everything"),)))
    return out


def password_hash(password: str) -> str:
    """The aclfile form of a password: ``#`` + its SHA-256 (the file holds no password)."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def aclfile(users: Sequence[Role], passwords: dict[str, str]) -> str:
    """The aclfile text (Redis allows no comments in it): ``user default off``, then one line a
    user. The reasons are in :func:`explain`."""
    lines = ["user default off"]  # every client must log in as one of the users below
    for role in users:
        rules = " ".join(g.rule for g in role.grants)
        hashed = password_hash(passwords[role.user])
        lines.append(f"user {role.user} on {hashed} resetchannels -@all {rules}")
    return "\n".join(lines) + "\n"


def explain(users: Sequence[Role]) -> str:
    """Markdown: each user, each of its rules and why it has it (``roles.md`` beside the file)."""
    out = [
        "# dd_queue ACL users (written by `ddq acl`)",
        "",
        "`users.acl` turns the default user off and gives each role only these rules "
        "(`%R~` read, `%W~` write, `~` both; `+cmd` allowed commands, all others refused).",
    ]
    for role in users:
        out += ["", f"## {role.user} ({role.role})", "", "| rule | why |", "|---|---|"]
        out += [f"| `{g.rule}` | {g.reason} |" for g in role.grants]
    return "\n".join(out) + "\n"


def write_users(out: Path, users: Sequence[Role]) -> dict[str, Path]:
    """Write ``out/users.acl``, ``out/roles.md`` and ``out/<user>.password`` (0600; an existing
    password file is kept, so re-running keeps every host's credentials).

    Returns:
        User → its password file.
    """
    out.mkdir(parents=True, exist_ok=True)
    files, passwords = {}, {}
    for role in users:
        path = out / f"{role.user}.password"
        if path.exists():
            password = path.read_text(encoding="utf-8").removesuffix("\n")
        else:
            password = secrets.token_urlsafe(32)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(password + "\n")
        files[role.user], passwords[role.user] = path, password
    fd = os.open(out / ACL_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(aclfile(users, passwords))
    (out / EXPLAINED).write_text(explain(users), encoding="utf-8")
    return files


def _cmd_acl(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, os.environ)
    n = args.learners if args.learners is not None else cfg.membership.expected_learners
    if n < 1:
        sys.stderr.write(f"ddq acl: error: --learners must be >= 1, got {n}\n")
        return 2
    users = roles(cfg.run.run_id, [f"L{i}" for i in range(n)], prefix=args.prefix)
    files = write_users(args.out, users)
    rows = [
        {"user": r.user, "role": r.role, "password_file": str(files[r.user]), "keys": r.keys}
        for r in users
    ]
    for row in rows:
        sys.stdout.write(f"{row['user']:<32} {row['role']:<13} {row['password_file']}\n")
    sys.stdout.write(
        f"wrote {args.out / ACL_FILE}: start Redis with --aclfile {args.out / ACL_FILE}; each "
        "service sets DDQ__REDIS__URL=redis://<user>@host:port/db and "
        "DDQ__REDIS__PASSWORD_FILE=<its password file>\n"
    )
    if args.json:
        sys.stdout.write(json.dumps({"aclfile": str(args.out / ACL_FILE), "users": rows}) + "\n")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("acl", help="write Redis ACL users (one per role) and their passwords")
    p.add_argument("--config", default="base", help=CONFIG_HELP)
    p.add_argument("--out", type=Path, required=True, help="directory for users.acl and passwords")
    p.add_argument(
        "--learners", type=int, help="learner users L0..L{n-1} (default: expected_learners)"
    )
    p.add_argument("--prefix", help="user name prefix (default: the run id)")
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.set_defaults(func=_cmd_acl)
