"""``JsonBodies``: a body POSTed to ``/api/`` is read as JSON whatever its Content-Type says when
that type is a form (what ``curl -d`` sends), ``text/plain`` or missing, exactly as if it had been
sent as ``application/json``; a body that is not JSON gets the 422 with the Content-Type hint;
multipart bodies, GET requests and paths outside ``/api/`` are left as they are."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from dd_queue.control.app import JsonBodies
from tests.unit.test_control_support import AUTH, Run, commands, make_run

STALL = {"target": "L1", "kind": "stall", "duration_s": 2.0}
CHAOS = {"action": "start", "seed": 7, "duration_s": 30, "rates_per_min": {"stall": 20}}
FORM = "application/x-www-form-urlencoded"
HINT = "Content-Type: application/json"
LENIENT = [FORM, "text/plain", None, f"{FORM}; charset=utf-8", "Text/Plain; charset=utf-8"]


@pytest.fixture
def run() -> Iterator[Run]:
    yield from make_run()


def post(run: Run, path: str, body: str, content_type: str | None) -> Any:
    headers = dict(AUTH) if content_type is None else {**AUTH, "Content-Type": content_type}
    answer = run.client.post(path, content=body, headers=headers)
    sent = answer.request.headers.get("content-type")
    assert sent == content_type, f"the client sent Content-Type {sent!r}"
    return answer


# ── through the app ─────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("content_type", LENIENT)
def test_a_fault_body_is_json_whatever_the_lenient_type(run: Run, content_type: str | None) -> None:
    proper = run.client.post("/api/faults", json=STALL, headers=AUTH)
    lenient = post(run, "/api/faults", json.dumps(STALL), content_type)
    assert proper.status_code == lenient.status_code == 201, lenient.text
    a, b = proper.json(), lenient.json()
    assert set(a) == set(b)
    same = ("target", "kind", "duration_s", "params", "by", "status", "chaos")
    assert {k: a[k] for k in same} == {k: b[k] for k in same}
    assert a["fault_id"] != b["fault_id"]
    sent = commands(run.bus, run.cfg, "L1")
    assert [c.fault_id for c in sent] == [a["fault_id"], b["fault_id"]]
    assert all((c.kind, c.duration_s) == ("stall", 2.0) for c in sent)


@pytest.mark.parametrize("content_type", [FORM, "text/plain", None])
def test_a_bad_fault_is_refused_the_same_way_whatever_the_lenient_type(
    run: Run, content_type: str | None
) -> None:
    bad = {**STALL, "duration_s": 0}
    proper = run.client.post("/api/faults", json=bad, headers=AUTH)
    lenient = post(run, "/api/faults", json.dumps(bad), content_type)
    assert proper.status_code == lenient.status_code == 422
    assert proper.json()["detail"] == lenient.json()["detail"]
    assert "greater than 0" in json.dumps(lenient.json()["detail"])


def test_a_form_encoded_body_gets_422_with_the_content_type_hint(run: Run) -> None:
    answer = post(run, "/api/faults", "target=L0&kind=kill", FORM)
    assert answer.status_code == 422
    body = answer.json()
    assert HINT in body["hint"]
    assert any(e["type"] == "json_invalid" for e in body["detail"])  # it was read as JSON
    assert commands(run.bus, run.cfg, "L0") == []


@pytest.mark.parametrize("content_type", ["multipart/form-data; boundary=x", "application/xml"])
def test_other_types_are_not_rewritten(run: Run, content_type: str) -> None:
    answer = post(run, "/api/faults", json.dumps(STALL), content_type)  # JSON inside, but ...
    assert answer.status_code == 422  # ... not read as JSON: no fault
    body = answer.json()
    assert HINT in body["hint"]
    assert all(e["type"] != "json_invalid" for e in body["detail"])
    assert [e["loc"] for e in body["detail"]] == [["body"]]
    assert commands(run.bus, run.cfg, "L1") == []


def test_a_real_multipart_upload_is_422(run: Run) -> None:
    answer = run.client.post(
        "/api/faults", files={"body": ("f.json", json.dumps(STALL))}, headers=AUTH
    )
    assert answer.request.headers["content-type"].startswith("multipart/form-data")
    assert answer.status_code == 422 and HINT in answer.json()["hint"]
    assert commands(run.bus, run.cfg, "L1") == []


@pytest.mark.parametrize("content_type", [FORM, "text/plain", None])
def test_chaos_accepts_a_lenient_type(run: Run, content_type: str | None) -> None:
    answer = post(run, "/api/chaos", json.dumps(CHAOS), content_type)
    assert answer.status_code == 200, answer.text
    started = answer.json()
    assert started["active"] and started["schedule"]["seed"] == 7
    assert run.client.get("/api/chaos").json()["active"]


def test_gets_answer_as_usual_with_a_lenient_type(run: Run) -> None:
    run.client.post("/api/faults", json=STALL, headers=AUTH)
    plain = run.client.get("/api/faults")
    typed = run.client.get("/api/faults", headers={"Content-Type": FORM})
    assert plain.status_code == typed.status_code == 200
    assert plain.json() == typed.json() and len(plain.json()) == 1


# ── the middleware alone ────────────────────────────────────────────────────────────────────


def scope_seen(scope: dict[str, Any]) -> dict[str, Any]:
    """The scope that the app behind ``JsonBodies`` receives for ``scope``."""
    seen: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope)

    async def nothing(*_: Any) -> None:
        return None

    asyncio.run(JsonBodies(app)(scope, nothing, nothing))
    [got] = seen
    return got


def http(method: str, path: str, content_type: bytes | None) -> dict[str, Any]:
    headers = [(b"host", b"testserver"), (b"x-other", b"1")]
    if content_type is not None:
        headers.append((b"content-type", content_type))
    return {"type": "http", "method": method, "path": path, "headers": headers}


def content_types(scope: dict[str, Any]) -> list[bytes]:
    return [v for k, v in scope["headers"] if k == b"content-type"]


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH"])
@pytest.mark.parametrize("given", [FORM.encode(), b"text/plain; charset=utf-8", b"", None])
def test_lenient_writes_to_api_become_json(method: str, given: bytes | None) -> None:
    seen = scope_seen(http(method, "/api/faults", given))
    assert content_types(seen) == [b"application/json"]
    assert (b"x-other", b"1") in seen["headers"] and (b"host", b"testserver") in seen["headers"]


@pytest.mark.parametrize(
    ("method", "path", "given"),
    [
        ("GET", "/api/faults", FORM.encode()),
        ("DELETE", "/api/faults", b"text/plain"),
        ("POST", "/healthz", FORM.encode()),
        ("POST", "/static/app.js", b"text/plain"),
        ("POST", "/apiary/faults", FORM.encode()),
        ("POST", "/api/faults", b"multipart/form-data; boundary=x"),
        ("POST", "/api/faults", b"application/json; charset=utf-8"),
        ("GET", "/api/faults", None),
    ],
)
def test_everything_else_passes_unchanged(method: str, path: str, given: bytes | None) -> None:
    scope = http(method, path, given)
    seen = scope_seen(scope)
    assert seen["headers"] == scope["headers"]


def test_non_http_scopes_pass_unchanged() -> None:
    lifespan: dict[str, Any] = {"type": "lifespan"}
    assert scope_seen(lifespan) is lifespan
