"""The control plane's outer gate: foreign ``Host`` names get 400, oversized bodies 413, and
both before any route, token check or JSON parse runs (no fault is sent, nothing recorded)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dd_queue.control.guard import allowed_hosts, host_name
from tests.unit.test_control_support import AUTH, Run, commands, make_run

STALL = {"target": "L1", "kind": "stall", "duration_s": 2}


@pytest.fixture
def run() -> Iterator[Run]:
    yield from make_run(allowed_hosts=("ddq.internal",), max_body_bytes=1024)


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("127.0.0.1:8000", "127.0.0.1"),
        ("LocalHost", "localhost"),
        ("[::1]:8000", "::1"),
        ("[::1]", "::1"),
        ("::1", "::1"),
        ("ddq.internal:80", "ddq.internal"),
        ("", ""),
    ],
)
def test_host_name_drops_the_port(header: str, name: str) -> None:
    assert host_name(header) == name


def test_served_names_are_loopback_the_bind_address_and_the_allow_list() -> None:
    assert allowed_hosts("0.0.0.0", ()) == {"127.0.0.1", "::1", "localhost"}
    assert allowed_hosts("::", ["A.example"]) == {"127.0.0.1", "::1", "localhost", "a.example"}
    assert "10.0.0.5" in allowed_hosts("10.0.0.5", ())


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost", "[::1]:8000", "ddq.internal"])
def test_loopback_and_allowed_names_are_served(run: Run, host: str) -> None:
    assert run.client.get("/api/state", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example"])
def test_a_rebound_name_is_refused_before_any_route(run: Run, host: str) -> None:
    for method, path in (("GET", "/api/state"), ("GET", "/"), ("POST", "/api/faults")):
        answer = run.client.request(method, path, headers={**AUTH, "Host": host}, json=STALL)
        assert answer.status_code == 400, (method, path, answer.text)
        assert "control.allowed_hosts" in answer.json()["detail"]
    assert commands(run.bus, run.cfg, "L1") == []


def test_an_oversized_body_is_refused_by_its_length_before_the_token_check(run: Run) -> None:
    big = b'{"target": "L1", "kind": "stall", "pad": "' + b"x" * 2000 + b'"}'
    for headers in ({}, AUTH):  # 413 with or without the token: the body is never parsed
        answer = run.client.post(
            "/api/faults", content=big, headers={**headers, "Content-Type": "application/json"}
        )
        assert answer.status_code == 413, answer.text
        assert "control.max_body_bytes (1024 bytes)" in answer.json()["detail"]
    assert commands(run.bus, run.cfg, "L1") == []
    assert run.client.get("/api/faults").json() == []


def test_a_chunked_body_is_cut_off_at_the_limit(run: Run) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while read, stopped past 1024
        for _ in range(1000):
            yield b" " * 100

    answer = run.client.post("/api/chaos", content=chunks(), headers=AUTH)
    assert answer.status_code == 413, answer.text
    assert "Content-Length" not in answer.request.headers


def test_a_body_within_the_limit_still_works(run: Run) -> None:
    answer = run.client.post("/api/faults", json=STALL, headers=AUTH)
    assert answer.status_code == 201, answer.text
    assert len(commands(run.bus, run.cfg, "L1")) == 1


def test_a_malformed_length_is_refused(run: Run) -> None:
    answer = run.client.post(
        "/api/faults", content=b"{}", headers={**AUTH, "Content-Length": "12x"}
    )
    assert answer.status_code == 400
