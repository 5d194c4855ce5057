"""Experiment tracking: every process writes its curves to TensorBoard and/or Weights & Biases.

Turned on by the ``tracking`` section (``ddq up --track tensorboard,wandb`` sets it for a local
run)::

    tracking:
      backends: [tensorboard, wandb]   # either, both, or none (the default: off)
      dir: runs/tracking               # <dir>/<run_id>/<process>/ holds each process's files

Each process logs what only it knows, into a directory (and a W&B run) of its own, so a
multi-host run needs no shared writer: point ``tensorboard --logdir`` at the union of the hosts'
``<dir>/<run_id>`` folders, or ``wandb sync`` each host's offline runs (they share the group
``run_id``).

=================  ==========================  ===============================================
process            section (W&B step metric)   scalars
=================  ==========================  ===============================================
``learner-<id>``   ``train`` (inner step)      ``loss``, ``lr``, ``tokens_per_s``,
                                               ``step_time_s``, ``tokens``
``synchronizer-``  ``fragment<p>`` (version)   ``contributors``, ``tokens``, ``weight_max``,
``<id>``                                       ``staleness_mean``, ``staleness_max``,
                                               ``grace_window_s``, ``late``, ``unmerged``,
                                               ``open_to_quorum_s``, ``quorum_to_merge_s``,
                                               ``merge_to_commit_s``
``evaluator``      ``eval`` (lowest version),  ``loss`` (and ``accuracy`` for image models)
                   ``eval_by_tokens`` (tokens
                   merged into fragment 0)
=================  ==========================  ===============================================

Every run also records its resolved config (secrets as ``***``) flattened to dotted keys, its
config digest and run digest, as TensorBoard hyperparameters and W&B config. W&B runs offline
unless ``tracking.wandb_mode`` is ``online``. The backends are optional extras
(``pip install 'dd_queue[tensorboard]'`` / ``'dd_queue[wandb]'``); asking for one that is not
installed is a ``ConfigError`` at start, before anything trains. A tracking backend that fails
while writing is logged once and switched off: curves never stop training.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dd_queue.errors import ConfigError

if TYPE_CHECKING:
    from dd_queue.config import DDQConfig
    from dd_queue.messages import RoundRecord

__all__ = [
    "NULL_TRACKER",
    "TRACKING_BACKENDS",
    "Tracker",
    "check_backends",
    "flat_hparams",
    "open_tracker",
    "round_scalars",
    "tracking_dir",
]

log = logging.getLogger("dd_queue.tracking")

_EXTRA = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""Backend → the module it needs (the pip extra has the same name)."""
TRACKING_BACKENDS: tuple[str, ...] = tuple(_EXTRA)
"""The values ``tracking.backends`` takes."""
_NAME = re.compile(r"[^A-Za-z0-9_.-]+")


