"""The reductions of ``bench/bench_resilience.py``: rates, gaps, discarded steps, relaunch
contributions and the exactly-once audit, on hand-made records."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from dd_queue.messages import ContributorRecord, EntryOutcome

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_resilience as br


def step(pid: int, n: int, t: float) -> dict[str, Any]:
    return {"ev": "step", "pid": pid, "step": n, "t": t, "mono": t}


class Round:
    """The fields of a RoundRecord the reductions read."""

    def __init__(self, closed: float, entries: list[tuple[str, str, str]], merged: bool = True):
        self.decision = "merge" if merged else "abandon"
        self.closed_at_s = closed
        self.entries = tuple(
            EntryOutcome(entry_id=e, learner_id=lid, round_id=0, outcome=out, reason="")  # type: ignore[arg-type]
            for e, lid, out in entries
        )
        self.contributors = tuple(
            ContributorRecord(learner_id=lid, weight=1.0, n_tokens=1, n_steps=1, staleness=0)
            for _, lid, out in entries
            if out == "merged"
        )


def test_rate_counts_steps_after_the_warm_step_only() -> None:
    records = [step(1, n, n * 0.5 if n <= 20 else 10.0 + (n - 20) * 0.25) for n in range(1, 41)]
    assert br.rate(records) == pytest.approx(20 / (records[-1]["t"] - records[19]["t"]))
    assert br.rate(records[:10]) is None  # never reached the warm step


def test_longest_gap_sees_the_open_gap_of_a_learner_that_stopped() -> None:
    records = [step(1, 1, 0.0), step(1, 2, 1.0), step(1, 3, 4.0), step(1, 4, 4.5)]
    assert br.longest_gap(records, 0.0, 4.5) == pytest.approx(3.0)
    assert br.longest_gap(records, 4.1, 4.5) == pytest.approx(0.5)
    assert br.longest_gap(records, 4.1, 10.0) == pytest.approx(5.5)  # silent since 4.5
    assert br.median_step(records) == pytest.approx(1.0)


def test_discarded_steps_is_how_far_the_counter_went_back() -> None:
    forward = [step(1, n, float(n)) for n in range(1, 6)]
    assert br.discarded_steps(forward) == 0
    rolled = [*forward, step(1, 3, 6.0), step(1, 4, 7.0), step(1, 5, 8.0), step(1, 6, 9.0)]
    assert br.discarded_steps(rolled) == 3 + 2 + 1


def test_first_contribution_is_the_first_merged_entry_sent_after_the_join() -> None:
    rounds = [
        Round(5.0, [("1000-0", "L1", "merged")]),  # the dead predecessor's entry
        Round(6.0, [("3000-0", "L1", "late")]),
        Round(7.0, [("3500-0", "L1", "merged")], merged=False),
        Round(8.0, [("4000-0", "L1", "merged"), ("4000-1", "L0", "merged")]),
    ]
    found = br.first_contribution(rounds, "L1", 2000.0)
    assert found is rounds[3]
    assert br.first_contribution(rounds, "L1", 5000.0) is None
    assert br.first_merge_after(rounds, 5.5) is rounds[1]  # merged (without L1's late entry)
    assert br.first_merge_after(rounds, 8.0) is None
    assert br.round_share(rounds, "L1", 0.0, 10.0) == pytest.approx(2 / 3)  # abandoned: not one
    assert br.round_share(rounds, "L0", 0.0, 10.0) == pytest.approx(1 / 3)


def test_audit_counts_twice_settled_twice_merged_and_lost_entries() -> None:
    rounds = [
        Round(1.0, [("1-0", "L0", "merged"), ("2-0", "L1", "carried")]),
        Round(2.0, [("2-0", "L1", "merged"), ("1-0", "L0", "merged")]),  # 1-0 applied twice
        Round(3.0, [("3-0", "L1", "late")]),
    ]
    sent = {"1-0", "2-0", "3-0", "4-0", "5-0", "6-0"}
    got = br.audit(rounds, sent, dead_lettered={"4-0"}, pending={"5-0"})
    assert got == {"settled_twice": 1, "merged_twice": 1, "lost": 1, "pending": 1, "sent": 6}


def test_read_jsonl_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "L0.jsonl"
    path.write_text('{"ev": "step", "pid": 1, "step": 1, "t": 0.0}\n{"ev": "st')
    assert [r["step"] for r in br.read_jsonl(path)] == [1]
    assert br.read_jsonl(tmp_path / "missing.jsonl") == []


# ── the torchft peer's reductions and the side-by-side table ──────────────────────────────
def commit(t: float, at_step: int, ok: bool, np: int = 2) -> dict[str, Any]:
    return {"ev": "commit", "pid": 1, "t": t, "step": at_step, "ok": ok, "np": np}


def test_a_failed_commit_discards_the_steps_since_the_previous_sync() -> None:
    import peer_torchft as tf

    records = [commit(1.0, 20, True), commit(2.0, 40, True)]
    assert tf.discarded_by_failed_commits(records) == 0
    records += [commit(3.0, 60, False), commit(4.0, 80, True), commit(5.0, 100, False)]
    assert tf.discarded_by_failed_commits(records) == 20 + 20
    assert tf.discarded_by_failed_commits([commit(1.0, 13, False)]) == 13  # the first sync


def test_a_relaunch_counts_its_discarded_steps_from_its_own_start() -> None:
    import peer_torchft as tf

    start = {"ev": "start", "pid": 2, "t": 3.5}
    # killed after a commit at step 300; the relaunch fails its second sync (steps 20..40)
    records = [commit(1.0, 300, True), start, commit(4.0, 20, True), commit(5.0, 40, False)]
    assert tf.discarded_by_failed_commits(records) == 20
    assert (
        tf.discarded_by_failed_commits([commit(1.0, 300, True), start, commit(2.0, 20, False)])
        == 20
    )


def test_commit_share_counts_ok_commits_with_enough_participants_in_the_window() -> None:
    import peer_torchft as tf

    commits = [
        commit(1.0, 20, True, 2),
        commit(2.0, 40, True, 1),
        commit(3.0, 60, False, 2),  # failed: not a round
        commit(4.0, 80, True, 2),
        commit(9.0, 100, True, 1),  # outside
    ]
    assert tf.commit_share(commits, 0.5, 5.0, 2) == pytest.approx(2 / 3)
    assert tf.commit_share(commits, 5.5, 6.0, 2) == 0.0


def test_the_table_puts_the_peer_beside_us_with_ratios_and_na_where_it_has_no_part() -> None:
    def steady(ours: float) -> dict[str, Any]:
        return {
            "plain_steps_per_s": {"L0": 3.0, "L1": 3.0},
            "learner_steps_per_s": {"L0": ours, "L1": ours},
            "cpu_share": {"synchronizer": 0.01},
            "contributors_per_round": 2.0,
        }

    ours = {
        "steady": [steady(2.9), steady(2.7), steady(2.8)],
        "hetero-1.5": [{"fast_steps_per_s": 2.8, "fast_round_share": 1.0}],
        "redis": [{"gap_over_median": 1.2, "back_to_next_merge_s": 7.0}],
    }
    theirs = {
        "steady": [steady(3.0)],
        "hetero-1.5": [{"fast_steps_per_s": 2.0, "fast_round_share": 1.0}],
    }
    rows = {r[0]: r[1:] for r in br.summarize(ours, theirs)}
    assert rows["steady: learners, steps/s each"] == ("2.80 [2.70–2.90]", "3.00", "0.93")
    # each system's fast learner over its own steady median
    fast = rows["peer 1.5× slower: fast learner vs steady (≥ 0.98)"]
    assert fast[:2] == ("1.000", "0.667") and fast[2] == "1.50"
    assert rows["redis kill -9 + AOF restart: back → merge, s"] == ("7.00", "n/a", "")
    anchor = {r[0]: r[2] for r in br.summarize(ours)}  # no peer: the anchor's figure
    assert anchor["steady: learners, steps/s each"] == "2.89"


# ── --combine: earlier invocations' JSON outputs as repetitions of one table ───────────────
def _output(path: Path, seed: int, goodput: float, peer: float | None) -> Path:
    import json

    out = {
        "settings": {"h": 20, "layers": 4, "width": 192, "batch": 16, "seed": seed},
        "results": {"chaos-decoupled": [{"goodput": goodput}]},
        "peer": {"results": {"chaos-decoupled": [{"goodput": peer}]} if peer else None},
    }
    path.write_text("a table line\n" + json.dumps(out) + "\nrc=0\n")
    return path


def test_combine_concatenates_runs_of_every_output_in_order(tmp_path: Path) -> None:
    a = _output(tmp_path / "a.out", 0, 0.7, 0.6)
    b = _output(tmp_path / "b.out", 0, 0.8, 0.5)
    results, peer = br.combine_outputs([a, b])
    assert [r["goodput"] for r in results["chaos-decoupled"]] == [0.7, 0.8]
    assert peer is not None and [r["goodput"] for r in peer["chaos-decoupled"]] == [0.6, 0.5]
    _, none = br.combine_outputs([_output(tmp_path / "c.out", 0, 0.7, None)])
    assert none is None


def test_combine_refuses_other_settings_and_files_without_a_summary(tmp_path: Path) -> None:
    a = _output(tmp_path / "a.out", 0, 0.7, 0.6)
    b = _output(tmp_path / "b.out", 1, 0.8, 0.5)
    with pytest.raises(ValueError, match=r"settings differ.*seed"):
        br.combine_outputs([a, b])
    (tmp_path / "log").write_text("no json here\n")
    with pytest.raises(ValueError, match="no JSON summary"):
        br.combine_outputs([tmp_path / "log"])
