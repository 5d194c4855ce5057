"""Run every variant of an experiment on the same seed, and tabulate the results.

    spec = load_experiment("config/experiments/fault_free.yaml")
    result = run_experiment(spec)            # ExperimentResult
    sys.stdout.write(markdown_table(result.runs))

The dataset is loaded once per distinct data source and window length and shared by every
variant (and every learner's shard loader). Held-out batches are ``runner.eval_batch_size``
examples (default: one learner's batch; a data-parallel variant's M× batch does not change
them): set it in the shared ``runner`` section when variants change the batch size, so that
every variant is scored on the same examples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dd_queue.config import DDQConfig
from dd_queue.data import Dataset, build_dataset
from dd_queue.runner.result import RunResult
from dd_queue.runner.runner import Runner
from dd_queue.runner.spec import ExperimentSpec, RunnerSpec

__all__ = ["ExperimentResult", "markdown_table", "run_experiment"]

log = logging.getLogger("dd_queue.runner")


@dataclass(frozen=True, slots=True)
class ExperimentResult:
    """All variants of one experiment.

    Attributes:
        spec: The experiment as loaded.
        runs: One result per variant, in file order.
    """

    spec: ExperimentSpec
    runs: tuple[RunResult, ...]

    def to_dict(self, *, with_rounds: bool = True) -> dict[str, Any]:
        """Plain JSON-able data: the experiment's name, seed, description and every run."""
        return {
            "experiment": self.spec.name,
            "description": self.spec.description,
            "seed": self.spec.seed,
            "runs": [r.to_dict(with_rounds=with_rounds) for r in self.runs],
        }


def run_experiment(
    spec: ExperimentSpec,
    *,
    only: Sequence[str] | None = None,
    progress: Callable[[RunResult], None] | None = None,
) -> ExperimentResult:
    """Run the variants of ``spec`` (all, or those named in ``only``) one after the other.

    Args:
        spec: The experiment.
        only: Variant names to run (default: every variant).
        progress: Called with each run's result as soon as it is done.

    Returns:
        The results, in the file's order.
    """
    datasets: dict[tuple[str, int], Dataset] = {}
    runs = []
    for variant in spec.variants:
        if only is not None and variant.name not in only:
            continue
        cfg, runner_spec = spec.resolve(variant)
        dataset = _dataset(cfg, datasets)
        log.info("experiment %s: running %s (%s)", spec.name, variant.name, runner_spec.mode)
        result = Runner(
            cfg,
            runner_spec,
            dataset,
            name=variant.name,
            eval_batch_size=runner_spec.eval_batch_size or _learner_batch(cfg, runner_spec),
        ).run()
        runs.append(result)
        if progress is not None:
            progress(result)
    return ExperimentResult(spec=spec, runs=tuple(runs))


def _learner_batch(cfg: DDQConfig, spec: RunnerSpec) -> int:
    """One learner's batch size (the data-parallel config holds M× that)."""
    if spec.mode == "data-parallel":
        return cfg.data.batch_size // spec.n_learners
    return cfg.data.batch_size


def _dataset(cfg: DDQConfig, cache: dict[tuple[str, int], Dataset]) -> Dataset:
    model = cfg.model.architecture()
    data = cfg.data.spec(vocab_size=model.vocab_size)
    key = (repr((data.source, data.path, data.max_bytes, data.suffixes)), model.seq_len)
    if key not in cache:
        cache[key] = build_dataset(data, seq_len=model.seq_len)
    return cache[key]


def markdown_table(runs: Sequence[RunResult]) -> str:
    """One row per run: final eval loss, tokens, virtual time, goodput, rounds, waiting."""
    lines = [
        "| variant | mode | M | tokens | virtual s | eval loss | accuracy | goodput | uptime "
        "| merged rounds | contributors/round | waiting s | failures |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        waiting = sum(row["waiting_s"] for row in r.learners)
        failures = sum(row["failures"] for row in r.learners)
        acc = "-" if r.final.accuracy is None else f"{r.final.accuracy:.3f}"
        lines.append(
            f"| {r.name} | {r.mode} | {r.n_learners} | {r.tokens:,} | {r.stop_s:.0f} "
            f"| {r.final.loss:.4f} | {acc} | {r.goodput.goodput:.1%} | {r.goodput.uptime:.1%} "
            f"| {r.rounds.merged} | {r.rounds.mean_contributors:.2f} | {waiting:.0f} "
            f"| {failures} |"
        )
    return "\n".join(lines) + "\n"
