"""Mutation score of the pure core and of the synchronizer's commit and lease path (mutmut).

Not part of CI: on two cores the core group takes ~11 minutes, the commit group ~55. Each
group runs in a scratch copy of the tracked tree (the work tree is never touched), with its own
``[tool.mutmut]`` section, and its score counts every mutant except the equivalent ones listed,
with their reasons, in ``scripts/mutation_equivalent.txt``.

    .venv/bin/python scripts/mutation.py                  # both groups
    .venv/bin/python scripts/mutation.py --group core     # one
    .venv/bin/python scripts/mutation.py --json           # the table, then one JSON object
    .venv/bin/python scripts/mutation.py --survivors      # also each surviving mutant's diff

Needs ``mutmut`` (``.venv/bin/pip install mutmut``); the commit group also needs
``redis-server`` (its tests include the bus contract on a real server).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENT = ROOT / "scripts" / "mutation_equivalent.txt"
# Everything the tests read besides the package and the tests themselves.
ALSO_COPY = [
    "config",
    "services",
    "docs",
    "scripts",
    "bench",
    "README.md",
    "Procfile",
    "compose.yaml",
    "BENCHMARKS.md",
    ".ci",
]
KILLED = {"killed", "timeout", "segfault", "caught by type check"}


@dataclass(frozen=True)
class Group:
    """One set of modules to mutate, the tests that should catch the mutants, and the target."""

    name: str
    modules: tuple[str, ...]
    tests: tuple[str, ...]
    target: float  # share of non-equivalent mutants that must be killed


GROUPS = {
    # The core's own tests (pure, fast); the slow model and runner tests would add ~25 s to
    # every surviving mutant of a widely used function.
    "core": Group(
        "core",
        ("dd_queue/core/*",),
        (
            *(
                f"tests/unit/test_{name}.py"
                for name in [
                    *("anchor", "blockwise", "buffers", "codec", "codec_fuzz", "fragments"),
                    "goodput",
                    *("membership", "merge", "merge_edges", "merge_float_range", "messages"),
                    *("outer", "policy", "quantize", "restarts", "rounds", "schedule"),
                    *("sim_rounds", "synchronizer", "text"),
                ]
            ),
            "tests/golden",
        ),
        0.90,
    ),
    "commit": Group(
        "commit",
        (
            "dd_queue/synchronizer/merge.py",
            "dd_queue/synchronizer/commit.py",
            "dd_queue/synchronizer/recovery.py",
            "dd_queue/bus/commit_ops.py",
            "dd_queue/bus/memory.py",
            "dd_queue/bus/redis_streams.py",
        ),
        (
            "tests/unit/test_synchronizer.py",
            "tests/unit/test_learner_synchronizer.py",
            "tests/unit/test_buffers.py",
            "tests/integration/test_synchronizer.py",
            "tests/integration/test_bus_contract.py",
            "tests/integration/test_bus_redis_only.py",
            "tests/unit/test_commit_ops.py",
            "tests/unit/test_closing_recovery.py",
            "tests/integration/test_bus_kv_edges.py",
        ),
        0.80,
    ),
}


@dataclass
class Score:
    group: Group
    statuses: dict[str, str]  # mutant → mutmut's status
    equivalent: set[str] = field(default_factory=set)
    seconds: float = 0.0

    @property
    def counted(self) -> list[str]:
        return [m for m in self.statuses if m not in self.equivalent]

    @property
    def killed(self) -> int:
        return sum(self.statuses[m] in KILLED for m in self.counted)

    @property
    def survivors(self) -> list[str]:
        return sorted(m for m in self.counted if self.statuses[m] not in KILLED)

    @property
    def stale(self) -> list[str]:
        """Listed as equivalent, yet killed: the name now points at another mutant."""
        return sorted(m for m in self.equivalent if self.statuses[m] in KILLED)

    @property
    def score(self) -> float:
        return self.killed / len(self.counted) if self.counted else 0.0

    def row(self) -> dict[str, object]:
        return {
            "group": self.group.name,
            "mutants": len(self.statuses),
            "equivalent": len(self.equivalent & self.statuses.keys()),
            "killed": self.killed,
            "surviving": len(self.survivors),
            "stale_equivalent": self.stale,
            "score": round(self.score, 4),
            "target": self.group.target,
            "passes": self.score >= self.group.target,
            "seconds": round(self.seconds, 1),
        }


def equivalent_mutants(path: Path = EQUIVALENT) -> dict[str, str]:
    """``mutant → reason`` from the list (``name  # reason`` a line; ``#`` lines are notes)."""
    found: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, reason = line.partition("#")
        if not sep or not reason.strip():
            raise SystemExit(f"{path}:{n}: an equivalent mutant needs its reason after '#'")
        found[name.strip()] = reason.strip()
    return found


def scratch_copy(into: Path, group: Group) -> Path:
    """The tracked tree under ``into``, with the group's ``[tool.mutmut]`` section."""
    tracked = subprocess.run(  # committed or not, unless git ignores it
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in filter(None, tracked):
        rel = raw.decode()
        if not (ROOT / rel).is_file():
            continue  # deleted in the work tree, not yet in the index
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    tests = [t for t in group.tests if (into / t).exists()]  # a new test file may not exist yet
    section = (
        "\n[tool.mutmut]\n"
        'source_paths = ["dd_queue"]\n'
        f"only_mutate = {json.dumps(list(group.modules))}\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
        f"also_copy = {json.dumps(ALSO_COPY)}\n"
        'pytest_add_cli_args = ["-p", "no:randomly", "-q", "-x"]\n'
    )
    with (into / "pyproject.toml").open("a") as out:
        out.write(section)
    return into


def mutmut(workdir: Path, *args: str, log: Path | None = None) -> str:
    """Run ``mutmut`` in ``workdir``; its progress spinner goes to ``log``, not the terminal."""
    exe = Path(sys.executable).with_name("mutmut")
    if not exe.exists():
        raise SystemExit("mutmut is not installed: .venv/bin/pip install mutmut")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CI": ""}  # CI: the suite's own skips apply
    if log is None:
        done = subprocess.run(
            [str(exe), *args], cwd=workdir, env=env, capture_output=True, text=True
        )
        return done.stdout
    with log.open("w") as out:
        code = subprocess.run(
            [str(exe), *args], cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT
        ).returncode
    if code != 0:
        tail = log.read_text(errors="replace").replace("\r", "\n").splitlines()[-30:]
        raise SystemExit(f"mutmut {' '.join(args)} failed ({code}):\n" + "\n".join(tail))
    return ""


def run_group(group: Group, workdir: Path, *, children: int) -> Score:
    scratch_copy(workdir, group)
    started = time.monotonic()
    mutmut(workdir, "run", "--max-children", str(children), log=workdir / "mutmut.log")
    statuses = {}
    for line in mutmut(workdir, "results", "--all", "true").splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep:
            statuses[name] = status
    known = equivalent_mutants()
    return Score(group, statuses, set(known) & statuses.keys(), time.monotonic() - started)


def table(scores: list[Score]) -> str:
    head = "| group | mutants | equivalent | killed | surviving | score | target | passes |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---|"]
    for s in scores:
        r = s.row()
        lines.append(
            f"| {r['group']} | {r['mutants']} | {r['equivalent']} | {r['killed']} | "
            f"{r['surviving']} | {s.score:.1%} | {s.group.target:.0%} | "
            f"{'yes' if r['passes'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", choices=sorted(GROUPS), action="append")
    parser.add_argument(
        "--only", action="append", help="mutate only these files of the group (glob)"
    )
    parser.add_argument(
        "--max-children",
        type=int,
        help="parallel mutants (default: every CPU for core; 1 for commit, whose lease tests "
        "fail under load and would count as kills)",
    )
    parser.add_argument("--workdir", type=Path, help="keep the scratch copies here")
    parser.add_argument("--survivors", action="store_true", help="print each survivor's diff")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    args = parser.parse_args(argv)
    base = args.workdir or Path(tempfile.mkdtemp(prefix="ddq-mutation-"))
    scores = []
    for name in args.group or sorted(GROUPS):
        workdir = base / name
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        group = GROUPS[name]
        if args.only:
            group = Group(group.name, tuple(args.only), group.tests, group.target)
        children = args.max_children or (1 if name == "commit" else os.cpu_count() or 2)
        score = run_group(group, workdir, children=children)
        scores.append(score)
        print(f"{name}: {score.killed}/{len(score.counted)} killed in {score.seconds:.0f} s")
        for mutant in score.survivors:
            print(f"  survived: {mutant} ({score.statuses[mutant]})")
            if args.survivors:
                print(re.sub(r"^", "    ", mutmut(workdir, "show", mutant), flags=re.M))
        for mutant in score.stale:
            print(f"  stale line in {EQUIVALENT.name}: {mutant} is killed; re-check the function")
    print(table(scores))
    print(f"scratch copies: {base}")
    if args.json:
        print(json.dumps({"groups": [s.row() for s in scores]}))
    return 0 if all(s.score >= s.group.target for s in scores) else 1


if __name__ == "__main__":
    raise SystemExit(main())
