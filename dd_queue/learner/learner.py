"""The learner: inner steps that never wait, plus a steppable pump for everything on the bus.

Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), one learner (../shared/algorithm.md):

    θ ← global parameters (every fragment, with its version); per p: steps, tokens = 0, base = v
    loop:  batch → AdamW step on θ;  per p: steps += 1, tokens += tokens trained
           if p was asked for (round opened / offset due): snapshot θ_p; in the background
               Δ_p = Θ_p(base) − θ_p → codec → publish (p, round, base, steps, tokens)
           per newly arrived global (p, Θ_p, v): θ_p ← Θ_p (or α-mix), counters reset, base = v

One implementation for every deployment: the service (``dd_queue.learner.service``: RedisBus,
SystemClock, pump threads) and the deterministic in-process runner (MemoryBus, FakeClock, one
thread calling ``step`` and ``pump(block_ms=0)``) drive the same class.

Threads: ``step`` belongs to the training thread and is the only code that touches the model;
``pump``/``pump_receive``/``pump_send`` belong to background threads and touch only the bus and
the shared latest-wins slots (``exchange``). The model's base copies Θ_p(base) are replaced,
never mutated, so a snapshot can hold one while the sender computes Δ_p.

Usage: see the package docstring (``dd_queue.learner``).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn

from dd_queue.bus import Bus
from dd_queue.clock import Clock
from dd_queue.config import DDQConfig
from dd_queue.core.fragments import plan_fragments, shapes_from_named
from dd_queue.core.rounds import FragmentCounters
from dd_queue.core.schedule import due_fragments, fragment_offsets
from dd_queue.data import Batch
from dd_queue.errors import ConfigError, CoreError
from dd_queue.faults import FaultInjector
from dd_queue.learner import join as joining
from dd_queue.learner.checkpoint import LocalCheckpoint
from dd_queue.learner.dist import Group, GroupSync, SingleProcess
from dd_queue.learner.exchange import Float32Array, Inbox, Outbox, Received, RoundBook, Snapshot
from dd_queue.learner.inner import (
    InnerLoop,
    autocast_dtype,
    compile_model,
    count_tokens,
    grad_scaler,
)
from dd_queue.learner.params import FragmentParams
from dd_queue.learner.pump import Pump, PumpReport
from dd_queue.learner.tokens import TokenBook
from dd_queue.learner.wiring import build_pump
from dd_queue.messages import Heartbeat
from dd_queue.models.builder import embedding_names, synced_parameters

if TYPE_CHECKING:
    from dd_queue.startup import Stop

log = logging.getLogger("dd_queue.learner")

Action = Literal["trained", "stalled", "killed", "finished"]
_EMA_WEIGHT = 0.1  # weight of a new step time in the step-time EMA (heartbeats; pacing)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepReport:
    """What one ``Learner.step`` call did.

    Attributes:
        action: ``trained``; ``stalled`` (a stall fault: nothing trained, wait ``wait_s``);
            ``killed`` (a kill fault: the learner is dead, exit now); ``finished`` (nothing
            left to do: ``max_steps`` reached or the learner is stopping).
        step: Inner steps completed so far (restored from a checkpoint included).
        n_tokens: Tokens this step trained, summed over the ranks of a torchrun group.
        loss_t: The step's loss (detached tensor; ``loss`` reads it, syncing a GPU).
        lr: Learning rate used.
        snapshots: (fragment, round) of each snapshot taken at this step boundary.
        applied: (fragment, version) of each global fragment applied after the step.
        wait_s: Seconds the caller should wait before the next step (stall, slow faults).
        stop: The caller should stop stepping and ``leave``.
    """

    action: Action
    step: int
    n_tokens: int = 0
    loss_t: torch.Tensor | None = None
    lr: float | None = None
    snapshots: tuple[tuple[int, int], ...] = ()
    applied: tuple[tuple[int, int], ...] = ()
    wait_s: float = 0.0
    stop: bool = False

    @property
    def loss(self) -> float | None:
        """The loss as a float (None when nothing was trained)."""
        return None if self.loss_t is None else float(self.loss_t)


class Learner:
    """One learner of a run (the whole of it, or one rank of a torchrun group).

    Args:
        cfg: The run's configuration (``learner``, ``synchronizer``, ``wire``, ``redis``,
            ``membership``, ``model``, ``faults`` sections are read).
        learner_id: This learner's id, e.g. ``"L0"``.
        model: The plain model (already on its device); its parameters are overwritten by the
            global model at ``join``.
        loader: Batches of this learner's shard (``state_dict``/``load_state_dict`` optional,
            used by the local checkpoint).
        bus: The run's bus; only rank 0 uses it (None on other ranks).
        clock: Time of schedules, heartbeats and waits.
        injector: Faults armed against this learner (default: an empty one).
        group: The torchrun group (default: a single process).
        checkpoint: Local checkpoint file (None: none).
        identity: Host and pid written in heartbeats (default: this process's).
        config_digest: Stamped on contributions and heartbeats (default: ``cfg.run_digest``,
            what every process of the run must agree on).
    """

    def __init__(
        self,
        cfg: DDQConfig,
        *,
        learner_id: str,
        model: nn.Module,
        loader: Iterator[Batch],
        bus: Bus | None,
        clock: Clock,
        injector: FaultInjector | None = None,
        group: Group | None = None,
        checkpoint: LocalCheckpoint | None = None,
        identity: joining.Identity | None = None,
        config_digest: str | None = None,
    ) -> None:
        self.cfg, self.learner_id, self.loader, self.clock = cfg, learner_id, loader, clock
        self.group = group or SingleProcess()
        self.is_rank0 = self.group.rank == 0
        if self.is_rank0 and bus is None:
            raise ConfigError("rank 0 of a learner needs a bus")
        self.bus = bus if self.is_rank0 else None
        self.injector = injector or FaultInjector(learner_id, clock=clock)
        self.identity = identity or joining.Identity(learner_id, socket.gethostname(), os.getpid())
        self.config_digest = config_digest or cfg.run_digest
        self.checkpoint = checkpoint
        sync = cfg.synchronizer
        synced = synced_parameters(model).items()
        shapes = shapes_from_named((n, p.shape) for n, p in synced)
        try:  # the same call as the synchronizer's, so both derive the same plan
            self.plan = plan_fragments(
                shapes,
                sync.n_fragments,
                embedding_patterns=sync.embedding_patterns,
                embedding_names=embedding_names(model),
            )
        except CoreError as exc:
            raise ConfigError(f"synchronizer.n_fragments={sync.n_fragments}: {exc}") from exc
        self.params = FragmentParams(self.plan, model)
        compute = autocast_dtype(self.params.device, cfg.model.autocast)
        self.inner = InnerLoop(
            model,
            forward=self._forward_of(model),
            cfg=cfg.learner,
            device=self.params.device,
            autocast=compute,
            scaler=grad_scaler(self.params.device, compute),
        )
        self.outbox, self.inbox, self.rounds = Outbox(self.params.new_buffer), Inbox(), RoundBook()
        n = self.plan.n_fragments
        self.counters = [FragmentCounters() for _ in range(n)]
        self.tokens = TokenBook(n)  # computed, published, dropped: the token fate's learner side
        self.bases: list[Float32Array | None] = [None] * n
        self.offsets = fragment_offsets(n, sync.sync_every_steps)
        self.sync = GroupSync(self.group, n)
        self.bus_pump: Pump | None = None
        self.n_tokens = 0
        self.step_time_ema_s: float | None = None
        self.state = "created"
        self._last_end_s: float | None = None
        self._stop_requested = False
        self._dead = False
        self._last_loss_t: torch.Tensor | None = None  # the heartbeat's train_loss

    def _forward_of(self, model: nn.Module) -> Any:
        forward: Any = model
        if self.group.world_size > 1:
            forward = nn.parallel.DistributedDataParallel(model)
        if self.cfg.model.compile:
            forward = compile_model(forward)
        return forward

    # ── joining and leaving ──────────────────────────────────────────────────────────────
    def join(
        self, *, timeout_s: float | None = None, stop: Stop | None = None
    ) -> dict[int, int] | None:
        """Register, wait for the global model, load every fragment; returns fragment → version,
        or ``None`` when ``stop`` came while waiting (every rank then stops; nothing loaded).

        Rank 0 does the talking and broadcasts each fragment to the other ranks. A local
        checkpoint (optimizer state, data position, step count) is restored when there is one.

        Raises:
            ConfigError: The learner id is live in another process, or the global model does
                not fit this learner's model.
            BusError: No complete global model within ``timeout_s``
                (default ``learner.join_timeout_s``).
        """
        self.state = "joining"
        initial: list[Received] | None = []
        if self.is_rank0:
            assert self.bus is not None  # checked in __init__
            self.bus_pump = build_pump(
                self.cfg,
                self.bus,
                plan=self.plan,
                learner_id=self.learner_id,
                config_digest=self.config_digest,
                queues=(self.outbox, self.inbox, self.rounds),
                injector=self.injector,
                clock=self.clock,
                status=self.heartbeat,
                tokens=self.tokens,
            )
            initial = joining.register_and_wait(
                self.bus_pump,
                identity=self.identity,
                plan=self.plan,
                config_digest=self.config_digest,
                clock=self.clock,
                timeout_s=self.cfg.learner.join_timeout_s if timeout_s is None else timeout_s,
                rounds=self.rounds,
                stop=stop,
            )
        agreed = self.sync.agree(0, stop=initial is None, queued=initial or [])
        if agreed.stop:  # told to stop while waiting: every rank leaves before loading
            self.state = "left"
            return None
        for p, version, values in agreed.applied:
            full = self.sync.broadcast_fragment(values, self.params.size(p))
            self._load(p, full, version, alpha=0.0)  # never mixed with the random init
        if self.checkpoint is not None:
            restored = self.checkpoint.restore_learner(self.inner, self.loader)
            self.n_tokens = self.n_tokens if restored is None else restored
        self.state = "training"
        versions = self.inbox.held()
        log.info(
            "learner.joined %d fragments, versions %s, step %d",
            self.plan.n_fragments,
            versions,
            self.inner.step_count,
        )
        return versions

    def leave(self, *, timeout_s: float | None = None) -> None:
        """Flush waiting contributions (≤ ``timeout_s``, default ``learner.leave_timeout_s``),
        save the local checkpoint and deregister. Safe to call more than once."""
        if self.state == "left":
            return
        self.state = "leaving"
        if self.checkpoint is not None:
            self.checkpoint.save_learner(self.inner, self.loader, self.n_tokens)
        if self.bus_pump is not None:
            limit = self.cfg.learner.leave_timeout_s if timeout_s is None else timeout_s
            if unsent := self.bus_pump.flush(limit):
                log.warning("learner.leave %d contributions not sent", unsent)
            self.bus_pump.deregister()
        self.state = "left"
        log.info("learner.left at step %d, %d tokens", self.inner.step_count, self.n_tokens)

    def request_stop(self) -> None:
        """Finish the current step, then report ``stop`` (all ranks stop at the same step)."""
        self._stop_requested = True

    # ── the training thread ──────────────────────────────────────────────────────────────
    def step(self) -> StepReport:
        """One inner step: fault check, batch, AdamW step, counters, snapshots, new globals.

        Never waits on the network: snapshots are queued for the pump, and only globals the
        pump already verified are applied.
        """
        step = self.inner.step_count
        max_steps = self.cfg.learner.max_steps
        if self._dead or (self.bus_pump is not None and self.bus_pump.killed):
            self._dead, self.state = True, "killed"
            return StepReport(action="killed", step=step, stop=True)
        if max_steps and step >= max_steps:
            return StepReport(action="finished", step=step, stop=True)
        effect = self.injector.effect("before_step")
        if effect.kill:
            self._dead, self.state = True, "killed"
            log.warning("fault.injected %s: kill at step %d", effect.fault_id, step)
            return StepReport(action="killed", step=step, stop=True)
        if effect.stall_s is not None:
            self._last_end_s, self.state = None, "stalled"
            return StepReport(action="stalled", step=step, wait_s=effect.stall_s)
        started_s = self.clock.now()
        batches = [next(self.loader) for _ in range(self.cfg.learner.grad_accum_steps)]
        loss, lr = self.inner.train_step(batches)
        self._last_loss_t = loss
        agreed = self.sync.agree(
            sum(count_tokens(b) for b in batches),
            stop=self._stop_requested,
            queued=self.inbox.take_all() if self.is_rank0 else [],
        )
        self.n_tokens += agreed.n_tokens
        self.tokens.trained(agreed.n_tokens)
        self.counters = [c.after_step(agreed.n_tokens) for c in self.counters]
        snapshots = self._snapshot() if self.is_rank0 else ()
        applied = tuple(self._apply(agreed.applied))
        self.state = "training"
        wait_s = self._timing(started_s, effect.slow_factor)
        step = self.inner.step_count
        if self.checkpoint is not None and step % self.cfg.learner.checkpoint_every_steps == 0:
            self.checkpoint.save_learner(self.inner, self.loader, self.n_tokens)
        done = agreed.stop or bool(max_steps and step >= max_steps)
        return StepReport(
            action="trained",
            step=step,
            n_tokens=agreed.n_tokens,
            loss_t=loss,
            lr=lr,
            snapshots=snapshots,
            applied=applied,
            wait_s=wait_s,
            stop=done,
        )

    def _timing(self, started_s: float, slow_factor: float) -> float:
        """Update the step-time EMA (time between step ends); a slow fault's extra wait."""
        now = self.clock.now()
        if self._last_end_s is not None:
            dt = now - self._last_end_s
            ema = self.step_time_ema_s
            self.step_time_ema_s = dt if ema is None else ema + _EMA_WEIGHT * (dt - ema)
        self._last_end_s = now
        return max(0.0, slow_factor - 1.0) * (now - started_s)

    def _snapshot(self) -> tuple[tuple[int, int], ...]:
        """Queue θ_p of every fragment asked for at this step boundary (latest wins)."""
        step = self.inner.step_count
        sync = self.cfg.synchronizer
        if sync.schedule == "synchronizer":
            due = self.rounds.take_requested()
        else:  # offsets (Streaming DiLoCo), tagged with each fragment's latest announced round
            due = self.rounds.due(due_fragments(step, self.offsets, sync.sync_every_steps))
        taken = []
        for p, round_id in sorted(due.items()):
            counters, base = self.counters[p], self.bases[p]
            if counters.steps == 0 or base is None:
                continue  # nothing trained since p was received: the contribution weighs 0
            buffer = self.outbox.buffer(p)
            ready = self.params.copy_out(p, buffer)
            snapshot = Snapshot(
                fragment_id=p,
                round_id=round_id,
                base_version=counters.base_version,
                base=base,
                values=buffer,
                ready=ready,
                n_steps=counters.steps,
                n_tokens=counters.tokens,
                step=step,
                taken_at_s=self.clock.now(),
            )
            if self.outbox.put(snapshot):
                log.debug(
                    "contribution.replaced fragment %d: newer snapshot at round %d", p, round_id
                )
            taken.append((p, round_id))
        return tuple(taken)

    def _apply(
        self, applied: Sequence[tuple[int, int, Float32Array | None]]
    ) -> list[tuple[int, int]]:
        """Write the agreed global fragments into the model (overwrite or α-mix)."""
        done = []
        alpha = self.cfg.learner.mix_alpha
        for p, version, values in applied:
            if version <= self.counters[p].base_version:
                continue  # versions only move forward
            full = self.sync.broadcast_fragment(values, self.params.size(p))
            self._load(p, full, version, alpha=alpha)
            done.append((p, version))
            log.debug("global.applied fragment %d version %d", p, version)
        return done

    def _load(
        self, p: int, values: Float32Array | torch.Tensor, version: int, *, alpha: float
    ) -> None:
        """θ_p ← Θ_p(version); the base of Δ_p becomes that exact array (rank 0 only)."""
        self.params.write(p, values, alpha=alpha)
        self.bases[p] = values if isinstance(values, np.ndarray) else None
        self.counters[p] = FragmentCounters(base_version=version)
        self.inbox.hold(p, version)

    # ── the pump (background) ─────────────────────────────────────────────────────────────
    def pump(self, *, block_ms: int = 0) -> PumpReport:
        """Both halves of the background work once (receive may wait ≤ ``block_ms``)."""
        return self.pump_receive(block_ms=block_ms) + self.pump_send(block_ms=0)

    def pump_receive(self, *, block_ms: int = 0) -> PumpReport:
        """Commands, round openings, new globals, heartbeat (see ``Pump.receive``)."""
        if self.bus_pump is None or self._dead:  # a killed learner is silent
            return PumpReport()
        return self.bus_pump.receive(block_ms=block_ms)

    def pump_send(self, *, block_ms: int = 0) -> PumpReport:
        """Publish waiting snapshots (see ``Pump.send``)."""
        if self.bus_pump is None or self._dead:
            return PumpReport()
        return self.bus_pump.send(block_ms=block_ms)

    # ── state ────────────────────────────────────────────────────────────────────────────
    @property
    def step_count(self) -> int:
        """Inner steps completed (including those restored from a checkpoint)."""
        return self.inner.step_count

    @property
    def versions(self) -> dict[int, int]:
        """Fragment → global version applied to the model."""
        return self.inbox.held()

    def heartbeat(self) -> Heartbeat:
        """This learner's heartbeat now (rank 0): progress, versions held, queue depths, where
        it runs."""
        assert self.bus is not None  # heartbeats are rank 0's, which has the bus
        return Heartbeat(
            run_id=self.bus.keys.run_id,
            config_digest=self.config_digest,
            role="learner",
            member_id=self.learner_id,
            state=self.state,
            step=self.step_count,
            n_tokens=self.n_tokens,
            step_time_ema_s=self.step_time_ema_s,
            versions=self.versions,
            queue_depths={"publish": self.outbox.depth(), "receive": self.inbox.depth()},
            device=str(self.params.device),
            host=self.identity.host,
            pid=self.identity.pid,
            sent_at_s=time.time(),
            train_loss=self.train_loss,
        )

    @property
    def train_loss(self) -> float | None:
        """The loss of the latest inner step (reads the tensor: a GPU sync, once a heartbeat);
        None before the first step or when it is not finite."""
        loss_t = self._last_loss_t
        if loss_t is None:
            return None
        loss = float(loss_t)
        return loss if math.isfinite(loss) and loss >= 0 else None


__all__ = ["Learner", "StepReport"]
