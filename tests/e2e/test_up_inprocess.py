"""``ddq up``'s last resort: every role in this one process on fakeredis, as the CLI runs it
when no Redis >= 7 server binary exists (``run_in_process``).

The demo config with 2 learners for 60 s: rounds merge, both learners contribute, the held-out
loss falls, every fragment's version only rises (sampled from the control plane's
``/api/state`` while the run goes on), ``/healthz`` answers, and the notice is in the summary.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from dd_queue.config import load_config
from dd_queue.up.inprocess import LOG_NAME, NOTICE, NOTICE_NAME, run_in_process
from dd_queue.up.procs import free_port
from dd_queue.up.run import UpOptions, http_call

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(200)]

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "in-process-test-token-0123456789"
DURATION_S = 60.0


class Poller:
    """Polls the control plane from a thread of the test while the run goes on."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.health: list[int] = []
        self.versions: list[dict[int, int]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="test-poller", daemon=True)

    def _loop(self) -> None:
        while not self.done.wait(2.0):
            code, _ = http_call(self.port, TOKEN, "/healthz")
            self.health.append(code)
            code, text = http_call(self.port, TOKEN, "/api/state")
            if code == 200:
                fragments = json.loads(text)["fragments"]
                self.versions.append({f["fragment_id"]: f["version"] for f in fragments})


def test_every_role_in_one_process_learns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DDQ__")}
    environ["DDQ__MEMBERSHIP__EXPECTED_LEARNERS"] = "2"  # as the CLI sets it
    environ["DDQ__CONTROL__ADMIN_TOKEN"] = TOKEN
    cfg = load_config(ROOT / "config" / "demo.yaml", environ)
    port = free_port()
    opts = UpOptions(
        config=ROOT / "config" / "demo.yaml",
        learners=2,
        duration_s=DURATION_S,
        port=port,
        runs_dir=tmp_path,
        progress_s=5.0,
    )
    poller = Poller(port)
    poller.thread.start()
    started = time.monotonic()
    try:
        summary = run_in_process(cfg, opts, environ=environ)
    finally:
        poller.done.set()
        poller.thread.join(10)
    took_s = time.monotonic() - started
    out, err = capsys.readouterr()

    assert summary.stopped_by == "duration"
    assert took_s < DURATION_S + 35, f"stopping took too long: {took_s:.0f} s"
    assert summary.rounds_merged > 0, summary
    assert summary.contributed == ["L0", "L1"], summary
    assert summary.evals >= 2 and summary.loss_fell is True, summary
    assert summary.versions and all(v > 0 for v in summary.versions.values()), summary
    assert NOTICE in summary.notes
    assert [n for n in summary.notes if n != NOTICE] == [], summary.notes  # no role failed

    assert 200 in poller.health, f"/healthz never answered: {poller.health}"
    assert len(poller.versions) >= 5, poller.versions
    for before, after in zip(poller.versions, poller.versions[1:], strict=False):
        for p, version in before.items():
            assert after.get(p, version) >= version, f"fragment {p} went back: {before} → {after}"
    assert max(max(v.values(), default=0) for v in poller.versions) > 0

    assert "fakeredis" in err and "NOTICE" in err
    assert f"admin token {TOKEN}" in out and f"http://127.0.0.1:{port}/" in out
    assert any(line.startswith("[") and "rounds" in line for line in out.splitlines())
    run_dir = Path(summary.run_dir)
    assert run_dir.parent == tmp_path
    assert (run_dir / NOTICE_NAME).read_text().strip() == NOTICE
    log_text = (run_dir / LOG_NAME).read_text()
    for role in ("synchronizer", "L0", "L1", "evaluator", "control"):
        assert f"[{role}]" in log_text, f"no log line of {role}"
    left = [t.name for t in threading.enumerate() if t.name in ("synchronizer", "L0", "L1")]
    assert not left, f"role threads still running: {left}"
