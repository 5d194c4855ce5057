"""The Prometheus exposition: what it exports after a merged round, a dead letter, a fault, a
refusal and an evaluation; that it is exactly the catalogue and the README's list; Prometheus
naming rules; and that no counter goes down when the control plane restarts."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from dd_queue.bus import ops
from dd_queue.control.app import create_app
from dd_queue.control.metrics import CATALOGUE
from dd_queue.messages import Event
from tests.unit.test_control_support import AUTH, Run, make_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run() -> Iterator[Run]:
    yield from make_run()


def _busy(run: Run) -> None:
    """A fault, a refusal report and an evaluation on top of the merged round."""
    body = {"target": "L0", "kind": "stall", "duration_s": 1}
    assert run.client.post("/api/faults", json=body, headers=AUTH).status_code == 201
    event = Event(
        run_id=run.cfg.run.run_id,
        kind="eval.done",
        message="held-out loss 3.2",
        fields={"loss": 3.2, "accuracy": None, "versions": "{}", "min_version": 1, "n_examples": 8},
        at_s=run.clock.now(),
    )
    ops.emit_event(run.bus, event.to_fields(), maxlen=1000)
    ops.report_refused(run.bus, "L0", {("fault", "unauthenticated"): 2}, at_s=run.clock.now())


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def test_metrics_expose_the_run(run: Run):
    _busy(run)
    answer = run.client.get("/metrics")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    text = answer.text
    for line in (
        'ddq_rounds_total{decision="merge",fragment="0"} 1.0',
        'ddq_contributions_total{fragment="0",outcome="merged"} 1.0',
        'ddq_learners{state="active"} 2.0',
        'ddq_learner_state{learner="L0",state="active"} 1.0',
        'ddq_learner_state{learner="L0",state="dead"} 0.0',
        'ddq_learner_contributions_total{learner="L0",outcome="merged"} 1.0',
        'ddq_learner_contributions_total{learner="L1",outcome="dead_lettered"} 1.0',
        'ddq_tokens_total{learner="L0"}',
        'ddq_contribution_staleness_versions_bucket{fragment="0",le="+Inf"} 1.0',
        'ddq_round_open_to_quorum_seconds_count{fragment="0"} 1.0',
        "ddq_goodput_ratio ",
        'ddq_stream_entries{fragment="0",stream="up"}',
        'ddq_stream_entries{fragment="",stream="events"}',
        'ddq_stream_pending_entries{fragment="0"} 0.0',
        'ddq_grace_window_seconds{fragment="0"}',
        "ddq_quorum_required 1.0",
        "ddq_eval_loss 3.2",
        'ddq_faults_total{kind="stall"} 1.0',
        'ddq_refused_messages_total{kind="fault",reader="L0",reason="unauthenticated"} 2.0',
        'ddq_run_info{config_digest="',
    ):
        assert line in text, line
    dead = re.search(r'ddq_dead_letters_total\{fragment="0",reason="([^"]+)"\} 1.0', text)
    assert dead and dead.group(1) == "non_finite"


def test_the_export_is_the_catalogue_with_its_types_and_labels(run: Run):
    _busy(run)
    families = {
        f.name: f
        for f in text_string_to_metric_families(run.client.get("/metrics").text)
        if f.name.startswith("ddq_")
    }
    # memory_info is None on fakeredis: the two Redis memory gauges have no sample here
    without_server = {"ddq_redis_memory_used_bytes", "ddq_redis_memory_max_bytes"}
    for spec in CATALOGUE:
        base = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
        family = families.pop(base)
        assert family.type == spec.kind, spec.name
        if spec.name in without_server:
            continue
        assert family.samples, f"{spec.name} has no sample"
        for sample in family.samples:
            names = set(sample.labels) - {"le"}
            assert names == set(spec.labels), (spec.name, sample)
    assert not families, f"exported but not in the catalogue: {sorted(families)}"


_UNITLESS = {
    # counts of things, not measures: Prometheus names them by what they count
    "ddq_learners",
    "ddq_learner_token_fate_tokens",
    "ddq_learner_token_fate_balanced",
    "ddq_learner_state",
    "ddq_learner_queue_depth",
    "ddq_global_version",
    "ddq_quorum_contributors",
    "ddq_quorum_required",
    "ddq_synchronizers_active",
    "ddq_stream_entries",
    "ddq_stream_pending_entries",
    "ddq_eval_loss",
    "ddq_learner_train_loss",  # a loss (nats per token), like ddq_eval_loss
}
_LABELS = {
    "fragment", "decision", "outcome", "reason", "direction", "state", "learner", "queue",
    "synchronizer", "kind", "reader", "stream", "version", "python", "torch", "run_id",
    "config_digest", "run_digest", "fate",
}  # fmt: skip


def test_names_follow_prometheus_conventions():
    names = [s.name for s in CATALOGUE]
    assert len(names) == len(set(names))
    for spec in CATALOGUE:
        name = spec.name
        assert re.fullmatch(r"ddq_[a-z][a-z0-9_]*[a-z]", name), name
        assert (spec.kind == "counter") == name.endswith("_total"), name
        assert not re.search(r"_(ms|milliseconds|minutes|hours|kb|mb|percent|seconds_total_)", name)
        units = ("_seconds", "_bytes", "_ratio", "_versions", "_info")
        measured = name.removesuffix("_total").endswith(units)
        counted = spec.kind == "counter" or name in _UNITLESS
        assert measured or counted, f"{name}: name its unit (or list it as a count)"
        if name.endswith("_info"):
            assert spec.kind == "gauge"
        assert set(spec.labels) <= _LABELS, (name, spec.labels)
        assert "le" not in spec.labels and "quantile" not in spec.labels


def test_label_values_hold_one_dimension_and_ratios_stay_in_range(run: Run):
    _busy(run)
    for (name, labels), value in _samples(run.client.get("/metrics").text).items():
        for label, v in labels:
            if label == "fragment":
                assert v == "" or v.isdigit(), (name, labels)
            if label == "stream":
                assert v in {"up", "down", "rounds", "dlq", "events", "open"}, (name, labels)
            assert not re.match(r"^f\d+\.", v), (name, labels)
        if name.endswith("_ratio"):
            assert 0.0 <= value <= 1.0, (name, value)
        assert not math.isnan(value), name


def _counters(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    counters = {}
    for family in text_string_to_metric_families(text):
        if family.type in ("counter", "histogram") and family.name.startswith("ddq_"):
            for s in family.samples:
                if s.name.endswith(("_total", "_bucket", "_count", "_sum")):
                    counters[s.name, tuple(sorted(s.labels.items()))] = s.value
    return counters


def test_no_counter_goes_down_when_the_control_plane_restarts(run: Run):
    """A second control plane (a restart: nothing in memory) exports every counter at least as
    high as the first did, then both see the same new fault."""
    _busy(run)
    before = _counters(run.client.get("/metrics").text)
    app = create_app(run.cfg, run.bus, run.clock, ticker=False, min_refresh_s=0.0, seed=2)
    with TestClient(app, base_url="http://127.0.0.1") as fresh:
        after = _counters(fresh.get("/metrics").text)
        lower = {k: (v, after.get(k)) for k, v in before.items() if after.get(k, -1) < v}
        assert not lower, lower
        body = {"target": "L1", "kind": "stall", "duration_s": 1}
        assert fresh.post("/api/faults", json=body, headers=AUTH).status_code == 201
        again = _counters(run.client.get("/metrics").text)
    assert again["ddq_faults_total", (("kind", "stall"),)] == 2.0
    assert all(again[k] >= v for k, v in before.items())


def _readme_metrics() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Metrics and monitoring", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(ddq_[a-z_]+)", section, flags=re.M)


def test_the_readme_lists_every_metric_once():
    listed = _readme_metrics()
    assert sorted(listed) == sorted(s.name for s in CATALOGUE), sorted(
        set(listed) ^ {s.name for s in CATALOGUE}
    )
