"""Reading tracking output back: TensorBoard scalars and hparams, W&B offline runs.

W&B 0.31 has no Python reader of its offline run files any more (the writer is the Go
``wandb-core``), so ``wandb_records`` reads the file's framing itself: a 7-byte header
(``:W&B``, a magic, a version) then LevelDB's log format (32 KiB blocks; each record a CRC,
a length, a type FULL/FIRST/MIDDLE/LAST, the bytes), each payload a ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def tb_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag → [(step, value)] of every scalar in a TensorBoard run directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tb_hparams(run_dir: Path) -> dict[str, Any]:
    """The hyperparameters recorded on a TensorBoard run (name → value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    out: dict[str, Any] = {}
    for name, value in info.hparams.items():
        kind = value.WhichOneof("kind")
        out[name] = getattr(value, kind)
    return out


def _payloads(data: bytes) -> Iterator[bytes]:
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, pending = _HEADER, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a record header: padding
            pos += _BLOCK - pos % _BLOCK
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
        elif kind == 0 and length == 0:  # zero padding
            continue


def wandb_run(run_file: Path) -> dict[str, Any]:
    """A W&B offline run file read back: ``run`` (group, name, job type), ``config`` (key →
    value) and ``history`` (one dict per logged row)."""
    from wandb.proto import wandb_internal_pb2

    run: dict[str, str] = {}
    config: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    for payload in _payloads(run_file.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run = {"group": r.run_group, "name": r.display_name, "job_type": r.job_type}
            config.update({u.key: json.loads(u.value_json) for u in r.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history.append(row)
    return {"run": run, "config": config, "history": history}


def wandb_run_files(where: Path) -> list[Path]:
    """Every offline W&B run file under ``where``."""
    return sorted(where.rglob("offline-run-*/run-*.wandb"))
