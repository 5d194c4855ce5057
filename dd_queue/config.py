"""One typed, frozen configuration tree, loaded from YAML with environment overrides.

Precedence, lowest first: model defaults < YAML file (and the files it ``extends``) <
``DDQ__SECTION__FIELD`` environment variables < the command line's own flags.

- ``load_config(path, environ)`` reads ``path``; a top-level ``extends: base.yaml`` (relative to
  the file) loads that file first and deep-merges this one over it.
- ``DDQ__SYNCHRONIZER__QUORUM=2`` overrides ``synchronizer.quorum``; the value is parsed as a YAML
  scalar (``true``, ``2.5``, ``null``, ``[a, b]``). An override naming an unknown key is an error.
- Unknown keys anywhere are rejected with the key's dotted path; every field is documented and
  validated; cross-field rules live in model validators.
- ``cfg.digest`` is a stable sha256 of the resolved config (secrets excluded), logged at start and
  stamped on wire messages so mismatched processes are noticed.

Nothing here reads the environment unless ``load_config`` is called; the environment is injected.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Self, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from dd_queue.core.codec import CodecSpec, DecodeLimits
from dd_queue.core.membership import MembershipParams
from dd_queue.core.policy import PolicyParams
from dd_queue.errors import ConfigError
from dd_queue.messages import MessageLimits

ENV_PREFIX = "DDQ__"
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MiB = 1024 * 1024


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class RunConfig(_Section):
    """Identity of one training run and process-wide logging."""

    run_id: str = Field("demo", description="Namespace of every Redis key: ddq:<run_id>:...")
    seed: int = Field(0, ge=0, description="Base random seed; each learner derives its own.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Logging level of every process."
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="text for people, json (one object per line) for tools."
    )

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, run_id: str) -> str:
        if not _RUN_ID.match(run_id):
            raise ValueError(
                f"{run_id!r} must be 1-64 characters of letters, digits, '_', '.', '-', "
                "starting with a letter or digit (it becomes part of every Redis key)"
            )
        return run_id


class RedisConfig(_Section):
    """Where the bus lives and how it behaves when Redis is slow or gone."""

    url: str = Field("redis://127.0.0.1:6379/0", description="Redis (>= 7.0) or Valkey URL.")
    socket_timeout_s: float = Field(10.0, gt=0, description="Socket timeout of every connection.")
    block_ms: int = Field(
        2000, ge=1, description="Longest blocking stream read; must be below socket_timeout_s."
    )
    unavailable_after_s: float = Field(
        30.0, gt=0, description="Give up with BusUnavailable after retrying this long."
    )
    blob_chunk_bytes: int = Field(
        16 * MiB, ge=1024, le=512 * MiB, description="Largest Redis value a payload is split into."
    )
    contribution_ttl_s: float = Field(
        600.0, gt=0, description="Expiry of contribution payload keys (orphans vanish)."
    )
    global_ttl_s: float = Field(
        3600.0, gt=0, description="Expiry of superseded global-fragment payload keys."
    )
    stream_maxlen: int = Field(
        10_000, ge=16, description="Approximate length cap of every stream (MAXLEN ~)."
    )


class WireConfig(_Section):
    """Codec of contributions and the limits every decode enforces."""

    codec: Literal["fp32", "bf16", "int8", "int4"] = Field(
        "bf16", description="Contribution codec; global fragments are always fp32 (exact)."
    )
    block_size: int = Field(256, ge=8, le=1 << 20, description="Elements per int8/int4 scale.")
    zstd_level: int = Field(0, ge=0, le=22, description="zstandard level after the codec; 0=off.")
    shuffle: bool = Field(False, description="Byte-shuffle before zstd (pays for bf16 deltas).")
    max_envelope_bytes: int = Field(
        1 * MiB, ge=1024, description="Largest msgpack envelope (stream entry metadata) accepted."
    )
    max_payload_bytes: int = Field(
        2048 * MiB, ge=1024, description="Largest encoded payload accepted before decoding."
    )
    max_decompressed_bytes: int = Field(
        8192 * MiB, ge=1024, description="Largest raw codec byte count zstd may produce."
    )
    max_elements: int = Field(
        1 << 31, ge=1, description="Largest element count of one decoded fragment."
    )

    @model_validator(mode="after")
    def _check_shuffle(self) -> Self:
        if self.shuffle and (self.codec not in ("fp32", "bf16") or self.zstd_level == 0):
            raise ValueError(
                f"shuffle needs codec fp32 or bf16 and zstd_level >= 1 (got codec {self.codec}, "
                f"zstd_level {self.zstd_level}); set shuffle: false"
            )
        return self

    def codec_spec(self) -> CodecSpec:
        """The contribution codec as the core codec takes it."""
        return CodecSpec(
            name=self.codec,
            block_size=self.block_size,
            zstd_level=self.zstd_level,
            shuffle=self.shuffle,
        )

    def message_limits(self) -> MessageLimits:
        """The limits every envelope and payload decode enforces."""
        return MessageLimits(
            max_envelope_bytes=self.max_envelope_bytes,
            tensor=DecodeLimits(
                max_payload_bytes=self.max_payload_bytes,
                max_decompressed_bytes=self.max_decompressed_bytes,
                max_elements=self.max_elements,
            ),
        )


class ModelConfig(_Section):
    """The model every learner trains (shapes must agree across the run)."""

    name: Literal["gpt", "moe", "vit"] = Field("gpt", description="Model family.")
    n_layers: int = Field(2, ge=1, description="Transformer blocks.")
    d_model: int = Field(64, ge=8, description="Hidden width.")
    n_heads: int = Field(4, ge=1, description="Attention heads; must divide d_model.")
    vocab_size: int = Field(256, ge=2, description="Token vocabulary (byte-level by default).")
    seq_len: int = Field(64, ge=2, description="Tokens per training sequence.")
    n_experts: int = Field(0, ge=0, description="Experts per MoE layer (0 = dense).")
    tie_embeddings: bool = Field(True, description="Share the input embedding with the LM head.")

    @model_validator(mode="after")
    def _check_heads(self) -> Self:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} must be divisible by n_heads {self.n_heads}")
        if self.name == "moe" and self.n_experts < 2:
            raise ValueError("model.name 'moe' needs n_experts >= 2")
        return self


class DataConfig(_Section):
    """Where training tokens come from (nothing is downloaded at run time)."""

    source: Literal["synthetic", "stdlib-text"] = Field(
        "stdlib-text", description="Corpus: generated, or text that ships with Python."
    )
    batch_size: int = Field(8, ge=1, description="Sequences per inner step per learner.")
    eval_batches: int = Field(8, ge=0, description="Held-out batches per evaluation.")


class LearnerConfig(_Section):
    """Inner optimisation of each learner (AdamW) and how it exchanges fragments."""

    inner_lr: float = Field(3e-3, gt=0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up inner steps.")
    max_steps: int = Field(0, ge=0, description="Stop after this many inner steps (0 = never).")
    grad_clip: float = Field(1.0, ge=0, description="Gradient-norm clip (0 = off).")
    mix_alpha: float = Field(
        0.0, ge=0, le=1, description="θ ← α·θ + (1−α)·Θ on receipt; 0 overwrites (paper)."
    )
    error_feedback: bool = Field(
        True, description="Carry the quantization residual into the next contribution."
    )
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N.")


class SynchronizerConfig(_Section):
    """Rounds, quorum, grace window, merge and the Nesterov outer step."""

    n_fragments: int = Field(4, ge=1, description="P: fragments the parameters are split into.")
    sync_every_steps: int = Field(
        8, ge=1, description="H: inner steps between two syncs of the same fragment."
    )
    schedule: Literal["synchronizer", "learner"] = Field(
        "synchronizer", description="Who paces rounds: the synchronizer, or learner offsets."
    )
    quorum: int = Field(1, ge=1, description="K: distinct learners needed before a merge.")
    quorum_policy: Literal["wait", "shrink"] = Field(
        "wait", description="When K > live learners: wait for them, or shrink K to live count."
    )
    grace_gamma: float = Field(0.5, ge=0, le=1, description="γ: share of the slack to wait.")
    grace_cap_s: float | None = Field(
        None, ge=0, description="Upper bound of the grace window (null = one step time)."
    )
    overlap_steps: float = Field(1.0, ge=0, description="τ: inner steps a round may overlap.")
    round_timeout_s: float = Field(60.0, gt=0, description="Abandon a round without quorum.")
    ema_alpha: float = Field(0.2, gt=0, le=1, description="Weight of new samples in the EMAs.")
    max_staleness: int = Field(
        4, ge=0, description="Drop contributions more than this many versions behind."
    )
    outer_lr: float = Field(0.7, gt=0, description="Outer Nesterov learning rate.")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="Outer Nesterov momentum μ.")
    merge_rule: Literal["rda", "mean"] = Field(
        "rda", description="Radial-directional averaging, or weighted mean."
    )
    weighting: Literal["tokens", "uniform"] = Field(
        "tokens", description="w = tokens·(tokens/steps), or equal weights."
    )
    anchor: Literal["synchronizer", "learner"] = Field(
        "synchronizer", description="Re-anchor Δ at the current Θ (paper) or keep the learner's."
    )
    version_ring: int = Field(8, ge=1, description="Recent global versions kept for re-anchoring.")
    embedding_patterns: tuple[str, ...] = Field(
        ("embed", "wte", "lm_head"), description="Tensor-name parts merged by weighted mean."
    )
    lease_ttl_s: float = Field(10.0, gt=0, description="Fragment lease expiry (takeover time).")
    claim_idle_ms: int = Field(
        30_000, ge=0, description="Reclaim pending contributions idle this long."
    )

    def policy_params(self) -> PolicyParams:
        """The core policy's knobs, which mirror this section's field names."""
        names = PolicyParams.__dataclass_fields__
        return PolicyParams(**{k: v for k, v in self.model_dump().items() if k in names})

    @model_validator(mode="after")
    def _check_grace(self) -> Self:
        if self.grace_cap_s is not None and self.grace_cap_s >= self.round_timeout_s:
            raise ValueError(
                f"grace_cap_s {self.grace_cap_s} must be below round_timeout_s "
                f"{self.round_timeout_s}, or every round would time out while waiting"
            )
        return self


class MembershipConfig(_Section):
    """Heartbeats and the liveness thresholds derived from their age."""

    expected_learners: int = Field(2, ge=1, description="Learners a run is planned for.")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="Seconds between heartbeats.")
    straggling_after_s: float = Field(3.0, gt=0, description="Heartbeat age that marks slow.")
    stalled_after_s: float = Field(10.0, gt=0, description="Heartbeat age that marks stalled.")
    dead_after_s: float = Field(
        30.0, gt=0, description="Heartbeat age that marks dead (>= 3 × interval)."
    )
    slow_step_factor: float | None = Field(
        2.0, gt=1, description="Straggling if step time > this × the median (null = off)."
    )

    def params(self) -> MembershipParams:
        """The core liveness rules' thresholds."""
        return MembershipParams(
            straggling_after_s=self.straggling_after_s,
            stalled_after_s=self.stalled_after_s,
            dead_after_s=self.dead_after_s,
            slow_step_factor=self.slow_step_factor,
        )

    @model_validator(mode="after")
    def _check_thresholds(self) -> Self:
        if self.dead_after_s < 3 * self.heartbeat_interval_s:
            raise ValueError(
                f"dead_after_s {self.dead_after_s} must be >= 3 × heartbeat_interval_s "
                f"{self.heartbeat_interval_s}, or one late heartbeat would kill a learner"
            )
        if not self.straggling_after_s < self.stalled_after_s < self.dead_after_s:
            raise ValueError(
                "thresholds must rise: straggling_after_s < stalled_after_s < dead_after_s "
                f"(got {self.straggling_after_s}, {self.stalled_after_s}, {self.dead_after_s})"
            )
        return self


