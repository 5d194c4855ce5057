"""Export the current global model to safetensors, and read such a file back to re-seed a run.

    ddq export --config config/demo.yaml --out model.safetensors
    ddq export --config my-llama.yaml --format hf --out my-llama/    # from_pretrained loads it

The file holds every parameter tensor (float32, the names the model's ``named_parameters()``
gives) and string metadata: ``format`` (``ddq.export.v1``), ``run_id``, ``config_digest``,
``plan_digest``, ``n_fragments`` and ``versions`` (JSON: fragment → the global version exported).
Each fragment's newest published version is read with ``ops.read_global`` (checksum verified,
bit-exact), laid out by the fragment's committed state. ``ddq synchronizer --init-from FILE``
creates a new run from it (same model shapes required: the plan digest is checked as usual).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from dd_queue.auth import Auth
from dd_queue.bus import Bus, ops
from dd_queue.config import DDQConfig
from dd_queue.core.fragments import unflatten_fragment
from dd_queue.core.tallies import tokens_merged
from dd_queue.errors import ConfigError, CorruptPayload, NotReady
from dd_queue.fragment_state import FragmentState, fragment_of
from dd_queue.synchronizer.source import ArraySource

__all__ = [
    "EXPORT_FORMAT",
    "HF_EXPORT_FORMAT",
    "check_export",
    "export_hf",
    "export_model",
    "global_model",
    "load_export",
    "load_init",
]

EXPORT_FORMAT = "ddq.export.v1"
HF_EXPORT_FORMAT = "ddq.export.hf.v1"
HF_METADATA = "ddq_metadata.json"


def global_model(
    bus: Bus, cfg: DDQConfig
) -> tuple[dict[str, npt.NDArray[np.float32]], dict[int, int], FragmentState]:
    """Every parameter of the newest global model, the version of each fragment, and fragment
    0's state (digests).

    Raises:
        NotReady: The run has no state yet (no synchronizer created it).
        ProtocolError, BlobMissing: A published version does not verify (with a keyring:
            is not signed by the synchronizer, ``Unauthenticated``).
    """
    limits, run_id = cfg.wire.message_limits(), cfg.run.run_id
    auth = Auth.load(cfg.auth, run_id, None)  # only the synchronizer's versions are exported
    tensors: dict[str, npt.NDArray[np.float32]] = {}
    versions: dict[int, int] = {}
    first: FragmentState | None = None
    for p in range(cfg.synchronizer.n_fragments):
        raw = bus.get(bus.keys.state(p))
        entry = ops.latest_global(bus, p)
        if raw is None or entry is None:
            raise NotReady(
                f"run {run_id!r} has no fragment {p} yet; start a synchronizer to create it"
            )
        state = FragmentState.from_bytes(raw, run_id=run_id, limits=limits)
        msg, theta = ops.read_global(bus, entry, run_id=run_id, limits=limits, auth=auth)
        fragment = fragment_of(state)
        if theta.size != fragment.size:
            raise CorruptPayload(f"fragment {p}: {theta.size} elements, state says {fragment.size}")
        for name, view in unflatten_fragment(fragment, theta).items():
            tensors[name] = np.array(view, dtype=np.float32, copy=True)
        versions[p] = msg.version
        first = first or state
    if first is None:
        raise ConfigError("synchronizer.n_fragments must be >= 1")
    return tensors, versions, first


def export_model(bus: Bus, cfg: DDQConfig, out: str | Path) -> dict[str, str]:
    """Write the newest global model to ``out`` (safetensors); returns the metadata written."""
    from safetensors.numpy import save_file

    check_export(cfg, out, "ddq")
    tensors, versions, state = global_model(bus, cfg)
    metadata = {
        "format": EXPORT_FORMAT,
        "run_id": cfg.run.run_id,
        "config_digest": state.config_digest,
        "plan_digest": state.plan_digest,
        "n_fragments": str(state.n_fragments),
        "versions": json.dumps({str(p): v for p, v in versions.items()}),
    }
    save_file(tensors, str(out), metadata=metadata)
    return metadata


def export_hf(bus: Bus, cfg: DDQConfig, out: str | Path) -> dict[str, Any]:
    """Write the newest global model as a Hugging Face directory (config.json,
    model.safetensors, generation_config.json; with a prepared dataset, its tokenizer too) that
    ``AutoModelForCausalLM.from_pretrained`` loads, plus ``ddq_metadata.json`` (run, digests,
    versions). Written beside ``out`` and renamed into place: a failure leaves no half
    directory. Returns the metadata.

    Raises:
        ConfigError: The model is not an hf one, or ``out`` is a non-empty directory that is
            not an earlier hf export.
    """
    from dd_queue.models.hf import save_hf

    check_export(cfg, out, "hf")
    arch, target = cfg.model.architecture(), Path(out)
    tensors, versions, state = global_model(bus, cfg)
    metadata: dict[str, Any] = {
        "format": HF_EXPORT_FORMAT,
        "run_id": cfg.run.run_id,
        "config_digest": state.config_digest,
        "plan_digest": state.plan_digest,
        "architecture": arch.digest,
        "versions": {str(p): v for p, v in versions.items()},
        "rounds_merged": state.counters.get("rounds_merged", 0),
        "tokens_merged": tokens_merged(state.counters),
    }
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent or "."))
    try:
        files = save_hf(arch, tensors, staging)
        files += _save_tokenizer(cfg, staging)
        (staging / HF_METADATA).write_text(json.dumps(metadata, indent=2) + "\n")
        metadata["files"] = sorted([*files, HF_METADATA])
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return metadata


def check_export(cfg: DDQConfig, out: str | Path, fmt: str) -> None:
    """Refuse an export that cannot be written, before anything is read or trained.

    Raises:
        ConfigError: ``hf`` for a model that is not an hf one, a target that is a non-empty
            directory other than an earlier hf export (hf) or a directory (ddq), or a parent
            directory that does not exist.
    """
    target = Path(out)
    if not target.parent.is_dir():
        raise ConfigError(f"cannot export to {target}: {target.parent} is not a directory")
    if fmt == "ddq":
        if target.is_dir():
            raise ConfigError(f"{target} is a directory: the ddq format is one file")
        return
    arch = cfg.model.architecture()
    if arch.source != "hf":
        raise ConfigError(
            f"--format hf needs model.source 'hf'; this run trains {arch.describe()}, which "
            "transformers cannot load: export it with the default format (safetensors)"
        )
    if target.exists() and (not target.is_dir() or _foreign(target)):
        raise ConfigError(
            f"{target} exists and is not an earlier hf export: choose a new --out directory"
        )


def _foreign(directory: Path) -> bool:
    """``directory`` holds files and is not an hf export of ours (which may be replaced)."""
    return any(directory.iterdir()) and not (directory / HF_METADATA).is_file()


def _save_tokenizer(cfg: DDQConfig, out: Path) -> list[str]:
    """The prepared dataset's tokenizer, as ``AutoTokenizer.from_pretrained`` reads it."""
    if cfg.data.source != "prepared" or not cfg.data.path:
        return []
    from transformers import PreTrainedTokenizerFast

    from dd_queue.data import read_manifest

    manifest = read_manifest(cfg.data.path)
    tokenizer_file = str(manifest.root / manifest.tokenizer_file)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)  # type: ignore[no-untyped-call]
    eos = tokenizer.convert_ids_to_tokens(manifest.eos_id)
    tokenizer.eos_token = eos
    return [Path(f).name for f in tokenizer.save_pretrained(str(out))]


