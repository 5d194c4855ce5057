"""``ddq simulate --sensitivity``: every variant changes only what it names, on a common
failure history, and the table shows the change against the baseline and the published value."""

from __future__ import annotations

import json

import pytest

from dd_queue.cli import main
from dd_queue.sim import load_sim_config
from dd_queue.sim.published import PUBLISHED
from dd_queue.sim.sensitivity import (
    COMBINED,
    POINTS,
    VARIANTS,
    Point,
    Variant,
    run_sensitivity,
    sensitivity_payload,
    sensitivity_table,
)

TINY = Point(16_384, ("plain_dp", "elastic_dp", "decoupled"), 4)


def test_variants_change_what_they_name_against_a_common_baseline() -> None:
    base = load_sim_config(None, {"sweep.duration_days": "0.5"})
    variants = (
        Variant("nothing", {}, "the same as the baseline"),
        Variant("barrier", {"accounting.barrier_wait": "goodput"}, "counted"),
        Variant("restart 60 s", {"spmd.restart_s": 60.0}, "plain DP only"),
    )
    rows = run_sensitivity(base, points=(TINY,), variants=variants)
    assert [r.name for r in rows] == ["baseline", "nothing", "barrier", "restart 60 s"]
    baseline, same, barrier, restart = (r.goodput for r in rows)
    assert same == baseline  # the same seed: the same failure history
    assert all(barrier[k] > baseline[k] for k in baseline)
    assert restart[(16_384, "plain_dp")] < baseline[(16_384, "plain_dp")]
    for label in ("elastic_dp", "decoupled_M4"):  # a plain-DP knob leaves the others alone
        assert restart[(16_384, label)] == baseline[(16_384, label)]
    table = sensitivity_table(rows)
    assert "| baseline |" in table and "(+0.0)" in table and "**published**" in table
    assert "Most moving" in table
    payload = json.loads(json.dumps(sensitivity_payload(rows)))
    assert payload["kind"] == "sensitivity" and len(payload["rows"]) == 4
    assert len(payload["published"]) == len(PUBLISHED)


def test_the_points_are_the_published_ones() -> None:
    labels = {(p.chips, label) for p in POINTS for label in p.labels()}
    assert labels == {(p.chips, p.label) for p in PUBLISHED}
    names = [v.name for v in VARIANTS + COMBINED]
    assert len(names) == len(set(names))
    for variant in VARIANTS + COMBINED:  # every change names a real field
        load_sim_config(None, {k: str(v).lower() for k, v in variant.changes.items()})


def test_cli_runs_the_sensitivity_and_prints_json_last(capsys: pytest.CaptureFixture[str]) -> None:
    # tiny: one day of 2.4M chips would be slow here, so shrink the points through --set
    code = main(["simulate", "--sensitivity", "--set", "sweep.duration_days=0.02", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    last = json.loads(out.strip().splitlines()[-1])
    assert last["kind"] == "sensitivity" and last["rows"][0]["variant"] == "baseline"
    assert "published: Douillard et al." in out
