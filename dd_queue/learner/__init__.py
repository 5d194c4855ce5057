"""The learner: trains without ever waiting, publishes fragment contributions, applies globals.

    from dd_queue.learner import Learner
    learner = Learner(cfg, learner_id="L0", model=model, loader=loader, bus=bus, clock=clock)
    learner.join()
    while not (report := learner.step()).stop:
        learner.pump(block_ms=0)
    learner.leave()

Modules: ``learner`` (the ``Learner``: join / step / pump / leave), ``pump`` (the bus side),
``receiver`` (stream positions, verified globals), ``publisher`` (Δ_p, error feedback, send),
``exchange`` (latest-wins slots between the threads), ``params`` (fragments ↔ parameters),
``inner`` (AdamW, schedule, autocast), ``dist`` (torchrun groups), ``join``, ``checkpoint``,
``wiring``, ``build`` and ``service`` (the process), ``cli`` (``ddq learner``).
"""

from typing import TYPE_CHECKING

from dd_queue._lazy import lazy_exports

if TYPE_CHECKING:
    from dd_queue.learner.checkpoint import LocalCheckpoint
    from dd_queue.learner.dist import Group, GroupSync, SingleProcess, TorchGroup, group_from_env
    from dd_queue.learner.exchange import Inbox, Outbox, Received, RoundBook, Snapshot
    from dd_queue.learner.inner import InnerLoop, count_tokens, lr_factor
    from dd_queue.learner.join import Identity
    from dd_queue.learner.learner import Learner, StepReport
    from dd_queue.learner.params import FragmentParams
    from dd_queue.learner.pump import Pump, PumpReport, PumpSettings

# Lazy: every ``ddq`` command registers ``dd_queue.learner.cli``, and most of them (a
# synchronizer's start-up among them) must not pay for torch.
__getattr__ = lazy_exports(
    __name__,
    {
        "LocalCheckpoint": "checkpoint",
        "Group": "dist",
        "GroupSync": "dist",
        "SingleProcess": "dist",
        "TorchGroup": "dist",
        "group_from_env": "dist",
        "Inbox": "exchange",
        "Outbox": "exchange",
        "Received": "exchange",
        "RoundBook": "exchange",
        "Snapshot": "exchange",
        "InnerLoop": "inner",
        "count_tokens": "inner",
        "lr_factor": "inner",
        "Identity": "join",
        "Learner": "learner",
        "StepReport": "learner",
        "FragmentParams": "params",
        "Pump": "pump",
        "PumpReport": "pump",
        "PumpSettings": "pump",
    },
)

__all__ = [
    "FragmentParams",
    "Group",
    "GroupSync",
    "Identity",
    "Inbox",
    "InnerLoop",
    "Learner",
    "LocalCheckpoint",
    "Outbox",
    "Pump",
    "PumpReport",
    "PumpSettings",
    "Received",
    "RoundBook",
    "SingleProcess",
    "Snapshot",
    "StepReport",
    "TorchGroup",
    "count_tokens",
    "group_from_env",
    "lr_factor",
]
