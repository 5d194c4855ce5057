"""Export the current global model to safetensors, and read such a file back to re-seed a run.

    ddq export --config config/demo.yaml --out model.safetensors

The file holds every parameter tensor (float32, the names the model's ``named_parameters()``
gives) and string metadata: ``format`` (``ddq.export.v1``), ``run_id``, ``config_digest``,
``plan_digest``, ``n_fragments`` and ``versions`` (JSON: fragment → the global version exported).
Each fragment's newest published version is read with ``ops.read_global`` (checksum verified,
bit-exact), laid out by the fragment's committed state. ``ddq synchronizer --init-from FILE``
creates a new run from it (same model shapes required: the plan digest is checked as usual).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import numpy.typing as npt

from dd_queue.auth import Auth
from dd_queue.bus import Bus, ops
from dd_queue.config import DDQConfig
from dd_queue.core.fragments import unflatten_fragment
from dd_queue.errors import ConfigError, CorruptPayload, NotReady
from dd_queue.fragment_state import FragmentState, fragment_of
from dd_queue.synchronizer.source import ArraySource

__all__ = ["EXPORT_FORMAT", "export_model", "global_model", "load_export"]

EXPORT_FORMAT = "ddq.export.v1"


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