class _Sink(Protocol):
    def log(self, section: str, values: Mapping[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class Tracker:
    """The process's tracking backends behind one call; an empty tracker does nothing.

    Args:
        sinks: Open backends (``open_tracker`` makes them).
    """

    def __init__(self, sinks: list[_Sink] | None = None) -> None:
        self._sinks = list(sinks or [])

    @property
    def enabled(self) -> bool:
        """Whether any backend is open (callers skip computing scalars otherwise)."""
        return bool(self._sinks)

    def log(self, section: str, values: Mapping[str, float | None], *, step: int) -> None:
        """Log ``values`` as ``<section>/<name>`` at ``step`` (None and non-numbers skipped).

        A backend that raises is logged and dropped: a broken disk or a W&B error must not stop
        a learner.
        """
        if not self._sinks:
            return
        clean = {k: float(v) for k, v in values.items() if isinstance(v, int | float)}
        for sink in list(self._sinks):
            try:
                sink.log(section, clean, step)
            except Exception:  # any backend error: logged once, that backend switched off
                log.exception("tracking.failed %s: switched off", type(sink).__name__)
                self._sinks.remove(sink)

    def close(self) -> None:
        """Flush and close every backend."""
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception:
                log.exception("tracking.close_failed %s", type(sink).__name__)


NULL_TRACKER = Tracker()
"""The tracker of a process with tracking off (shared: it holds nothing)."""


def tracking_dir(cfg: DDQConfig) -> Path:
    """Where this run's tracking files go: ``<tracking.dir>/<run_id>`` (``tracking`` in the
    working directory when ``dir`` is unset)."""
    return Path(cfg.tracking.dir or "tracking") / cfg.run.run_id


def check_backends(backends: tuple[str, ...]) -> None:
    """Raise ``ConfigError`` naming the extra to install for a backend that is missing."""
    for backend in backends:
        if importlib.util.find_spec(_EXTRA[backend]) is None:
            raise ConfigError(
                f"tracking.backends has {backend!r} but the {_EXTRA[backend]} package is not "
                f"installed: pip install 'dd_queue[{backend}]' (or drop it from tracking.backends)"
            )


def open_tracker(cfg: DDQConfig, process: str) -> Tracker:
    """Open this process's tracking backends, with the run's config recorded once.

    Args:
        cfg: The resolved config (``tracking`` says which backends; the rest is recorded).
        process: This process's name, e.g. ``learner-L0``, ``synchronizer-sync-0``: its
            directory under ``tracking_dir`` and its W&B run name.

    Raises:
        ConfigError: A backend's package is not installed.
    """
    backends = cfg.tracking.backends
    if not backends:
        return NULL_TRACKER
    check_backends(backends)
    where = tracking_dir(cfg) / _NAME.sub("_", process)
    where.mkdir(parents=True, exist_ok=True)
    hparams = flat_hparams(cfg.public_dict())
    hparams.update(config_digest=cfg.digest, run_digest=cfg.run_digest, process=process)
    sinks: list[_Sink] = []
    if "tensorboard" in backends:
        sinks.append(_TensorBoard(where, hparams))
    if "wandb" in backends:
        sinks.append(_Wandb(cfg, process, where, hparams))
    log.info("tracking.open %s: %s in %s", process, ", ".join(backends), where)
    return Tracker(sinks)


def flat_hparams(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"section.field": value}`` with scalar values only (lists and other
    values as JSON text, None as ``"none"``): what TensorBoard's hparams accept."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flat_hparams(value, f"{name}."))
        elif value is None:
            flat[name] = "none"
        elif isinstance(value, bool | int | float | str):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, sort_keys=True, default=str)
    return flat


def round_scalars(record: RoundRecord) -> dict[str, float | None]:
    """A merged round's stats for the tracker: who merged, how much, how stale, how long."""
    contributors = record.contributors
    staleness = [c.staleness for c in contributors]
    unmerged = [e for e in record.entries if e.outcome not in ("merged", "carried")]
    timings = record.timings_s
    opened, quorum, closed = record.opened_at_s, record.quorum_at_s, record.closed_at_s
    return {
        "contributors": len(contributors),
        "tokens": sum(c.n_tokens for c in contributors),
        "weight_max": max((c.weight for c in contributors), default=None),
        "staleness_mean": statistics.fmean(staleness) if staleness else None,
        "staleness_max": max(staleness, default=None),
        "grace_window_s": timings.get("grace_window"),
        "late": sum(e.outcome == "late" for e in record.entries),
        "unmerged": len(unmerged),
        "open_to_quorum_s": None if quorum is None else max(0.0, quorum - opened),
        "quorum_to_merge_s": None if quorum is None else max(0.0, closed - quorum),
        "merge_to_commit_s": sum(timings.get(k, 0.0) for k in ("merge", "stage")),
    }


# ── the backends ─────────────────────────────────────────────────────────────────────────────
class _TensorBoard:
    """Event files through torch's ``SummaryWriter``; the config as hparams and as text."""

    def __init__(self, where: Path, hparams: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        self.writer = SummaryWriter(log_dir=str(where), flush_secs=10)
        # add_hparams would open a second run in a subfolder; these three summaries put the
        # hyperparameters on this process's own run instead.
        file_writer = self.writer.file_writer
        assert file_writer is not None  # SummaryWriter opens it in __init__
        for summary in hparams_summary(dict(hparams), {}):
            file_writer.add_summary(summary)
        text = json.dumps(dict(hparams), indent=1, sort_keys=True)
        self.writer.add_text("config", f"```\n{text}\n```", global_step=0)

    def log(self, section: str, values: Mapping[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(f"{section}/{name}", value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    """One W&B run per process (offline by default), grouped by the run id."""

    def __init__(
        self, cfg: DDQConfig, process: str, where: Path, hparams: Mapping[str, Any]
    ) -> None:
        import wandb

        self.run = wandb.init(
            project=cfg.tracking.wandb_project,
            group=cfg.run.run_id,
            name=f"{cfg.run.run_id}/{process}",
            job_type=process.split("-")[0],
            dir=str(where),
            mode=cfg.tracking.wandb_mode,
            config=dict(hparams),
            reinit="create_new",  # the in-process runs hold several learners in one process
            # silent: the process's log carries what matters (the run's folder, below)
            settings=wandb.Settings(console="off", save_code=False, disable_git=True, silent=True),
        )
        self.sync_dir = self.run.settings.sync_dir
        self._sections: set[str] = set()

    def log(self, section: str, values: Mapping[str, float], step: int) -> None:
        if section not in self._sections:  # each section on its own x axis
            self.run.define_metric(f"{section}/step", hidden=True)
            self.run.define_metric(f"{section}/*", step_metric=f"{section}/step")
            self._sections.add(section)
        self.run.log({f"{section}/step": step, **{f"{section}/{k}": v for k, v in values.items()}})

    def close(self) -> None:
        self.run.finish()
        log.info("tracking.wandb_closed run in %s (wandb sync it to upload)", self.sync_dir)
