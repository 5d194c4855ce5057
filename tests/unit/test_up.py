"""``ddq up``: argument handling, run directories, supervision and the summary's two forms."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from dd_queue.cli import main
from dd_queue.up import cli as up_cli
from dd_queue.up.procs import Children, redis_command
from dd_queue.up.run import make_run_dir, pick_port
from dd_queue.up.summary import Summary, format_summary, summary_json


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up_cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["up", *argv])


def test_defaults() -> None:
    opts = up_cli.options_from_args(_parse())
    assert opts.config == Path("config/demo.yaml")
    assert (opts.learners, opts.duration_s, opts.chaos, opts.port) == (3, 0.0, False, 0)


def test_all_options() -> None:
    args = _parse("--config", "x.yaml", "--learners", "5", "--duration", "90", "--chaos")
    args2 = _parse("--port", "8123", "--json", "--runs-dir", "/tmp/r")
    opts = up_cli.options_from_args(args)
    assert (opts.config, opts.learners, opts.duration_s, opts.chaos) == (
        Path("x.yaml"),
        5,
        90.0,
        True,
    )
    assert up_cli.options_from_args(args2).port == 8123
    assert args2.json and up_cli.options_from_args(args2).runs_dir == Path("/tmp/r")


@pytest.mark.parametrize(
    "argv",
    [["--learners", "0"], ["--learners", "x"], ["--duration", "-1"], ["--port", "-5"]],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(*argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_missing_redis_server_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(up_cli, "find_redis_server", lambda: None)
    assert main(["up", "--duration", "1"]) == up_cli.EXIT_NO_REDIS
    err = capsys.readouterr().err
    assert "apt-get install -y redis-server" in err


def test_redis_command_has_aof_and_noeviction(tmp_path: Path) -> None:
    cmd = " ".join(redis_command("redis-server", 7000, tmp_path))
    for part in ("--appendonly yes", "--appendfsync everysec", "noeviction", str(tmp_path)):
        assert part in cmd
    assert "--bind 127.0.0.1" in cmd


def test_run_dir_is_new_and_named_after_the_run(tmp_path: Path) -> None:
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    first = make_run_dir(tmp_path, "demo", now)
    second = make_run_dir(tmp_path, "demo", now)
    assert first.name == "demo-20260102-030405" and second.name == "demo-20260102-030405-2"
    assert first.is_dir() and second.is_dir()


def test_pick_port_prefers_the_request() -> None:
    assert pick_port(8123, 8000) == 8123
    assert pick_port(0, 0) >= 0


def test_supervise_restarts_a_crashed_child_after_the_backoff(tmp_path: Path) -> None:
    children = Children(tmp_path, {}, tmp_path)
    child = children.start("crash", [sys.executable, "-c", "raise SystemExit(7)"], restart=True)
    done = children.start("done", [sys.executable, "-c", "pass"], restart=True)
    assert child.proc is not None and done.proc is not None
    child.proc.wait(30)
    done.proc.wait(30)
    notes = children.supervise(now_s=100.0)
    assert any("crash exited with code 7: will restart" in n for n in notes)
    assert any("done exited with code 0: stays down" in n for n in notes)
    assert children.supervise(now_s=101.0) == []  # still backing off
    assert children.supervise(now_s=104.0) == ["crash restarted"]
    assert children.restarts() == 1
    children.kill()


def _summary() -> Summary:
    return Summary(
        "demo",
        "runs/demo-1",
        wall_s=90.4,
        rounds_merged=42,
        rounds_abandoned=1,
        versions={1: 10, 0: 11},
        tokens_trained=123_456,
        tokens_merged=200_000,
        eval_loss_start=3.5,
        eval_loss_end=2.25,
        evals=5,
        contributions={"L0": 3, "L1": 0},
        learners=["L0", "L1"],
        faults_injected=2,
        restarts=1,
    )


def test_summary_text() -> None:
    text = format_summary(_summary())
    assert "rounds merged      42 (abandoned 1)" in text
    assert "f0=v11, f1=v10" in text
    assert "3.5000 → 2.2500 (5 evaluations)" in text
    assert "L0=3, L1=0 (1/2 contributed)" in text
    assert "2 injected, 1 process restarts" in text
    assert "123,456 trained" in text


def test_summary_text_without_evaluation() -> None:
    assert "n/a (no evaluation recorded)" in format_summary(Summary("demo", "d"))


def test_summary_json_is_one_line_with_derived_fields() -> None:
    line = summary_json(_summary())
    assert "\n" not in line
    data = json.loads(line)
    assert data["versions"] == {"0": 11, "1": 10}
    assert data["contributed"] == ["L0"]
    assert data["loss_fell"] is True
    assert data["rounds_merged"] == 42 and data["wall_s"] == 90.4


def test_loss_fell_needs_two_evaluations() -> None:
    s = Summary("demo", "d", eval_loss_start=3.0, eval_loss_end=3.0, evals=1)
    assert s.loss_fell is None