def load_init(path: str | Path, cfg: DDQConfig) -> ArraySource:
    """The initial global model Θ(0) of a new run, from ``path``: a ``ddq export`` file, a
    Hugging Face model directory (``save_pretrained``'s ``model.safetensors``, or its shards),
    or a plain safetensors file. Tensors are matched to the config's model by name, as
    training names them or as transformers does (without the ``hf.`` prefix); values are
    converted to float32 (bf16 and fp16 checkpoints included), nothing else is changed.

    Raises:
        ConfigError: Unreadable files, a parameter the files lack, a tensor the model does
            not have (other than a tied copy of one it has), or a shape that differs.
    """
    from dd_queue.synchronizer.source import ConfigModelSource

    file, model = Path(path), ConfigModelSource(cfg.model, cfg.run.seed)
    if file.is_file() and _is_ddq_export(file):
        exported = load_export(file)[0]
        return dataclasses.replace(exported, embeddings=model.embedding_names())
    files = _safetensors_files(file)
    shapes = model.shapes()
    loaded = _read_float32(files)
    values: dict[str, npt.NDArray[np.float32]] = {}
    unknown: list[str] = []
    for name, array in loaded.items():
        ours = name if name in shapes else f"hf.{name}"
        if ours not in shapes:
            unknown.append(name)
        elif tuple(array.shape) != shapes[ours]:
            raise ConfigError(
                f"{path}: {name} has shape {tuple(array.shape)}, the model's {ours} "
                f"{shapes[ours]}: is this checkpoint of the configured architecture?"
            )
        else:
            values[ours] = array
    tied = {n for n in unknown if any(np.array_equal(loaded[n], v) for v in values.values())}
    if missing := sorted(set(shapes) - set(values)):
        raise ConfigError(f"{path} lacks {len(missing)} of the model's parameters: {missing[:4]}")
    if extra := sorted(set(unknown) - tied):
        raise ConfigError(f"{path} holds tensors the model does not have: {extra[:4]}")
    origin = f"{file.name} ({len(values)} tensors)"
    return ArraySource(values, origin=origin, embeddings=model.embedding_names())


def _is_ddq_export(file: Path) -> bool:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="np") as f:
            return (f.metadata() or {}).get("format") == EXPORT_FORMAT
    except (OSError, ValueError, SafetensorError):
        return False


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.glob("model*.safetensors"))
        if files:
            return files
        raise ConfigError(
            f"{path} has no model.safetensors (or model-*-of-*.safetensors shards): save it "
            "with save_pretrained(..., safe_serialization=True)"
        )
    raise ConfigError(f"--init-from {path}: no such file or directory")


def _read_float32(files: Sequence[Path]) -> dict[str, npt.NDArray[np.float32]]:
    import torch  # bf16 has no numpy dtype: read through torch, then float32
    from safetensors import SafetensorError, safe_open

    out: dict[str, npt.NDArray[np.float32]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    out[name] = f.get_tensor(name).to(torch.float32).numpy()
        except (OSError, ValueError, SafetensorError) as exc:
            raise ConfigError(f"cannot read {file}: {exc}") from exc
    return out


def load_export(path: str | Path) -> tuple[ArraySource, dict[str, str]]:
    """The parameters of an exported file (to seed a new run) and its metadata.

    Raises:
        ConfigError: The file is missing or not a dd_queue export.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            metadata = dict(f.metadata() or {})
            values = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except (OSError, ValueError, SafetensorError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}; pass a file written by ddq export") from exc
    if metadata.get("format") != EXPORT_FORMAT:
        raise ConfigError(
            f"{path} is not a {EXPORT_FORMAT} file (format {metadata.get('format')!r})"
        )
    origin = (
        f"{Path(path).name} (run {metadata.get('run_id')}, versions {metadata.get('versions')})"
    )
    return ArraySource(values, origin=origin), metadata
