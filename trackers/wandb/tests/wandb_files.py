"""Reading a W&B offline run as `wandb sync` would upload it: its `.wandb` files, one per process that wrote to the
run, each a log of wandb's own protobuf `Record`s (`wandb.proto.wandb_internal_pb2`) in LevelDB's log format (blocks
of 32 KiB, each record a 7-byte header: CRC, length, kind; a record split over blocks in first / middle / last
pieces), after a 7-byte file header `:W&B`, 0xBEE1, version. wandb 0.31 ships no reader of its own."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

from wandb.proto.wandb_internal_pb2 import Record

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[Record]:
    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, f"{path} is not a W&B run file"
    position, pending, records = HEADER, b"", []
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if kind == 0:  # zeros: the end of what was written
            break
        chunk = data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            records.append(pending + chunk)
    return [Record.FromString(record) for record in records]


def _key(item: Any) -> str:
    return item.key or ".".join(item.nested_key)


def run_files(wandb_dir: Path, run_id: str, seconds: float = 60.0) -> list[Path]:
    """The run's `.wandb` files in the order they were written (offline-run-<time>-<id> folders), once each holds
    its exit record: wandb's service writes the file on its own and may still be writing when `run.finish()` has
    returned (up to `seconds`)."""
    files = sorted(wandb_dir.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    deadline = time.monotonic() + seconds
    while not all(_has_exit(path) for path in files) and time.monotonic() < deadline:
        time.sleep(0.1)
    return files


def _has_exit(path: Path) -> bool:
    try:
        return any(record.WhichOneof("record_type") == "exit" for record in read_records(path))
    except Exception:  # noqa: BLE001 - a record still being written: not complete yet
        return False


def history(files: list[Path]) -> list[dict[str, Any]]:
    """Every history row of the files, in order, with wandb's own `_step`; internal keys (`_timestamp`, ...) left
    out."""
    rows = []
    for path in files:
        for record in read_records(path):
            if record.WhichOneof("record_type") == "history":
                row = {_key(item): json.loads(item.value_json) for item in record.history.item}
                rows.append({key: value for key, value in row.items() if key == "_step" or not key.startswith("_")})
    return rows


def run_info(path: Path) -> dict[str, Any]:
    """The run record (id, project, config) and the last summary and exit of one file."""
    info: dict[str, Any] = {"summary": {}}
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            info["run_id"], info["project"], info["notes"] = record.run.run_id, record.run.project, record.run.notes
            info["config"] = {_key(item): json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "config":
            info["config"].update({_key(item): json.loads(item.value_json) for item in record.config.update})
        elif kind == "summary":
            info["summary"].update({_key(item): json.loads(item.value_json) for item in record.summary.update})
        elif kind == "exit":
            info["exit_code"] = record.exit.exit_code
    return info
