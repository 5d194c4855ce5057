"""The configuration tree: one frozen, documented, validated pydantic model per section.

Every field has a default, a description and units in its name; cross-field rules live in model
validators and name the fields. ``config/base.yaml`` states every field (a test checks it). Loading
from YAML and the environment is :mod:`dd_queue.config.loader`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Literal, Self, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from dd_queue.bus import RedisOptions
from dd_queue.bus._redis_conn import client_kwargs, split_password
from dd_queue.core.codec import CodecSpec, DecodeLimits
from dd_queue.core.fragments import DEFAULT_EMBEDDING_PATTERNS
from dd_queue.core.membership import MembershipParams
from dd_queue.core.merge import Rule as MergeRule
from dd_queue.core.policy import PolicyParams
from dd_queue.data import DataSpec
from dd_queue.errors import ConfigError
from dd_queue.keys import check_name
from dd_queue.messages import MessageLimits
from dd_queue.models.arch import (
    DEFAULT_SEQ_LEN,
    Architecture,
    parse_factory,
    read_hf_config,
    weights_fingerprint,
)
from dd_queue.models.spec import ModelSpec, resolve_spec

MiB = 1024 * 1024
RUN_DIGEST_PARTS = ("run_id", "model", "plan", "data", "expected_learners")
_PART_SETTINGS = {
    "run_id": "run.run_id",
    "model": "the model (model.*)",
    "plan": "the fragment plan (synchronizer.n_fragments, sync_every_steps, schedule, "
    "embedding_patterns)",
    "data": "the data (data.source and what picks its examples, or for prepared data the "
    "dataset fingerprint and the tokenizer)",
    "expected_learners": "membership.expected_learners (it deals the data shards: learners "
    "that disagree train on overlapping data)",
}


def _hash8(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:8]


def digest_mismatch(ours: str, theirs: str) -> str:
    """Which settings two run digests disagree on, in words ("" if they are equal)."""
    if ours == theirs:
        return ""
    a, b = ours.split("-"), theirs.split("-")
    if len(a) != len(b) or len(a) != len(RUN_DIGEST_PARTS):
        return "the digest format (another dd_queue version?)"
    return "; ".join(
        _PART_SETTINGS[p] for p, x, y in zip(RUN_DIGEST_PARTS, a, b, strict=True) if x != y
    )


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


def _secret_from_file(data: dict[str, Any], name: str) -> dict[str, Any]:
    """``data`` with ``name`` read from the file ``<name>_file`` names (one trailing newline
    dropped), as Docker and Kubernetes mount secrets. Both given must agree, so a loaded
    config validates again unchanged."""
    path = data.get(f"{name}_file")
    if path is None:
        return data
    try:
        secret = Path(path).read_text(encoding="utf-8").removesuffix("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{name}_file {str(path)!r} cannot be read: {exc}") from None
    given = data.get(name)
    if given is not None:
        value = given.get_secret_value() if isinstance(given, SecretStr) else given
        if value != secret:
            raise ValueError(f"{name} is given twice ({name} and {name}_file): keep one")
    return {**data, name: secret}


def _secret_slots(data: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """``(mapping, key)`` of every secret field in a ``DDQConfig.model_dump()``."""
    slots = []
    for path in secret_paths(DDQConfig):
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        slots.append((node, leaf))
    return slots


def secret_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of every secret field (typed ``SecretStr``) of ``model``, set or not."""
    out: list[str] = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out += secret_paths(kind, f"{prefix}{name}.")
        elif SecretStr in (kind, *get_args(kind)):
            out.append(f"{prefix}{name}")
    return out


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
    start_timeout_s: float = Field(
        300.0,
        gt=0,
        description="At start, wait this long for Redis (evaluator: and the run), then exit 3.",
    )

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, run_id: str) -> str:
        try:
            return check_name("run_id", run_id)
        except ConfigError as exc:  # pydantic reports ValueErrors with the field's path
            raise ValueError(str(exc)) from None


