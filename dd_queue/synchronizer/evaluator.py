"""The evaluator: a light process that scores the newest global model on the held-out split.

    ddq evaluator --config config/demo.yaml [--once]

Every ``synchronizer.eval_interval_s`` it loads the newest published version of every fragment
(``export.global_model``: checksums verified, bit-exact), copies them into a CPU model built
from the config, and runs ``data.eval_batches`` held-out batches (the same examples every time,
the split every learner leaves out). The result is an ``eval.done`` event on the run's event
stream with the mean loss (nats per token, or per image), the accuracy for image models, and
the fragment versions it used, which is where the control plane's eval history comes from.
It reads only; it holds no lease and never slows the synchronizer.

``ddq evaluator`` first waits for Redis and the run (``dd_queue.startup``). Afterwards an
evaluation that fails (Redis or the run away during a restart, a version that does not
verify) is logged and tried again
every ``RETRY_S`` (at most ``eval_interval_s``) until it succeeds: the process never exits on it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from dd_queue.bus import Bus
from dd_queue.config import DDQConfig
from dd_queue.core.tallies import tokens_merged
from dd_queue.errors import DDQError
from dd_queue.messages import Event
from dd_queue.tracking import NULL_TRACKER, Tracker

__all__ = ["EvalResult", "Evaluator", "HeldOut"]

log = logging.getLogger("dd_queue.evaluator")
RETRY_S = 2.0
"""Seconds between tries while Redis or the run is away."""


@dataclass(frozen=True, slots=True)
class EvalResult:
    """One evaluation: mean held-out loss, accuracy (image models) and the versions used."""

    loss: float
    accuracy: float | None
    versions: dict[int, int]
    n_examples: int


@dataclass(frozen=True, slots=True)
class HeldOut:
    """A CPU model built from the config and the held-out batches it is scored on: the same
    examples every time, the split every learner leaves out (the evaluator's, and the chaos
    bench's for torchft's snapshots)."""

    model: Any
    batches: tuple[Any, ...]

    @classmethod
    def build(cls, cfg: DDQConfig) -> HeldOut:
        from dd_queue.data import ShardLoader, build_dataset
        from dd_queue.models.builder import build

        spec = cfg.model.architecture()
        data = cfg.data.spec(vocab_size=spec.vocab_size)
        loader = ShardLoader(
            build_dataset(data, seq_len=spec.seq_len),
            batch_size=data.batch_size,
            eval_fraction=data.eval_fraction,
        )
        return cls(
            model=build(spec, seed=cfg.run.seed, device="cpu").eval(),
            batches=tuple(loader.eval_batches(max_batches=cfg.data.eval_batches)),
        )

    def score(self) -> tuple[float, float | None, int]:
        """(loss, accuracy or None, training units) of the model's current weights."""
        from dd_queue.models.base import heldout_score

        return heldout_score(self.model, self.batches)


class Evaluator:
    """Scores the global model; build once (model and held-out data), call ``evaluate`` often.

    Args:
        cfg: The run's config (model, data, synchronizer.n_fragments).
        bus: The run's bus.
        tracker: Where each result also goes as ``eval`` (x: the lowest fragment version) and
            ``eval_by_tokens`` (x: tokens merged into fragment 0) curves.
    """

    def __init__(self, cfg: DDQConfig, *, bus: Bus, tracker: Tracker = NULL_TRACKER) -> None:
        import torch

        torch.set_num_threads(1)
        self.cfg, self.bus, self.tracker = cfg, bus, tracker
        self.heldout = HeldOut.build(cfg)

    def evaluate(self) -> EvalResult:
        """Load the newest global model and score it; emit and return the result.

        Raises:
            BusError: Redis failed, or the run has no published model (``NotReady``).
            ProtocolError: A published version does not verify.
        """
        import torch

        from dd_queue.models.builder import synced_parameters
        from dd_queue.synchronizer.export import global_model

        tensors, versions, first = global_model(self.bus, self.cfg)
        with torch.no_grad():
            for name, param in synced_parameters(self.heldout.model).items():
                param.copy_(torch.from_numpy(tensors[name]))
        loss, accuracy, n = self.heldout.score()
        result = EvalResult(loss=loss, accuracy=accuracy, versions=versions, n_examples=n)
        event = Event(
            run_id=self.cfg.run.run_id,
            kind="eval.done",
            message=f"held-out loss {loss:.4f} at versions {versions}",
            fields={
                "loss": loss,
                "accuracy": accuracy,
                "versions": json.dumps({str(p): v for p, v in versions.items()}),
                "min_version": min(versions.values(), default=0),
                "n_examples": n,
            },
            at_s=time.time(),
        )
        self.bus.append(
            self.bus.keys.events(), event.to_fields(), maxlen=self.cfg.redis.stream_maxlen
        )
        log.info("eval.done loss %.4f accuracy %s versions %s", loss, accuracy, versions)
        scores = {"loss": loss, "accuracy": accuracy}
        self.tracker.log("eval", scores, step=min(versions.values(), default=0))
        self.tracker.log("eval_by_tokens", scores, step=tokens_merged(first.counters))
        return result

    def run(self, stop: threading.Event) -> None:
        """Evaluate every ``eval_interval_s`` until ``stop`` is set; ride out Redis restarts."""
        interval_s = self.cfg.synchronizer.eval_interval_s
        failing_since: float | None = None
        while not stop.is_set():
            try:
                self.evaluate()
            except DDQError as exc:  # Redis restarting, the run not (re)created, a bad blob
                if failing_since is None:
                    failing_since = time.monotonic()
                log.warning(
                    "eval.waiting %s (for %.0f s; retrying every %g s)",
                    exc,
                    time.monotonic() - failing_since,
                    min(RETRY_S, interval_s),
                )
                stop.wait(min(RETRY_S, interval_s))
                continue
            if failing_since is not None:
                log.info("eval.resumed after %.0f s", time.monotonic() - failing_since)
                failing_since = None
            stop.wait(interval_s)
