"""Golden regression: a fixed multi-round merge + outer-step sequence against a JSON fixture.

Scenario (deterministic, seeded): 3 learners, a 7-tensor model in 2 fragments (one holds the
embedding), 6 rounds alternating fragments (3 merges each), RDA and weighted mean, outer Nesterov
lr 0.7 / μ 0.9, a version ring of 2. L2 is a straggler that misses fragment 0's first publish:
in round 2 its contribution is re-anchored from v0, in round 4 v0 has left the ring and it is
dropped. In round 5, L1 has just restarted and contributes 0 tokens (weight 0).

The fixture stores, per round, the decisions (weights, anchoring reasons, fallbacks) and compact
summaries of Θ_p and the momentum b_p: norm, sum, the first 4 values and a probe (dot product with
a fixed random vector, which changes if any element changes). Floats are compared at 1e-5
relative, not as a sha256 of the bytes: norms use BLAS dot products, whose summation order
depends on the CPU's kernel, so bit-identity would tie the fixture to one machine.

Regenerate (only after an intended change): ``DDQ_WRITE_GOLDEN=1 pytest tests/golden``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dd_queue.core.anchor import VersionRing, anchor_contributions
from dd_queue.core.fragments import plan_fragments
from dd_queue.core.merge import (
    ContributionData,
    Rule,
    merge_fragment,
)
from dd_queue.core.outer import NesterovState, nesterov_step

FIXTURE = Path(__file__).parent / "fixtures" / "merge_sequence.json"
SHAPES = {
    "tok_embeddings.weight": (12, 4),
    "layers.0.attn": (6, 6),
    "layers.0.mlp": (6, 8),
    "layers.0.norm": (6,),
    "layers.1.attn": (6, 6),
    "layers.1.mlp": (8, 6),
    "norm": (6,),
}
LEARNERS = ("L0", "L1", "L2")
COUNTERS = {"L0": (1024, 4), "L1": (768, 4), "L2": (512, 4)}  # tokens, inner steps
RULES: tuple[Rule, ...] = ("rda", "rda", "mean", "rda", "rda", "mean")


def _summary(x: np.ndarray) -> dict[str, Any]:
    probe = np.random.default_rng(12345).standard_normal(x.size)
    x64 = x.astype(np.float64)
    return {
        "norm": float(np.linalg.norm(x64)),
        "sum": float(x64.sum()),
        "probe": float(probe @ x64),
        "head": [float(v) for v in x[:4]],
    }


def run_sequence() -> dict[str, Any]:
    plan = plan_fragments(SHAPES, 2)
    init = np.random.default_rng(0)
    theta = [init.standard_normal(f.size).astype(np.float32) for f in plan.fragments]
    states = [NesterovState.zeros(f.size) for f in plan.fragments]
    rings = [VersionRing(capacity=2, size=f.size) for f in plan.fragments]
    for ring, params in zip(rings, theta, strict=True):
        ring.push(0, params)
    base = {who: [0, 0] for who in LEARNERS}  # base version of each fragment per learner
    records = []
    for r, rule in enumerate(RULES):
        p = r % 2
        fragment = plan.fragments[p]
        contribs = []
        for m, who in enumerate(LEARNERS):
            rng = np.random.default_rng(1000 * r + m)
            delta = (rng.standard_normal(fragment.size) * 0.01 * (m + 1)).astype(np.float32)
            tokens, steps = (0, 0) if (r == 5 and who == "L1") else COUNTERS[who]
            contribs.append(ContributionData(who, delta, tokens, steps, base[who][p]))
        kept, outcomes = anchor_contributions(contribs, rings[p])
        merged = merge_fragment(kept, fragment, rule=rule)
        if merged.kind == "merged":
            nesterov_step(theta[p], merged.delta, states[p], lr=0.7, momentum=0.9)
        version = rings[p].latest_version + 1  # type: ignore[operator]
        rings[p].push(version, theta[p])
        for who in LEARNERS:  # L2 misses fragment 0's first publish: a straggler
            if not (who == "L2" and p == 0):
                base[who][p] = version
        records.append(
            {
                "round": r,
                "fragment": p,
                "rule": rule,
                "version": version,
                "kind": merged.kind,
                "anchoring": [o.reason for o in outcomes],
                "learners": list(merged.learner_ids),
                "weights": list(merged.weights),
                "fallback_segments": list(merged.fallback_segments),
                "delta_norm": merged.delta_norm,
                "params": _summary(theta[p]),
                "momentum": _summary(states[p].momentum_buffer),
            }
        )
    return {"plan_digest": plan.digest, "sizes": list(plan.sizes), "rounds": records}


def _compare(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), path
        for key in want:
            _compare(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _compare(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), path
    else:
        assert got == want, path


def test_merge_and_outer_step_sequence_matches_the_golden_fixture() -> None:
    got = json.loads(json.dumps(run_sequence()))  # the same types as the stored fixture
    if os.environ.get("DDQ_WRITE_GOLDEN") == "1":
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    if not FIXTURE.exists():
        pytest.fail(f"{FIXTURE} is missing; generate it with DDQ_WRITE_GOLDEN=1 and review it")
    want = json.loads(FIXTURE.read_text(encoding="utf-8"))
    _compare(got, want)


def test_the_scenario_exercises_what_it_claims() -> None:
    rounds = run_sequence()["rounds"]
    assert rounds[2]["anchoring"][2] == "L2: re-anchored from v0 to v1"
    assert "left the ring" in rounds[4]["anchoring"][2] and rounds[4]["learners"] == ["L0", "L1"]
    assert rounds[5]["weights"][1] == 0.0 and {r["rule"] for r in rounds} == {"rda", "mean"}