class RedisConfig(_Section):
    """Where the bus lives and how it behaves when Redis is slow or gone."""

    url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis (>= 7.0) or Valkey URL; a password in it moves to redis.password.",
    )
    password: SecretStr | None = Field(
        None, description="Redis AUTH password (with the URL's user name); never printed."
    )
    password_file: Path | None = Field(
        None, description="Read redis.password from this file (a Docker/Kubernetes secret)."
    )
    tls_ca_file: Path | None = Field(
        None, description="rediss:// only: CA bundle of the server's certificate (None: system)."
    )
    tls_cert_file: Path | None = Field(
        None, description="Client certificate (PEM) for servers that check clients; with the key."
    )
    tls_key_file: Path | None = Field(
        None, description="The client certificate's private key (PEM); only its path is held."
    )
    tls_check_hostname: bool = Field(
        True, description="Check that the server's certificate names the URL's host."
    )
    socket_timeout_s: float = Field(
        10.0, gt=0, description="Read timeout of control and reader connections."
    )
    connect_timeout_s: float = Field(2.0, gt=0, description="TCP connect timeout.")
    blob_socket_timeout_s: float = Field(
        60.0, gt=0, description="Read timeout of payload transfers (big values, slow links)."
    )
    heartbeat_socket_timeout_s: float = Field(
        5.0, gt=0, description="Read timeout of the heartbeat connection."
    )
    max_block_ms: int = Field(
        2000, ge=1, description="Longest blocking read sent to Redis; below socket_timeout_s."
    )
    unavailable_after_s: float = Field(
        30.0, gt=0, description="Give up with BusUnavailable after retrying this long."
    )
    retry_base_s: float = Field(0.05, gt=0, description="First reconnect backoff (jittered).")
    retry_cap_s: float = Field(1.0, gt=0, description="Largest reconnect backoff step.")
    health_check_interval_s: float = Field(
        30.0, ge=0, description="PING connections idle this long before reuse (0 = off)."
    )
    max_connections: int = Field(64, ge=4, description="Connection pool size of each client.")
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
    rounds_maxlen: int = Field(
        1_000,
        ge=16,
        description="Approximate number of round records kept per fragment (the history the "
        "API, dashboard and `ddq report` read). A record holds ~200 bytes per contribution, the "
        "largest entries of the run, so it has its own cap; totals live in the fragment states.",
    )
    commit_replicas: int = Field(
        0,
        ge=0,
        description="A fenced commit counts only once this many replicas hold it (WAIT); "
        "0 = the master's reply suffices.",
    )
    commit_wait_ms: int = Field(
        1000, ge=1, description="Longest WAIT for commit_replicas before the commit is failed."
    )

    @model_validator(mode="before")
    @classmethod
    def _credentials(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        url = data.get("url")
        if isinstance(url, str):
            stripped, password = split_password(url)
            if password is not None:
                if data.get("password") is not None or data.get("password_file") is not None:
                    raise ValueError(
                        "the Redis password is given twice (in url and in password or "
                        "password_file): keep one"
                    )
                data = {**data, "url": stripped, "password": password}
        return _secret_from_file(data, "password")

    @field_validator("tls_ca_file", "tls_cert_file", "tls_key_file")
    @classmethod
    def _readable(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError(f"{str(path)!r} is not a file (a PEM file is expected)")
        return path

    @model_validator(mode="after")
    def _check_tls(self) -> Self:
        try:
            client_kwargs(self.url, self.options())
        except ConfigError as exc:  # pydantic reports ValueErrors with the section's path
            raise ValueError(str(exc)) from None
        return self

    @model_validator(mode="after")
    def _check_block(self) -> Self:
        if self.socket_timeout_s * 1000 < self.max_block_ms + 1000:
            raise ValueError(
                f"max_block_ms {self.max_block_ms} must stay at least 1 s below socket_timeout_s "
                f"({self.socket_timeout_s} s), or a dead server is noticed only after a minute "
                "of silent retries"
            )
        return self

    def options(self) -> RedisOptions:
        """The ``RedisBus`` options, whose names this section mirrors."""
        names = RedisOptions.__dataclass_fields__
        return RedisOptions(**{k: v for k, v in self.model_dump().items() if k in names})


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
    """The model every learner trains: a preset with optional shape overrides (null = preset's),
    a Hugging Face causal-LM config, or a factory of your own (``models/arch.py``)."""

    source: Literal["preset", "hf", "module"] = Field(
        "preset", description="preset (below), hf (hf_config/hf_options) or module (factory)."
    )
    preset: str = Field(
        "gpt-tiny",
        description="Shape by name: gpt-tiny|small|124m|1b, moe-tiny|small, vit-tiny|small.",
    )
    hf_config: str | None = Field(
        None, description="hf: a local directory holding config.json, or the file itself."
    )
    hf_options: dict[str, Any] = Field(
        default_factory=dict, description="hf: config keys set on top (alone: the whole config)."
    )
    factory: str | None = Field(
        None, description="module: 'package.module:callable' returning an nn.Module."
    )
    factory_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="module: keyword arguments of the factory."
    )
    adapter: Literal["logits", "batch"] = Field(
        "logits",
        description="module: model(inputs) gives logits, or model(batch) gives the loss.",
    )
    n_layers: int | None = Field(None, ge=1, description="Transformer blocks.")
    d_model: int | None = Field(None, ge=8, description="Hidden width.")
    n_heads: int | None = Field(None, ge=1, description="Attention heads; must divide d_model.")
    mlp_ratio: int | None = Field(None, ge=1, description="MLP width ÷ d_model.")
    vocab_size: int | None = Field(None, ge=2, description="Token vocabulary (bytes: 256).")
    seq_len: int | None = Field(None, ge=2, description="Tokens per sequence (data window).")
    tie_embeddings: bool | None = Field(None, description="LM head reuses the input embedding.")
    n_experts: int | None = Field(None, ge=0, description="Experts per MoE layer (0 = dense).")
    top_k: int | None = Field(None, ge=1, description="Experts each token is routed to.")
    aux_loss_weight: float | None = Field(
        None, ge=0, description="Weight of the MoE load-balancing loss."
    )
    image_size: int | None = Field(None, ge=2, description="ViT input side, pixels.")
    patch_size: int | None = Field(None, ge=1, description="ViT patch side, pixels.")
    in_channels: int | None = Field(None, ge=1, description="ViT input channels.")
    n_classes: int | None = Field(None, ge=2, description="ViT output classes.")
    hf_pretrained: str | None = Field(
        None,
        description="hf: a local save_pretrained directory; every process loads its weights.",
    )
    freeze: tuple[str, ...] = Field(
        (), description="Parameter name patterns (fnmatch) not trained and not synchronized."
    )
    lora_r: int = Field(0, ge=0, description="hf: LoRA rank (peft); 0 trains the model itself.")
    lora_alpha: float = Field(16.0, gt=0, description="hf: LoRA scale numerator (alpha / r).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="hf: dropout on the LoRA input.")
    lora_targets: tuple[str, ...] = Field(
        ("q_proj", "v_proj"), description="hf: module names that get LoRA adapters."
    )
    compile: bool = Field(False, description="Wrap the model in torch.compile.")
    autocast: Literal["bf16", "fp16", "off"] = Field(
        "bf16",
        description="Autocast on CUDA: bf16, or fp16 with a GradScaler (GPUs without bf16).",
    )

    def overrides(self) -> dict[str, Any]:
        """The preset shape fields that are set, as ``build_model`` keyword arguments."""
        shape = {f.name for f in dataclasses.fields(ModelSpec)}
        return {k: v for k, v in self.model_dump().items() if k in shape and v is not None}

    def spec(self) -> ModelSpec:
        """The resolved preset shape (preset + overrides), validated.

        Raises:
            ConfigError: The source is not ``preset`` (use ``architecture()``).
        """
        if self.source != "preset":
            raise ConfigError(f"model.source is {self.source!r}: it has no preset spec")
        return resolve_spec(self.preset, **self.overrides())

    def architecture(self) -> Architecture:
        """What every process builds (source, vocabulary, window, identity), validated; an hf
        source reads its config.json here.

        Raises:
            ConfigError: An invalid shape, an unreadable or incomplete hf config, a bad
                factory path, or preset fields set for another source.
        """
        if self.source == "preset":
            spec = self.spec()
            return Architecture(
                "preset", spec.family, spec.vocab_size, spec.seq_len, spec=spec, freeze=self.freeze
            )
        stray = sorted(set(self.overrides()) - {"vocab_size", "seq_len"})
        if stray:
            where = "model.hf_options" if self.source == "hf" else "model.factory_kwargs"
            raise ConfigError(
                f"model.{', model.'.join(stray)} shape a preset; with model.source "
                f"{self.source!r} set them in {where}"
            )
        seq_len = self.seq_len or DEFAULT_SEQ_LEN
        if self.source != "hf" and (self.hf_pretrained or self.lora_r):
            raise ConfigError(
                "model.hf_pretrained and model.lora_r need model.source 'hf' (a transformers "
                "model); freeze parameters of other models with model.freeze"
            )
        if self.source == "hf":
            keys = read_hf_config(self.hf_config or self.hf_pretrained, self.hf_options)
            if self.vocab_size is not None and self.vocab_size != keys["vocab_size"]:
                raise ConfigError(
                    f"model.vocab_size {self.vocab_size} differs from the hf config's "
                    f"vocab_size {keys['vocab_size']}: set it in one place"
                )
            return Architecture(
                "hf",
                "hf",
                keys["vocab_size"],
                seq_len,
                hf_config=keys,
                pretrained=self.hf_pretrained,
                weights=weights_fingerprint(self.hf_pretrained) if self.hf_pretrained else None,
                freeze=self.freeze,
                lora=self._lora(),
            )
        if self.factory is None or self.vocab_size is None:
            raise ConfigError(
                "model.source 'module' needs model.factory ('package.module:callable') and "
                "model.vocab_size (the token ids the model embeds)"
            )
        parse_factory(self.factory)
        return Architecture(
            "module",
            "module",
            self.vocab_size,
            seq_len,
            factory=self.factory,
            factory_kwargs=dict(self.factory_kwargs),
            adapter=self.adapter,
            freeze=self.freeze,
        )

    def _lora(self) -> dict[str, Any] | None:
        if not self.lora_r:
            return None
        return {
            "r": self.lora_r,
            "alpha": self.lora_alpha,
            "dropout": self.lora_dropout,
            "targets": list(self.lora_targets),
        }

    @model_validator(mode="after")
    def _check_shape(self) -> Self:
        try:
            self.architecture()
        except ConfigError as exc:  # reported by pydantic with the section's path
            raise ValueError(str(exc)) from None
        return self


class DataConfig(_Section):
    """Where training examples come from (nothing is downloaded at run time)."""

    source: Literal["stdlib-text", "text-files", "token-bin", "prepared", "digits", "npz"] = Field(
        "stdlib-text",
        description="Python's own stdlib text, text files, uint16 .bin, ddq prepare's output, "
        "or images.",
    )
    path: str | None = Field(
        None, description="Directory/glob, .bin or .npz (when the source needs one)."
    )
    max_bytes: int = Field(16 * MiB, ge=1, description="Cap of a byte-level text corpus.")
    suffixes: tuple[str, ...] = Field(
        (".py", ".rst", ".txt"), description="File endings read from a text directory."
    )
    eval_fraction: float = Field(0.05, ge=0, lt=1, description="Share held out for evaluation.")
    batch_size: int = Field(8, ge=1, description="Examples per inner step per learner.")
    eval_batches: int = Field(8, ge=0, description="Held-out batches per evaluation.")

    @model_validator(mode="after")
    def _check_path(self) -> Self:
        if self.source in ("text-files", "token-bin", "prepared", "npz") and not self.path:
            raise ValueError(f"source {self.source!r} needs data.path")
        if self.source == "prepared":
            try:
                self.identity()
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return self

    def identity(self) -> dict[str, Any]:
        """What every learner's data must agree on (in the run digest): for ``prepared``, the
        manifest's dataset fingerprint, tokenizer hash and token counts (its JSON is read, the
        token files only measured); otherwise the settings that choose the examples."""
        if self.source == "prepared" and self.path:
            from dd_queue.data.manifest import read_manifest  # no torch: JSON and stat only

            return {"source": self.source, **read_manifest(self.path).identity()}
        return self.model_dump(
            mode="json", include={"source", "max_bytes", "suffixes", "eval_fraction"}
        )

    def spec(self, *, vocab_size: int) -> DataSpec:
        """The data spec the loaders take; ``vocab_size`` bounds the ids of a token-bin file."""
        fields = self.model_dump(exclude={"eval_batches"})
        return DataSpec(**fields, vocab_size=vocab_size)


class LearnerConfig(_Section):
    """Inner optimisation of each learner (AdamW) and how it exchanges fragments."""

    inner_lr: float = Field(3e-3, gt=0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up inner steps.")
    max_steps: int = Field(0, ge=0, description="Stop after this many inner steps (0 = never).")
    grad_clip: float = Field(1.0, ge=0, description="Gradient-norm clip (0 = off).")
    grad_accum_steps: int = Field(
        1, ge=1, description="Micro-batches (of data.batch_size) whose gradients make one step."
    )
    mix_alpha: float = Field(
        0.0, ge=0, le=1, description="θ ← α·θ + (1−α)·Θ on receipt; 0 overwrites (paper)."
    )
    error_feedback: bool = Field(
        True, description="Carry the quantization residual into the next contribution."
    )
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW β1.")
    adam_beta2: float = Field(0.95, ge=0, lt=1, description="AdamW β2.")
    decay_steps: int = Field(
        0, ge=0, description="Cosine decay steps after warm-up (0 = max_steps; both 0 = none)."
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine floor ÷ inner_lr.")
    join_timeout_s: float = Field(
        300.0, gt=0, description="At start, wait this long for the initial global model."
    )
    receive_block_ms: int = Field(
        100, ge=1, description="Longest wait of the receiver for a round opening, ms."
    )
    resync_interval_s: float = Field(
        10.0, gt=0, description="Re-check every fragment's newest global this often."
    )
    checkpoint_dir: str | None = Field(
        None, description="Local checkpoints of inner-optimizer state + data position (null=off)."
    )
    checkpoint_every_steps: int = Field(500, ge=1, description="Inner steps between checkpoints.")
    leave_timeout_s: float = Field(
        10.0, ge=0, description="On shutdown, flush queued contributions this long at most."
    )
    step_log: str | None = Field(
        None,
        description="Append one JSON line per inner step to this file ({learner_id} expands).",
    )


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
    overlap_steps: float = Field(3.0, ge=0, description="τ: inner steps a round may overlap.")
    round_timeout_s: float = Field(60.0, gt=0, description="Abandon a round without quorum.")
    ema_alpha: float = Field(0.2, gt=0, le=1, description="Weight of new samples in the EMAs.")
    max_staleness: int = Field(
        4, ge=0, description="Drop contributions more than this many versions behind."
    )
    outer_lr: float = Field(0.7, gt=0, description="Outer Nesterov learning rate.")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="Outer Nesterov momentum μ.")
    merge_rule: MergeRule = Field(
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
        DEFAULT_EMBEDDING_PATTERNS, description="Tensor-name parts merged by weighted mean."
    )
    lease_ttl_s: float = Field(10.0, gt=0, description="Fragment lease expiry (takeover time).")
    claim_idle_ms: int = Field(
        30_000, ge=0, description="Reclaim pending contributions idle this long."
    )
    initial_step_time_s: float = Field(
        1.0, gt=0, description="ξ_step guess that paces rounds until learners report theirs."
    )
    max_fragments: int = Field(
        0, ge=0, description="Most fragments one synchronizer owns (0 = all it can take)."
    )
    snapshot_dir: Path | None = Field(
        None,
        description="Write snapshots of the fragments owned here, and restore a fragment Redis "
        "lost from the newest one (None = off).",
    )
    snapshot_every_versions: int = Field(
        100, ge=1, description="Snapshot a fragment every this many versions."
    )
    snapshot_keep: int = Field(3, ge=1, description="Snapshots kept per fragment (oldest go).")
    share: Literal["greedy", "fair"] = Field(
        "greedy",
        description="greedy: take every free fragment (a second synchronizer stands by); fair: "
        "deal the shards among the live synchronizers, each taking and keeping its own.",
    )
    eval_interval_s: float = Field(
        60.0, gt=0, description="Seconds between evaluations of the global model (evaluator)."
    )
    fetch_processes: int = Field(
        2,
        ge=0,
        le=64,
        description="Child processes that fetch and decode contributions (Linux, Redis; 0 = a "
        "thread of the synchronizer's own process).",
    )
    merge_threads: int = Field(
        0,
        ge=0,
        le=64,
        description="Threads that share the merge and outer step (the same bits for any "
        "count; 0 = the cores the fetch processes leave, 1 to 4).",
    )
    max_takes: int = Field(
        3,
        ge=1,
        description="An entry still pending after its fragment was taken up this many times "
        "(synchronizer starts and takeovers) is dead-lettered as poison: it may be what crashes "
        "the synchronizer.",
    )
    max_tokens_per_step: int = Field(
        0,
        ge=0,
        description="A contribution claiming more tokens per inner step is dead-lettered as "
        "implausible (0: 1024 × data.batch_size × learner.grad_accum_steps × the model's "
        "seq_len, room for big DDP groups).",
    )

    max_steps_per_s: float = Field(
        10_000.0,
        gt=0,
        description="A contribution claiming more inner steps than this many a second since its "
        "base version was published is dead-lettered as implausible (measured on the bus's "
        "clock; far above any real step rate).",
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
    admin_token: SecretStr | None = Field(
        None,
        min_length=16,
        description="Bearer token of the mutating routes (faults, chaos); null = generate one "
        "at start (logged once) and keep writes off unless enable_writes.",
    )
    admin_token_file: Path | None = Field(
        None, description="Read control.admin_token from this file (a Docker/Kubernetes secret)."
    )

    @model_validator(mode="before")
    @classmethod
    def _token_file(cls, data: Any) -> Any:
        return _secret_from_file(data, "admin_token") if isinstance(data, dict) else data

    enable_writes: bool = Field(
        False, description="With no admin_token: allow writes with the generated token."
    )
    allowed_hosts: tuple[str, ...] = Field(
        (),
        description="Host names served besides loopback and the bind address (DNS rebinding "
        "guard: any other Host header gets 400).",
    )
    max_body_bytes: int = Field(
        16384, ge=256, le=1024 * 1024, description="Larger request bodies get 413, unread."
    )
    refresh_s: float = Field(
        1.0, gt=0, le=60, description="Seconds between refreshes (dashboard, SSE, chaos ticks)."
    )


class TrackingConfig(_Section):
    """Experiment tracking: TensorBoard event files, W&B runs (``dd_queue.tracking``)."""

    backends: tuple[Literal["tensorboard", "wandb"], ...] = Field(
        (), description="Where curves go: tensorboard, wandb, both, or none (off)."
    )
    dir: str | None = Field(
        None,
        description="Parent of <run_id>/<process>/ tracking folders (null: ./tracking; "
        "ddq up: the run directory's tracking/).",
    )
    every_steps: int = Field(10, ge=1, description="Learner inner steps between logged points.")
    wandb_project: str = Field("dd_queue", min_length=1, description="W&B project name.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline writes runs to disk for `wandb sync`; online uploads."
    )

    @field_validator("backends")
    @classmethod
    def _unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"lists a backend twice: {list(value)}")
        return value


FaultKind = Literal["stall", "slow", "drop", "delay", "corrupt", "disconnect", "kill"]


class FaultSpec(_Section):
    """One scheduled fault: at ``at_s`` seconds into the run, do ``kind`` to ``target``."""

    at_s: float = Field(ge=0, description="Seconds after the run starts.")
    target: str = Field(description="Learner id, 'synchronizer', or '*'.")
    kind: FaultKind = Field(description="What to do.")
    duration_s: float = Field(0.0, ge=0, description="How long it lasts (0 = instant).")


class FaultsConfig(_Section):
    """Fault injection: enabled switch and an optional schedule."""

    enabled: bool = Field(False, description="Accept fault commands at all (off unless asked).")
    schedule: tuple[FaultSpec, ...] = Field((), description="Faults injected at fixed times.")


class AuthConfig(_Section):
    """Signed messages (``dd_queue.auth``): who may contribute, publish globals, send faults."""

    keys_dir: Path | None = Field(
        None,
        description="Directory of keyring.json and this process's <principal>.key (ddq keys); "
        "null = nothing is signed or checked (anyone who can write to Redis can forge messages).",
    )
    key_file: Path | None = Field(
        None, description="This process's private key, if not <keys_dir>/<principal>.key."
    )
    max_command_age_s: float = Field(
        300.0,
        gt=0,
        description="A signed fault command older than this (or seen before) is a replay; refused.",
    )


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
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Signed messages.")
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="TensorBoard and W&B curves."
    )

    @model_validator(mode="after")
    def _check_cross_section(self) -> Self:
        arch = self.model.architecture()
        images = self.data.source in ("digits", "npz")
        if images != arch.is_image:
            kind = "image" if images else "text"
            raise ValueError(
                f"data.source {self.data.source!r} gives {kind} examples but the model "
                f"({arch.describe()}) is a {arch.family} model; pair vit presets with "
                "digits/npz and every other model with text sources"
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
        """The resolved config as plain JSON-able data, every secret that is set shown as ***."""
        data = self.model_dump(mode="json")
        for node, leaf in _secret_slots(data):
            if node[leaf] is not None:
                node[leaf] = "***"
        return data

    def run_identity(self) -> dict[str, Any]:
        """What every process of one run must agree on, part by part (``RUN_DIGEST_PARTS``).

        The run id, the architecture (``models/arch.py``), the fragment plan's inputs (P, H,
        schedule, embedding patterns), the data's identity (for prepared data: the dataset
        fingerprint and the tokenizer's hash) and ``expected_learners`` (it deals the data
        shards, so learners that disagree would train on overlapping data). Everything else
        (Redis URL, devices, codecs, log levels, timeouts) may differ between machines.
        """
        sync = self.synchronizer
        return {
            "run_id": self.run.run_id,
            "model": self.model.architecture().identity(),
            "plan": {
                "n_fragments": sync.n_fragments,
                "sync_every_steps": sync.sync_every_steps,
                "schedule": sync.schedule,
                "embedding_patterns": list(sync.embedding_patterns),
            },
            "data": self.data.identity(),
            "expected_learners": self.membership.expected_learners,
        }

    @property
    def run_digest(self) -> str:
        """``run_identity`` hashed part by part: 8 hex digits of sha256 per part, joined by
        ``-`` in ``RUN_DIGEST_PARTS`` order, so a mismatch names the part that differs
        (``digest_mismatch``). Contributions stamped with another run digest cannot be merged,
        and a learner whose digest differs is refused when it joins."""
        identity = self.run_identity()
        return "-".join(_hash8(identity[part]) for part in RUN_DIGEST_PARTS)

    @property
    def digest(self) -> str:
        """Stable sha256 (hex, 16 chars) of the resolved config without secrets."""
        data = self.model_dump(mode="json")
        for node, leaf in _secret_slots(data):
            del node[leaf]
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]
