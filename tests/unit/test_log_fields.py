"""JSON logs carry values as fields: from the real log lines of a short in-process run, and from
the template rules on edge cases."""

from __future__ import annotations

import json
import logging

import pytest

from dd_queue.log import _JsonFormatter, fields, template_fields
from tests.unit.test_runner_support import run_tiny


def _record(template: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("dd_queue.x", logging.INFO, "f.py", 1, template, args, None)
    if extra:
        record.ddq = extra
    return record


def test_a_real_run_logs_rounds_as_fields(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dd_queue"):
        run_tiny()
    formatter = _JsonFormatter("test")
    lines = [json.loads(formatter.format(r)) for r in caplog.records]
    merged = [x for x in lines if x.get("event") == "round.merged"]
    assert merged, sorted({x.get("event") for x in lines})
    for x in merged:
        assert isinstance(x["fragment"], int) and isinstance(x["round"], int)
        assert x["version"] >= 1 and isinstance(x["reason"], str) and x["reason"]
    opened = [x for x in lines if x.get("event") == "round.opened"]
    assert opened and all(isinstance(x["fragment"], int) for x in opened)


def test_template_rules() -> None:
    progress = _record(
        "learner.progress step %d loss %.4f lr %.2e tokens %d versions %s",
        *(12, 3.5, 1e-3, 4096, {0: 2}),
        learner="L1",
    )
    line = json.loads(_JsonFormatter("learner L1").format(progress))
    assert line["event"] == "learner.progress" and line["learner"] == "L1"
    assert (line["step"], line["loss"], line["lr"], line["tokens"]) == (12, 3.5, 1e-3, 4096)
    assert line["versions"] == {"0": 2}
    # a placeholder in the event name; the reason after the last colon; %% is no placeholder
    got = template_fields(_record("contribution.%s fragment %d: %s", "late", 1, "too late"))
    assert got == {"event": "contribution.late", "fragment": 1, "reason": "too late"}
    assert template_fields(_record("grace 100%% of %d s for fragment %d", 3, 2)) == {"fragment": 2}
    # plain messages, no args, a non-event first word
    assert template_fields(_record("hello world")) == {}
    assert template_fields(_record("eval.resumed after %.0f s", 3.0)) == {"event": "eval.resumed"}
    assert fields(a=1) == {"ddq": {"a": 1}}


def test_extra_fields_win_over_template_ones() -> None:
    record = _record("round.merged fragment %d: %s", 3, "why", fragment=4)
    assert json.loads(_JsonFormatter("s").format(record))["fragment"] == 4
