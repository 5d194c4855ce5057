"""Model shapes: the ``ModelSpec`` value, the named presets and an exact parameter-count formula.

A spec is plain data (no torch), so the learner, the synchronizer and the config can agree on a
model's shape, and on its size, without building it. ``param_count`` is exact: a test checks it
against ``sum(p.numel() for p in model.parameters())`` for every preset (big ones on the ``meta``
device, which allocates nothing).

Families:
- ``gpt``: decoder-only transformer LM (pre-norm RMSNorm, RoPE, GELU MLP, no biases, tied
  embeddings by default), GPT-2 shaped apart from RoPE and RMSNorm.
- ``moe``: the same LM with every MLP replaced by ``n_experts`` routed experts (top-``top_k``)
  and a Switch-style load-balancing auxiliary loss (Fedus et al., arXiv 2101.03961).
- ``vit``: a Vision Transformer classifier (Dosovitskiy et al., arXiv 2010.11929) on the same
  blocks, without RoPE or causal masking, with a learned position embedding and mean pooling.

Sizes (parameters, exact counts from ``param_count``):

| preset      | shape                                   | parameters            |
|-------------|-----------------------------------------|-----------------------|
| gpt-tiny    | 2 × 128, 4 heads, vocab 256             | 0.43 M                |
| gpt-small   | 8 × 384, 6 heads, vocab 256             | 14.3 M                |
| gpt-124m    | 12 × 768, 12 heads, vocab 50304         | 123.6 M (GPT-2 small) |
| gpt-1b      | 18 × 2048, 16 heads, vocab 50304        | 1.009 B               |
| moe-tiny    | 2 × 128, 4 experts (×2 MLP) top-2       | 0.69 M (0.43 M active)|
| moe-small   | 8 × 384, 8 experts (×2 MLP) top-2       | 42.6 M (14.3 M active)|
| vit-tiny    | 2 × 64, 8×8×1 images, 2×2 patches       | 0.10 M                |
| vit-small   | 12 × 384, 32×32×3 images, 4×4 patches   | 21.3 M (ViT-S shape)  |

MoE experts are half as wide as the dense MLP (``mlp_ratio`` 2) so that top-2 routing costs the
same FLOPs per token as the dense model of the same width: moe-tiny's active parameters match
gpt-tiny's (plus the router). The load-balancing weight is Switch's 0.01 by default, but 0.05 for
moe-tiny: on byte-level text (where a few bytes, such as the space, are most tokens) routing
starts skewed, and in a few hundred CPU steps 0.01 left two of four experts under 5% of the load
while 0.05 balanced them within ~100 steps and reached a slightly lower LM loss (2.32 vs 2.45).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from dd_queue.errors import ConfigError

Family = Literal["gpt", "moe", "vit"]
FAMILIES: tuple[Family, ...] = ("gpt", "moe", "vit")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of one model; every learner of a run must build the same spec.

    Attributes:
        family: ``gpt`` (dense LM), ``moe`` (routed-expert LM) or ``vit`` (image classifier).
        n_layers: Transformer blocks.
        d_model: Hidden width (channels).
        n_heads: Attention heads; must divide ``d_model`` (head width must be even for RoPE).
        mlp_ratio: MLP hidden width ÷ ``d_model`` (per expert for ``moe``).
        vocab_size: Token vocabulary (LMs; 256 = byte-level).
        seq_len: Training sequence length, in tokens (LMs). RoPE has no position table, so
            this sets no parameter shape; longer inputs run, on positions never trained.
        tie_embeddings: LMs: the output layer reuses the token embedding ``wte.weight``.
        rope_base: RoPE frequency base θ (Su et al., arXiv 2104.09864).
        n_experts: Experts per MoE layer (``moe`` only; 0 otherwise).
        top_k: Experts each token is routed to (``moe``).
        aux_loss_weight: Coefficient α of the load-balancing loss added to the LM loss (``moe``).
        image_size: Image height = width, in pixels (``vit``).
        patch_size: Patch height = width, in pixels; must divide ``image_size`` (``vit``).
        in_channels: Image channels (``vit``).
        n_classes: Output classes (``vit``).
        init_std: Standard deviation of the GPT-2 style normal init; residual output
            projections use ``init_std / sqrt(2 · n_layers)``.
    """

    family: Family
    n_layers: int
    d_model: int
    n_heads: int
    mlp_ratio: int = 4
    vocab_size: int = 256
    seq_len: int = 128
    tie_embeddings: bool = True
    rope_base: float = 10_000.0
    n_experts: int = 0
    top_k: int = 2
    aux_loss_weight: float = 0.01
    image_size: int = 8
    patch_size: int = 2
    in_channels: int = 1
    n_classes: int = 10
    init_std: float = 0.02

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ConfigError("invalid model spec: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``d_model // n_heads``)."""
        return self.d_model // self.n_heads

    @property
    def n_patches(self) -> int:
        """Patches per image (``vit``): ``(image_size // patch_size)²``."""
        return (self.image_size // self.patch_size) ** 2


def _problems(spec: ModelSpec) -> list[str]:
    out: list[str] = []
    if spec.family not in FAMILIES:
        out.append(f"family {spec.family!r} must be one of {FAMILIES}")
    for name in ("n_layers", "d_model", "n_heads", "mlp_ratio", "vocab_size", "seq_len"):
        if getattr(spec, name) < 1:
            out.append(f"{name} must be >= 1")
    if spec.n_heads >= 1 and spec.d_model % spec.n_heads:
        out.append(f"d_model {spec.d_model} must be divisible by n_heads {spec.n_heads}")
    elif spec.family != "vit" and spec.n_heads >= 1 and spec.head_dim % 2:
        out.append(f"head width d_model/n_heads = {spec.head_dim} must be even for RoPE")
    if spec.family == "moe" and spec.n_experts < 2:
        out.append("moe needs n_experts >= 2 (use family 'gpt' for a dense model)")
    elif spec.family == "moe" and not 1 <= spec.top_k <= spec.n_experts:
        out.append(f"top_k {spec.top_k} must be between 1 and n_experts {spec.n_experts}")
    if spec.family != "moe" and spec.n_experts:
        out.append(f"n_experts must be 0 for family {spec.family!r} (use family 'moe')")
    if spec.aux_loss_weight < 0 or spec.init_std <= 0 or spec.rope_base <= 1:
        out.append("aux_loss_weight must be >= 0, init_std > 0 and rope_base > 1")
    if spec.family == "vit":
        out.extend(_vit_problems(spec))
    return out


def _vit_problems(spec: ModelSpec) -> list[str]:
    out: list[str] = []
    for name in ("image_size", "patch_size", "in_channels", "n_classes"):
        if getattr(spec, name) < 1:
            out.append(f"{name} must be >= 1")
    if spec.patch_size >= 1 and spec.image_size % spec.patch_size:
        out.append(f"patch_size {spec.patch_size} must divide image_size {spec.image_size}")
    return out


PRESETS: Mapping[str, ModelSpec] = {
    "gpt-tiny": ModelSpec("gpt", n_layers=2, d_model=128, n_heads=4, seq_len=128),
    "gpt-small": ModelSpec("gpt", n_layers=8, d_model=384, n_heads=6, seq_len=256),
    "gpt-124m": ModelSpec(
        "gpt", n_layers=12, d_model=768, n_heads=12, vocab_size=50304, seq_len=1024
    ),
    "gpt-1b": ModelSpec(
        "gpt", n_layers=18, d_model=2048, n_heads=16, vocab_size=50304, seq_len=2048
    ),
    "moe-tiny": ModelSpec(
        "moe",
        n_layers=2,
        d_model=128,
        n_heads=4,
        mlp_ratio=2,
        seq_len=128,
        n_experts=4,
        top_k=2,
        aux_loss_weight=0.05,
    ),
    "moe-small": ModelSpec(
        "moe", n_layers=8, d_model=384, n_heads=6, mlp_ratio=2, seq_len=256, n_experts=8, top_k=2
    ),
    "vit-tiny": ModelSpec(
        "vit",
        n_layers=2,
        d_model=64,
        n_heads=4,
        image_size=8,
        patch_size=2,
        in_channels=1,
        n_classes=10,
    ),
    "vit-small": ModelSpec(
        "vit",
        n_layers=12,
        d_model=384,
        n_heads=6,
        image_size=32,
        patch_size=4,
        in_channels=3,
        n_classes=10,
    ),
}


def resolve_spec(preset: str | ModelSpec, **overrides: Any) -> ModelSpec:
    """Look up a preset by name (or take a spec) and apply field overrides.

    Args:
        preset: A name from ``PRESETS`` or a ``ModelSpec``.
        **overrides: ``ModelSpec`` fields to replace, e.g. ``n_layers=1``.

    Returns:
        The validated spec.

    Raises:
        ConfigError: Unknown preset or field, or an invalid resulting shape.
    """
    if isinstance(preset, ModelSpec):
        spec = preset
    elif preset in PRESETS:
        spec = PRESETS[preset]
    else:
        raise ConfigError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    known = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown model field(s) {unknown}; known fields: {sorted(known)}")
    return dataclasses.replace(spec, **overrides) if overrides else spec


def param_count(preset: str | ModelSpec, *, active: bool = False, **overrides: Any) -> int:
    """Exact number of trainable parameters, computed from the shape alone.

    Args:
        preset: A preset name or a ``ModelSpec``.
        active: For ``moe``, count only the ``top_k`` experts a token uses (per-token compute).
        **overrides: Fields to replace, as in ``resolve_spec``.

    Returns:
        Parameter count (elements, not bytes).
    """
    spec = resolve_spec(preset, **overrides)
    d, hidden = spec.d_model, spec.mlp_ratio * spec.d_model
    attention = 2 * d + 4 * d * d  # two RMSNorm weights, fused qkv (3d²) and output proj (d²)
    if spec.family == "moe":
        experts = spec.top_k if active else spec.n_experts
        mlp = spec.n_experts * d + experts * 2 * d * hidden  # router + experts (fc, proj)
    else:
        mlp = 2 * d * hidden
    blocks = spec.n_layers * (attention + mlp) + d  # + final norm
    if spec.family == "vit":
        patch = spec.in_channels * spec.patch_size**2
        return blocks + (patch + 1) * d + spec.n_patches * d + (d + 1) * spec.n_classes
    embeddings = spec.vocab_size * d * (1 if spec.tie_embeddings else 2)
    return blocks + embeddings
