"""Snapshots of the global model on disk, and what a synchronizer restores from them when Redis
has lost the run (``synchronizer.snapshot_dir``).

Every ``snapshot_every_versions`` versions of a fragment it owns, the synchronizer writes that
fragment's snapshot next to its others:

    <snapshot_dir>/<run_id>/f<k>/v<version>.safetensors   Θ_p and the outer momentum (fp32)
    <snapshot_dir>/<run_id>/f<k>/v<version>.json          what the tensors belong to

The JSON (format ``ddq.snapshot.v1``) holds the version, the outer step count, the last merged
round, the plan digest, the config digest and the SHA-256 of the safetensors file. Both files are
written to a temporary name, fsynced and renamed, the tensors first, so a JSON on disk always
names whole tensors; a crash leaves at most a ``.tmp`` file, which nothing reads. The last
``snapshot_keep`` snapshots of each fragment are kept.

Restoring (``Synchronizer`` taking a fragment whose state Redis no longer has): the newest
snapshot whose checksum, plan and config match. The restored version is
``max(snapshot version + snapshot_every_versions, the highest version a learner reports) + 1``:
above every version committed since the snapshot (at most ``snapshot_every_versions``, or the
next snapshot would exist), so the versions learners see never go backwards, and they take the
restored Θ_p as the next version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save

from dd_queue.errors import ConfigError

__all__ = ["FORMAT", "Snapshot", "latest", "list_snapshots", "restored_version", "verify", "write"]

log = logging.getLogger("dd_queue.synchronizer")

FORMAT = "ddq.snapshot.v1"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one snapshot's JSON says (its tensors live in ``tensors_path``)."""

    format: str
    run_id: str
    fragment_id: int
    version: int
    outer_steps: int
    last_merged_round_id: int | None
    plan_digest: str
    config_digest: str
    sha256: str
    size: int
    created_at_s: float
    path: str

    @property
    def tensors_path(self) -> Path:
        return Path(self.path).with_suffix(".safetensors")

    def load(self) -> tuple[np.ndarray, np.ndarray]:
        """``(theta, momentum)``, checked against the checksum.

        Raises:
            ConfigError: The tensors file is missing, altered or of another size.
        """
        problem = _check(self)
        if problem is not None:
            raise ConfigError(f"snapshot {self.path}: {problem}")
        tensors = load_file(str(self.tensors_path))
        return tensors["theta"], tensors["momentum"]


def _fragment_dir(root: Path, run_id: str, fragment_id: int) -> Path:
    return root / run_id / f"f{fragment_id}"


def _atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(path)


def write(
    root: Path,
    *,
    run_id: str,
    fragment_id: int,
    version: int,
    theta: np.ndarray,
    momentum: np.ndarray,
    outer_steps: int,
    last_merged_round_id: int | None,
    plan_digest: str,
    config_digest: str,
    keep: int,
) -> Snapshot:
    """Write one snapshot (tensors, then JSON, each atomically) and drop the oldest beyond
    ``keep``. Returns what was written."""
    where = _fragment_dir(root, run_id, fragment_id)
    where.mkdir(parents=True, exist_ok=True)
    stem = where / f"v{version}"
    tensors = stem.with_suffix(".safetensors")
    arrays = {"theta": np.ascontiguousarray(theta), "momentum": np.ascontiguousarray(momentum)}
    _atomic(tensors, save(arrays))
    snap = Snapshot(
        format=FORMAT,
        run_id=run_id,
        fragment_id=fragment_id,
        version=version,
        outer_steps=outer_steps,
        last_merged_round_id=last_merged_round_id,
        plan_digest=plan_digest,
        config_digest=config_digest,
        sha256=_sha256(tensors),
        size=int(theta.size),
        created_at_s=time.time(),
        path=str(stem.with_suffix(".json")),
    )
    _atomic(Path(snap.path), json.dumps(asdict(snap), indent=1).encode())
    _fsync_dir(where)
    for old in fragment_snapshots(root, run_id, fragment_id)[:-keep]:
        for path in (Path(old.path), old.tensors_path):
            path.unlink(missing_ok=True)
    return snap


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read(path: Path) -> Snapshot | None:
    try:
        raw = json.loads(path.read_text())
        raw["path"] = str(path)
        snap = Snapshot(**raw)
    except (OSError, ValueError, TypeError) as exc:
        log.warning("snapshot.unreadable %s: %s", path, exc)
        return None
    return snap if snap.format == FORMAT else None


def fragment_snapshots(root: Path, run_id: str, fragment_id: int) -> list[Snapshot]:
    """A fragment's snapshots, oldest first (unreadable JSON files left out)."""
    where = _fragment_dir(root, run_id, fragment_id)
    found = [s for p in where.glob("v*.json") if (s := _read(p)) is not None]
    return sorted(found, key=lambda s: s.version)


def list_snapshots(root: Path) -> list[Snapshot]:
    """Every snapshot under ``root``, by run, fragment and version."""
    found = [s for p in root.glob("*/f*/v*.json") if (s := _read(p)) is not None]
    return sorted(found, key=lambda s: (s.run_id, s.fragment_id, s.version))


def _check(snap: Snapshot) -> str | None:
    """Why the snapshot's tensors cannot be used, or None."""
    if not snap.tensors_path.is_file():
        return f"{snap.tensors_path.name} is missing"
    if _sha256(snap.tensors_path) != snap.sha256:
        return f"{snap.tensors_path.name} does not match its SHA-256 (altered or torn)"
    return None


def verify(root: Path) -> list[tuple[Snapshot, str | None]]:
    """Every snapshot with the reason it is unusable (None: its checksum holds)."""
    return [(s, _check(s)) for s in list_snapshots(root)]


def latest(
    root: Path, *, run_id: str, fragment_id: int, plan_digest: str, config_digest: str
) -> tuple[Snapshot | None, str]:
    """The newest usable snapshot of a fragment and why it was chosen (or why none was)."""
    skipped: list[str] = []
    for snap in reversed(fragment_snapshots(root, run_id, fragment_id)):
        if snap.plan_digest != plan_digest:
            skipped.append(f"v{snap.version}: another fragment plan")
        elif snap.config_digest != config_digest:
            skipped.append(f"v{snap.version}: another config digest")
        elif (problem := _check(snap)) is not None:
            skipped.append(f"v{snap.version}: {problem}")
        else:
            why = f"newest usable snapshot v{snap.version} of fragment {fragment_id}"
            return snap, why + (f" (skipped {'; '.join(skipped)})" if skipped else "")
    where = _fragment_dir(root, run_id, fragment_id)
    return None, f"no usable snapshot in {where}" + (f" ({'; '.join(skipped)})" if skipped else "")


def restored_version(snapshot_version: int, every: int, learner_versions: list[int]) -> int:
    """The version a restored fragment takes: above anything committed since the snapshot
    (at most ``every`` versions) and above every version a learner holds."""
    return max(snapshot_version + every, *learner_versions, snapshot_version) + 1
