"""``honcho start`` on the project's Procfile, as a user runs it, and the docs' commands on it.

One formation (Redis, synchronizer, evaluator, three learners, control plane, each under
``dd_queue.supervise``) runs for the whole module, on free ports in a scratch directory:

1. The fault and inspection commands of README.md ("Break it on purpose") and of
   dd_queue/control/README.md ("Faults", "Chaos") run as written through bash and curl (curl
   with ``--fail-with-body`` so an error answer fails), with the live port, token and chaos
   schedule id substituted. They stall, slow and kill learners and kill the synchronizer.
2. The formation stays whole for at least 90 s of merging: honcho never stops a process, the
   killed ones come back (new pids) and contribute again, every learner's work is merged,
   versions rise and the held-out loss falls.
3. Ctrl-C stops every process cleanly (exit 0).
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.formation import ROOT, SERVICES, TOKEN, Formation

pytestmark = pytest.mark.timeout(900)

MERGING_FOR_S = 95.0


def shell_blocks(markdown: Path, heading: str) -> list[str]:
    """The ```bash blocks of the section under ``heading`` (up to the next heading)."""
    text = markdown.read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n#", start + len(heading) + 2)
    section = text[start : end if end >= 0 else None]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def commands(block: str) -> list[str]:
    """The block's commands, one string each (backslash continuations joined)."""
    joined = re.sub(r"\\\n\s*", "", block)
    return [line + "\n" for line in joined.splitlines() if line.strip()]


def run_block(formation: Formation, block: str, **substitutions: str) -> str:
    """Run one docs block as written, against the live formation; fail on any error answer."""
    script = block.replace("<token>", TOKEN)
    script = re.sub(r"(127\.0\.0\.1|localhost):8000", f"127.0.0.1:{formation.port}", script)
    for pattern, value in substitutions.items():
        script = re.sub(pattern, value, script)
    prologue = (
        "set -euo pipefail -x\n"
        'curl() { command curl -sS --fail-with-body --max-time 30 "$@"; echo; }\n'
    )
    done = subprocess.run(
        ["bash", "-c", prologue + script],
        env=formation.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"docs block failed:\n{script}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def formation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Formation]:
    f = Formation(tmp_path_factory.mktemp("procfile")).start()
    try:
        f.wait_for(lambda: f.get("/readyz")["ready"], 240, "/readyz")
        f.wait_for(
            lambda: (
                len(f.learners()) == 3
                and all(x["state"] == "active" for x in f.learners().values())
                and f.state()["rounds_merged"] > 0
            ),
            240,
            "three active learners and a merge",
        )
        f.merging_since_s = time.monotonic()  # type: ignore[attr-defined]
        yield f
    finally:
        f.close()


def _live(f: Formation, *learners: str) -> bool:
    found = f.learners()
    return all(found[x]["state"] in ("active", "straggling") for x in learners) and bool(
        f.synchronizer_pids()
    )


def test_docs_fault_and_inspection_commands_succeed_as_written(formation: Formation) -> None:
    f = formation
    first_sync = f.synchronizer_pids()
    l0_pid = f.learners()["L0"]["pid"]
    (readme_block,) = shell_blocks(ROOT / "README.md", "## Break it on purpose")
    out = run_block(f, readme_block)
    assert '"kind":"stall"' in out and '"kind":"kill"' in out and "ddq_rounds_total" in out

    # the killed learner and synchronizer come back under their supervisors
    f.wait_for(lambda: f.learners()["L0"]["pid"] != l0_pid, 120, "L0 restarted")
    f.wait_for(lambda: f.synchronizer_pids() - first_sync, 120, "the synchronizer restarted")
    f.wait_for(lambda: _live(f, "L0", "L1", "L2"), 120, "every learner live again")

    control_readme = ROOT / "dd_queue" / "control" / "README.md"
    (faults_block,) = shell_blocks(control_readme, "## Faults")
    second_sync = f.synchronizer_pids()
    out = run_block(f, faults_block)
    assert out.count('"fault_id"') == 5, out
    f.wait_for(lambda: f.synchronizer_pids() - second_sync, 120, "the synchronizer restarted")
    f.wait_for(lambda: _live(f, "L0", "L1", "L2"), 120, "every learner live again")

    (chaos_block,) = shell_blocks(control_readme, "## Chaos")
    token_line = next(x for x in faults_block.splitlines() if x.startswith("T=")) + "\n"
    start, stop, replay = commands(chaos_block)
    started = run_block(f, token_line + start)
    schedule_id = re.search(r'"schedule_id":"([0-9a-f]+)"', started)
    assert schedule_id, started
    assert '"active":true' in run_block(f, "curl 127.0.0.1:8000/api/chaos")
    run_block(f, token_line + stop)
    live_id = {r'"schedule_id": "[0-9a-f]+"': f'"schedule_id": "{schedule_id.group(1)}"'}
    replayed = run_block(f, token_line + replay, **live_id)
    assert f'"replay_of":"{schedule_id.group(1)}"' in replayed, replayed
    run_block(f, token_line + stop)  # end the replayed schedule


def test_the_formation_survives_its_faults_and_keeps_training(formation: Formation) -> None:
    f = formation
    merging_since_s: float = f.merging_since_s  # type: ignore[attr-defined]
    merged_then = f.state()["rounds_merged"]
    contributed_then = {k: v["contributions"]["merged"] for k, v in f.learners().items()}
    f.hold(max(0.0, merging_since_s + MERGING_FOR_S - time.monotonic()))
    f.wait_for(lambda: f.state()["rounds_merged"] > merged_then, 60, "merges after the faults")

    learners = f.learners()
    assert set(learners) == {"L0", "L1", "L2"}
    assert learners["L0"]["restarts"] >= 1, learners["L0"]
    # every learner, the restarted L0 included, contributes again after the faults
    f.wait_for(
        lambda: all(
            x["contributions"]["merged"] > contributed_then[k] for k, x in f.learners().items()
        ),
        90,
        "every learner merged again",
    )
    faults: list[dict[str, Any]] = f.get("/api/faults", limit=100)
    by_kind = {(x["target"], x["kind"]): x for x in faults}
    for key in (("L1", "stall"), ("L0", "slow"), ("L0", "kill"), ("synchronizer", "kill")):
        assert key in by_kind, sorted(by_kind)
    for key in (("L1", "stall"), ("L0", "kill")):
        assert by_kind[key]["status"] in ("effective", "done"), by_kind[key]

    state = f.state()
    assert all(p["version"] > 10 for p in state["fragments"]), state["fragments"]
    losses = [point["loss"] for point in state["eval"]]
    assert len(losses) >= 3, losses
    assert losses[-1] < losses[0] - 0.5, losses
    # the evaluator's loss reaches the metrics too (the control plane tails eval.done)
    metrics = f.http.get("/metrics").text
    exported = re.search(r"^ddq_eval_loss(?:\{[^}]*\})? (\S+)$", metrics, flags=re.M)
    assert exported and float(exported.group(1)) == pytest.approx(losses[-1], abs=0.5), metrics
    f.assert_whole()


def test_ctrl_c_stops_every_process_cleanly(formation: Formation) -> None:
    f = formation
    f.assert_whole()
    f.stop(timeout_s=30)
    stopped = f.stopped_lines()
    codes = {
        m.group(1): int(m.group(2))
        for line in stopped
        if (m := re.search(r"(\w+)\.1 stopped \(rc=(-?\d+)\)", line))
    }
    assert codes == dict.fromkeys(SERVICES, 0), f.tail(80)
