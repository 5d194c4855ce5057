"""The dashboard's alert rules (``core.alerts``) are deploy/alerts.yml's rules.

The names, severities and ``for`` durations are read from the YAML; every promtool case of
``deploy/alerts.test.yml`` is replayed through the Python rules, which must fire exactly what
promtool expects at each evaluation time. Then the Prometheus-like semantics one by one.
"""

from __future__ import annotations

import logging
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from dd_queue.control.alerting import Alerting
from dd_queue.core.alerts import HISTORY_S, METRICS, RULES, Sample, evaluate, labels_of

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PAGE_ONLY = {"DDQExporterDown"}  # the exporter cannot see itself down (the page raises it)


def _seconds(text: str) -> float:
    parts = re.findall(r"(\d+)(h|m|s)", str(text))
    assert parts, text
    return sum(int(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def test_the_rules_are_the_yaml_rules_in_order() -> None:
    doc = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert [r["alert"] for r in rules] == [r.name for r in RULES]
    for yml, rule in zip(rules, RULES, strict=True):
        assert yml["labels"]["severity"] == rule.severity, rule.name
        assert _seconds(yml.get("for", "0s")) == rule.for_s, rule.name
        named = set(re.findall(r"ddq_[a-z_]+", yml["expr"]))
        assert named <= METRICS, (rule.name, named - METRICS)


# ── promtool's cases, replayed ───────────────────────────────────────────────────────────────
def _expand(values: str) -> list[float]:
    """promtool's series notation: ``a``, ``a+bxn``, ``a-bxn``, ``axn`` (n+1 values), NaN."""
    out: list[float] = []
    for token in values.split():
        m = re.fullmatch(r"(-?[\d.]+)(?:([+-][\d.]+))?x(\d+)", token)
        if m:
            start, step, n = float(m[1]), float(m[2] or 0), int(m[3])
            out += [start + i * step for i in range(n + 1)]
        else:
            out.append(math.nan if token == "NaN" else float(token))
    return out


def _parse_series(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition("{")
    labels = dict(re.findall(r'(\w+)="([^"]*)"', rest))
    return name, labels


def _subject(labels: dict[str, str]) -> str:
    if "learner" in labels:
        return f"learner {labels['learner']}"
    if "fragment" in labels:
        return f"fragment {labels['fragment']}"
    return "*"


def _cases() -> list[tuple[str, dict[str, Any]]]:
    doc = yaml.safe_load((DEPLOY / "alerts.test.yml").read_text())
    return [(f"case{i}", case) for i, case in enumerate(doc["tests"])]


@pytest.mark.parametrize(("name", "case"), _cases(), ids=[n for n, _ in _cases()])
def test_promtool_cases_fire_the_same_alerts_in_python(name: str, case: dict[str, Any]) -> None:
    interval = _seconds(case["interval"])
    # one "run" per instance label: each is a control plane of its own
    runs: dict[str, dict[str, dict[Any, list[float]]]] = defaultdict(lambda: defaultdict(dict))
    for series in case["input_series"]:
        metric, labels = _parse_series(series["series"])
        instance = labels.pop("instance", "")
        labels.pop("job", None)
        runs[instance][metric][labels_of(**labels)] = _expand(series["values"])
    checks = case["alert_rule_test"]
    last = max(_seconds(c["eval_time"]) for c in checks)
    steps = int(last // interval)
    seen: dict[float, dict[str, set[tuple[str, str]]]] = defaultdict(lambda: defaultdict(set))
    for instance, metrics in runs.items():
        history: list[Sample] = []
        pending: dict[tuple[str, str], float] = {}
        for i in range(steps + 1):
            values = {
                metric: {lab: vals[i] for lab, vals in by_labels.items() if i < len(vals)}
                for metric, by_labels in metrics.items()
            }
            history.append(Sample(at_s=i * interval, values=values))
            alerts, pending = evaluate(history, pending)
            for alert in alerts:
                if alert.state == "firing":
                    subject = alert.subject if alert.subject.split()[0] in {
                        "learner", "fragment"} else "*"  # fmt: skip
                    seen[i * interval][alert.name].add((instance, subject))
    for check in checks:
        rule, at = check["alertname"], _seconds(check["eval_time"])
        if rule in PAGE_ONLY:
            assert not seen[at][rule]
            continue
        want = set()
        for exp in check["exp_alerts"]:
            labels = dict(exp["exp_labels"])
            want.add((labels.get("instance", ""), _subject(labels)))
        assert seen[at][rule] == want, (name, rule, check["eval_time"], seen[at][rule])


# ── semantics ────────────────────────────────────────────────────────────────────────────────
def _dead(at: float, dead: bool) -> Sample:
    return Sample(
        at_s=at,
        values={"ddq_learner_state": {labels_of(learner="L1", state="dead"): float(dead)}},
    )


def test_pending_until_it_has_held_for_the_rule_then_firing_then_gone() -> None:
    history: list[Sample] = []
    pending: dict[tuple[str, str], float] = {}
    states = []
    for at, dead in [(0, False), (10, True), (25, True), (40, True), (50, False), (60, True)]:
        history.append(_dead(at, dead))
        alerts, pending = evaluate(history, pending)
        states.append([(a.state, a.since_s) for a in alerts])
    assert states == [
        [],
        [("pending", 10)],
        [("pending", 10)],
        [("firing", 10)],  # held 30 s: DDQLearnerDead's `for`
        [],
        [("pending", 60)],  # a break starts it again
    ]
    (alert,) = evaluate(history, pending)[0]
    assert alert.link == "#learner-L1" and alert.subject == "learner L1"
    assert alert.summary == "learner L1 is dead" and alert.severity == "warning"


def test_a_counter_reset_counts_as_growth_from_zero_not_a_drop() -> None:
    def dlq(at: float, n: float) -> Sample:
        return Sample(at, {"ddq_dead_letters_total": {labels_of(fragment="0", reason="x"): n}})

    history = [dlq(0, 5), dlq(60, 5), dlq(120, 2)]  # a restart from 0 that counted 2 since
    (alert,) = evaluate(history, {})[0]
    assert alert.name == "DDQDeadLettersGrowing" and alert.value == 2
    history = [dlq(0, 5), dlq(700, 5), dlq(760, 5)]  # the growth fell out of the window
    assert evaluate([dlq(-10, 0), *history], {})[0] == []


def test_no_values_no_alerts_and_firing_ones_come_first() -> None:
    assert evaluate([], {}) == ([], {})
    assert evaluate([Sample(0, {})], {}) == ([], {})
    sample = Sample(
        100,
        {
            "ddq_synchronizers_active": {(): 0.0},
            "ddq_eval_loss": {(): math.inf},
        },
    )
    alerts, _ = evaluate([sample], {("DDQSynchronizerDown", "synchronizer"): 100.0})
    assert [(a.name, a.state) for a in alerts] == [
        ("DDQLossNotFinite", "firing"),  # for 0: fires at once
        ("DDQSynchronizerDown", "pending"),
    ]


def test_the_watch_logs_firing_and_resolved_once_and_forgets_old_samples(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dd_queue.control")
    watch = Alerting()
    for at in range(0, 100, 10):
        watch.observe(Sample(at, {"ddq_synchronizers_active": {(): 0.0 if at < 70 else 1.0}}))
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "alert.firing DDQSynchronizerDown synchronizer: no synchronizer heartbeat is fresh",
        "alert.resolved DDQSynchronizerDown synchronizer",
    ]
    watch.observe(Sample(HISTORY_S + 200, {}))
    assert [s.at_s for s in watch.history] == [HISTORY_S + 200]
