"""Exit codes: ``dd_queue.errors.exit_code`` maps misconfigurations (config, protocol, core
errors) to 2, which supervisors do not restart, and failed or absent dependencies (bus errors, a
start wait that ran out) to 3, which they do; ``ddq`` returns those codes."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from dd_queue import cli
from dd_queue.errors import (
    EXIT_MISCONFIGURED,
    EXIT_UNAVAILABLE,
    BlobMissing,
    BusError,
    BusUnavailable,
    ConfigError,
    CoreError,
    CorruptPayload,
    DDQError,
    IncompatibleMessage,
    LeaseLost,
    NonFiniteValues,
    NotReady,
    PayloadTooLarge,
    ProtocolError,
    exit_code,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_two_codes() -> None:
    assert (EXIT_MISCONFIGURED, EXIT_UNAVAILABLE) == (2, 3)


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("bad key"),
        ProtocolError("bad message"),
        CorruptPayload("bit flip"),
        IncompatibleMessage("other run"),
        PayloadTooLarge("big"),
        NonFiniteValues("nan"),
        CoreError("shapes"),
        DDQError("anything else"),
    ],
)
def test_misconfigurations_exit_2(error: DDQError) -> None:
    assert exit_code(error) == 2


@pytest.mark.parametrize(
    "error",
    [
        BusError("bus"),
        BusUnavailable("redis down"),
        LeaseLost("fenced"),
        BlobMissing("expired"),
        NotReady("no synchronizer"),
    ],
)
def test_absent_dependencies_exit_3(error: DDQError) -> None:
    assert exit_code(error) == 3


def test_ddq_wait_with_an_unknown_need_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    assert cli.main(["wait", "--config", "config/demo.yaml", "--for", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown ['bogus']" in err and "redis, run, synchronizer" in err


def test_ddq_with_a_missing_config_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    assert cli.main(["config", "--config", "config/no-such-file.yaml"]) == 2
    assert "no-such-file.yaml" in capsys.readouterr().err


def test_ddq_wait_for_an_unreachable_redis_exits_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # released again: nobody listens there
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("DDQ__REDIS__URL", f"redis://127.0.0.1:{port}/0")
    argv = ["wait", "--config", "config/demo.yaml", "--for", "redis", "--timeout-s", "0"]
    assert cli.main([*argv, "--json"]) == 3
    answer = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert answer["ready"] is False and answer["needs"] == ["redis"]
    assert f"Redis at redis://127.0.0.1:{port}/0" in answer["waiting_for"]
