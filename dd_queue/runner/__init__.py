"""The deterministic in-process runner: M learners and one synchronizer on a virtual clock.

    from dd_queue.runner import load_experiment, run_experiment
    result = run_experiment(load_experiment("config/experiments/fault_free.yaml"))

Modules: ``spec`` (experiment files, runner settings, what each mode implies), ``timing``
(seeded step times, failures, the event queue), ``slot`` (one learner position: its
``Learner``, state and time ledger), ``runner`` (the discrete-event loop), ``evaluate`` (the
global model on the held-out split), ``ledger`` (goodput), ``result`` (what a run reports),
``experiment`` (variants on one seed), ``plots`` and ``cli`` (``ddq experiment``).
"""

from typing import TYPE_CHECKING

from dd_queue._lazy import lazy_exports

if TYPE_CHECKING:
    from dd_queue.runner.evaluate import EvalPoint, GlobalEvaluator
    from dd_queue.runner.runner import Runner
    from dd_queue.runner.spec import (
        ExperimentSpec,
        FailureSpec,
        RunnerSpec,
        VariantSpec,
        load_experiment,
    )

# Lazy: ``ddq``'s parser registers ``dd_queue.runner.cli`` for every command.
__getattr__ = lazy_exports(
    __name__,
    {
        "EvalPoint": "evaluate",
        "GlobalEvaluator": "evaluate",
        "Runner": "runner",
        "ExperimentSpec": "spec",
        "FailureSpec": "spec",
        "RunnerSpec": "spec",
        "VariantSpec": "spec",
        "load_experiment": "spec",
    },
)

__all__ = [
    "EvalPoint",
    "ExperimentSpec",
    "FailureSpec",
    "GlobalEvaluator",
    "Runner",
    "RunnerSpec",
    "VariantSpec",
    "load_experiment",
]
