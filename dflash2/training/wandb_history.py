"""The history a W&B run already holds on this machine, read from its local transaction logs.

Every segment of a run (the first process, and each one that resumed it) writes
``<save_dir>/wandb/[offline-]run-<time>-<id>/run-<id>.wandb``: the records sent to W&B, in
the leveldb log format of wandb's SDK (a 7-byte file header, 32 KiB blocks, records of a
7-byte header + protobuf ``Record`` that may span blocks). A resumed run reads them to learn
which (step, metric) pairs are already in the run (dflash2/training/resumable_loggers.py).
Offline runs exist only here; online runs keep this copy beside the server's.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

FILE_HEADER = struct.Struct("<4sHB")  # ident, magic, version
FILE_IDENT, FILE_MAGIC = b":W&B", 0xBEE1
RECORD_HEADER = struct.Struct("<IHB")  # crc32, length, type
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
# leveldb's checksum: CRC-32 of the type byte followed by the data.
TYPE_CRC = {t: zlib.crc32(bytes([t])) for t in (FULL, FIRST, MIDDLE, LAST)}
STEP_KEY = "trainer/global_step"  # Lightning's WandbLogger logs the trainer step under this name


def segment_files(wandb_dir: Path, run_id: str) -> list[Path]:
    """The transaction logs of run ``run_id`` under ``wandb_dir``, online and offline segments."""
    return sorted(Path(wandb_dir).glob(f"*run-*-{run_id}/run-{run_id}.wandb"))


def record_payloads(path: Path) -> Iterator[bytes]:
    """The serialized records of one transaction log, in order. A torn tail (the process was killed
    mid-write) or a checksum mismatch ends the log there, as wandb's own reader does."""
    data = Path(path).read_bytes()
    if len(data) < FILE_HEADER.size:
        return
    ident, magic, _version = FILE_HEADER.unpack_from(data)
    if ident != FILE_IDENT or magic != FILE_MAGIC:
        raise ValueError(f"{path} is not a W&B transaction log")
    pos, pending = FILE_HEADER.size, b""
    while pos + RECORD_HEADER.size <= len(data):
        room = BLOCK - pos % BLOCK
        if room < RECORD_HEADER.size:  # a block's tail too short for a header is zero padding
            pos += room
            continue
        crc, length, kind = RECORD_HEADER.unpack_from(data, pos)
        if length == 0 and kind == 0:  # zero padding up to the block's end
            pos += room
            continue
        chunk = data[pos + RECORD_HEADER.size : pos + RECORD_HEADER.size + length]
        if kind not in TYPE_CRC or len(chunk) < length or zlib.crc32(chunk, TYPE_CRC[kind]) != crc:
            return
        pos += RECORD_HEADER.size + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            yield pending
            pending = b""


def history_rows(wandb_dir: Path, run_id: str) -> Iterator[dict]:
    """Every history row (``run.log`` call) of run ``run_id`` kept on this machine, as {key: value}."""
    from wandb.proto import wandb_internal_pb2

    for path in segment_files(wandb_dir, run_id):
        for payload in record_payloads(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            if record.WhichOneof("record_type") == "history":
                yield {
                    (item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item
                }


def logged_step_metrics(wandb_dir: Path, run_id: str) -> set[tuple[int, str]]:
    """The (trainer step, metric name) pairs run ``run_id`` holds; W&B's own keys (``_step``, ...) left out."""
    pairs = set()
    for row in history_rows(wandb_dir, run_id):
        if STEP_KEY in row:
            step = int(row[STEP_KEY])
            pairs.update((step, key) for key in row if key != STEP_KEY and not key.startswith("_"))
    return pairs
