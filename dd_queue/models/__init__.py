"""Models every learner can train: dense LM, MoE LM and ViT, selected by preset name.

    from dd_queue.models import build_model
    model = build_model("gpt-tiny", seed=0)
    out = model(batch)          # batch: TrainBatch (inputs, targets, n_tokens)
    out.loss.backward()

See ``spec.py`` for the presets and their sizes, ``base.py`` for the batch/output contract.
The presets (``spec.py``) import at once; the torch modules on first use (``dd_queue._lazy``).
"""

from typing import TYPE_CHECKING

from dd_queue._lazy import lazy_exports
from dd_queue.models.spec import FAMILIES, PRESETS, Family, ModelSpec, param_count, resolve_spec

if TYPE_CHECKING:
    from dd_queue.models.base import IGNORE_INDEX, ModelOutput, TrainBatch
    from dd_queue.models.gpt import GPT
    from dd_queue.models.moe import MoE, expert_load
    from dd_queue.models.registry import Model, build_model, init_parameters, param_groups
    from dd_queue.models.vit import ViT

__getattr__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(("IGNORE_INDEX", "ModelOutput", "TrainBatch"), "base"),
        "GPT": "gpt",
        "MoE": "moe",
        "expert_load": "moe",
        **dict.fromkeys(("Model", "build_model", "init_parameters", "param_groups"), "registry"),
        "ViT": "vit",
    },
)

__all__ = [
    "FAMILIES",
    "GPT",
    "IGNORE_INDEX",
    "PRESETS",
    "Family",
    "MoE",
    "Model",
    "ModelOutput",
    "ModelSpec",
    "TrainBatch",
    "ViT",
    "build_model",
    "expert_load",
    "init_parameters",
    "param_count",
    "param_groups",
    "resolve_spec",
]