class ControlConfig(_Section):
    """The FastAPI control plane and dashboard."""

    host: str = Field("127.0.0.1", description="Bind address; loopback unless told otherwise.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    token: SecretStr | None = Field(
        None, description="Bearer token for writes (faults, operator actions); null = no writes."
    )
    refresh_s: float = Field(1.0, gt=0, description="Dashboard refresh period.")


FaultKind = Literal["stall", "slow", "drop", "delay", "corrupt", "disconnect", "kill"]


class FaultSpec(_Section):
    """One scheduled fault: at ``at_s`` seconds into the run, do ``kind`` to ``target``."""

    at_s: float = Field(ge=0, description="Seconds after the run starts.")
    target: str = Field(description="Learner id, 'synchronizer', or '*'.")
    kind: FaultKind = Field(description="What to do.")
    duration_s: float = Field(0.0, ge=0, description="How long it lasts (0 = instant).")


class FaultsConfig(_Section):
    """Fault injection: enabled switch and an optional schedule."""

    enabled: bool = Field(True, description="Accept fault commands at all.")
    schedule: tuple[FaultSpec, ...] = Field((), description="Faults injected at fixed times.")


class DDQConfig(_Section):
    """The whole resolved configuration of one process."""

    run: RunConfig = Field(default_factory=RunConfig, description="Run identity and logging.")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="The Redis bus.")
    wire: WireConfig = Field(default_factory=WireConfig, description="Codec and decode limits.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The model.")
    data: DataConfig = Field(default_factory=DataConfig, description="The training data.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="Learners.")
    synchronizer: SynchronizerConfig = Field(
        default_factory=SynchronizerConfig, description="The synchronizer."
    )
    membership: MembershipConfig = Field(
        default_factory=MembershipConfig, description="Heartbeats and liveness."
    )
    control: ControlConfig = Field(default_factory=ControlConfig, description="Control plane.")
    faults: FaultsConfig = Field(default_factory=FaultsConfig, description="Fault injection.")

    @model_validator(mode="after")
    def _check_cross_section(self) -> Self:
        if self.redis.block_ms >= self.redis.socket_timeout_s * 1000:
            raise ValueError(
                f"redis.block_ms {self.redis.block_ms} must be below redis.socket_timeout_s "
                f"({self.redis.socket_timeout_s} s), or a dead server is noticed only after "
                "a minute of silent retries"
            )
        sync = self.synchronizer
        if sync.quorum_policy == "wait" and sync.quorum > self.membership.expected_learners:
            raise ValueError(
                f"synchronizer.quorum {sync.quorum} exceeds membership.expected_learners "
                f"{self.membership.expected_learners} with quorum_policy 'wait': no round "
                "could ever merge; lower the quorum or use quorum_policy 'shrink'"
            )
        return self

    def public_dict(self) -> dict[str, Any]:
        """The resolved config as plain JSON-able data, secrets redacted."""
        data = self.model_dump(mode="json")
        if self.control.token is not None:
            data["control"]["token"] = "***"
        return data

    @property
    def digest(self) -> str:
        """Stable sha256 (hex, 16 chars) of the resolved config without secrets."""
        data = self.model_dump(mode="json")
        data["control"].pop("token", None)
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> DDQConfig:
    """Load ``path`` (following ``extends``), apply ``DDQ__`` overrides, validate.

    Args:
        path: A YAML file, e.g. ``config/demo.yaml``.
        environ: Variables to read ``DDQ__SECTION__FIELD`` overrides from (``None``: none).

    Raises:
        ConfigError: unreadable file, bad YAML, unknown key, invalid value or override.
    """
    raw = _read_yaml_tree(Path(path), seen=())
    for name, value in sorted((environ or {}).items()):
        if name.startswith(ENV_PREFIX):
            _apply_override(raw, name, value)
    return validate_config(raw, source=str(path))


def validate_config(raw: Mapping[str, Any], *, source: str = "<dict>") -> DDQConfig:
    """Validate a plain mapping into a ``DDQConfig``, turning pydantic errors into ConfigError."""
    try:
        return DDQConfig.model_validate(raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(part) for part in err["loc"]) or "<top>"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown key (check the spelling against config/base.yaml)"
            lines.append(f"  {where}: {msg}")
        raise ConfigError(f"invalid config {source}:\n" + "\n".join(lines)) from None


def _read_yaml_tree(path: Path, *, seen: tuple[Path, ...]) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in seen:
        raise ConfigError(f"config {path} extends itself (cycle: {[str(p) for p in seen]})")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config {path} must be a mapping of sections, not {type(loaded)}")
    parent = loaded.pop("extends", None)
    if parent is None:
        return loaded
    if not isinstance(parent, str):
        raise ConfigError(f"config {path}: 'extends' must be a file name, got {parent!r}")
    base = _read_yaml_tree(path.parent / parent, seen=(*seen, resolved))
    return _deep_merge(base, loaded)


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _apply_override(raw: dict[str, Any], name: str, value: str) -> None:
    parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"environment override {name} must look like DDQ__SECTION__FIELD")
    model: type[BaseModel] = DDQConfig
    node = raw
    for depth, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            path = ".".join(parts[: depth + 1])
            raise ConfigError(f"environment override {name}: unknown key {path}")
        if depth == len(parts) - 1:
            node[part] = _parse_override(name, value, field.annotation)
            return
        annotation = field.annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            raise ConfigError(
                f"environment override {name}: {'.'.join(parts[: depth + 1])} "
                "is a value, not a section"
            )
        model = annotation
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"environment override {name}: {part} is not a section")
        node = child


def _parse_override(name: str, value: str, annotation: Any) -> Any:
    """Parse an override as a YAML scalar, but keep text fields text (a token may be ``123``)."""
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise ConfigError(f"environment override {name}: bad value: {exc}") from None
    options = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else ()
    wants_text = any(t in (str, SecretStr) for t in (annotation, *options))
    if wants_text and parsed is not None and not isinstance(parsed, str):
        return value
    return parsed
