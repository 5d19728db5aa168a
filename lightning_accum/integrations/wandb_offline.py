"""A reader for offline W&B runs: the ``.wandb`` transaction log read back from disk, without W&B's services.

wandb 0.31 ships no Python reader of its own (``wandb leet inspect --json`` is a command), so this one stays.
`read_offline_run` parses records with ``wandb.proto`` (the ``wandb`` extra); the file-format code
(`iter_records`, `find_run_file`) needs nothing beyond the standard library.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEP_METRIC = "trainer/global_step"
"""The x-axis: the key Lightning's ``WandbLogger.log_metrics`` adds to every row
(``lightning/pytorch/loggers/wandb.py``), and the step metric it defines for ``"*"``. The integration's metric
definitions use the same one (`lightning_accum.integrations.wandb` re-exports it)."""

# The `.wandb` file is a LevelDB-style log: a 7-byte file header (b":W&B", magic 0xBEE1, version 0), then 32 KiB
# blocks of records, each with a 7-byte header (checksum: uint32, length: uint16, type: uint8, little-endian).
# The checksum is zlib's CRC-32 of the type byte followed by the payload (checked against wandb 0.31 files: not the
# masked CRC-32C of LevelDB proper). A record that does not fit in a block is split into FIRST/MIDDLE.../LAST
# fragments; a block tail shorter than a header is zero padding.
_FILE_HEADER = struct.Struct("<4sHB")
_FILE_IDENT, _FILE_MAGIC, _FILE_VERSION = b":W&B", 0xBEE1, 0
_RECORD_HEADER = struct.Struct("<IHB")
_BLOCK_SIZE = 32 * 1024
_ZERO, _FULL, _FIRST, _MIDDLE, _LAST = 0, 1, 2, 3, 4


@dataclass
class OfflineRun:
    """A W&B run read back from its ``.wandb`` file.

    Iterating over it, ``len`` and indexing go over `history`, so it can be used as the list of history rows.

    Attributes:
        path: the ``run-*.wandb`` file.
        run_id: the run's id.
        project: the run's project.
        history: one dict per ``log`` call, key -> value (``_step``, ``_runtime`` and ``_timestamp`` included).
        summary: the final run summary, nested as W&B stores it (a ``summary="max"`` key maps to ``{"max": v}``).
        config: the final run config.
        metrics: ``define_metric`` records by name (or glob): ``{"step_metric": ..., "summary": [...]}``.
        exit_code: the exit code recorded at ``finish``, or ``None`` when the run did not finish.
        truncated_at: the byte offset of a record that the end of the file cuts off (the writer was killed, or is
            still writing), or ``None`` when the file ends on a record boundary. Everything before it was read.
    """

    path: Path
    run_id: str = ""
    project: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    exit_code: int | None = None
    truncated_at: int | None = None

    @property
    def complete(self) -> bool:
        """Whether the file holds the whole run: its exit record, and no record cut off by the end of the file."""
        return self.exit_code is not None and self.truncated_at is None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.history)

    def __len__(self) -> int:
        return len(self.history)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.history[index]

    def column(self, key: str) -> list[tuple[Any, Any]]:
        """``(step, value)`` for every history row that holds ``key``, the step being `STEP_METRIC`."""
        return [(row.get(STEP_METRIC), row[key]) for row in self.history if key in row]


def find_run_file(path: str | Path) -> Path:
    """The ``run-*.wandb`` file of a run at ``path``.

    ``path`` is the file itself, a run directory, or a ``wandb/`` directory (or one that holds ``wandb/``), in which
    case the latest run is taken.

    Raises:
        FileNotFoundError: nothing that looks like a W&B run is there.
    """
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"No W&B run at {str(path)!r}: no such file or directory.")
    files = sorted(path.glob("run-*.wandb"))
    if files:
        return files[-1]
    for wandb_dir in (path, path / "wandb"):
        # Run directories are named `offline-run-YYYYMMDD_HHMMSS-ID` (or `run-...` when online): the name sorts by time.
        runs = sorted(d for d in wandb_dir.glob("*run-*") if d.is_dir() and any(d.glob("run-*.wandb")))
        if runs:
            return sorted(runs[-1].glob("run-*.wandb"))[-1]
    raise FileNotFoundError(
        f"No W&B run under {str(path)!r}: expected a `run-*.wandb` file, a run directory that holds one, or a"
        " `wandb/` directory with `offline-run-*` directories."
    )


def iter_records(path: str | Path) -> Iterator[bytes]:
    """The raw protobuf payloads of the records in a ``.wandb`` file, in order.

    A truncated tail (a run still writing, or killed) ends the iteration quietly, like LevelDB's reader;
    `read_offline_run` says where (`OfflineRun.truncated_at`).

    Raises:
        ValueError: the file is not a W&B transaction log, is cut off inside its header, or a record is corrupt
            (bad checksum or framing).
    """
    yield from _read_records(Path(path))[0]


def _read_records(path: Path) -> tuple[list[bytes], int | None]:
    """The payloads of the complete records, and the offset of a record cut off by the end of the file (or None)."""
    data = path.read_bytes()
    header = _FILE_HEADER.pack(_FILE_IDENT, _FILE_MAGIC, _FILE_VERSION)
    if len(data) < _FILE_HEADER.size and header.startswith(data):
        raise ValueError(
            f"{str(path)!r} is truncated: {len(data)} bytes, shorter than the {_FILE_HEADER.size}-byte header of a W&B"
            " transaction log. The run was killed before it wrote anything, or has just started."
        )
    if data[: _FILE_HEADER.size] != header:
        raise ValueError(
            f"{str(path)!r} is not a W&B transaction log (version {_FILE_VERSION}): its header is"
            f" {data[: _FILE_HEADER.size]!r}. Pass a `run-*.wandb` file or the run directory that holds it."
        )
    records: list[bytes] = []
    offset = _FILE_HEADER.size
    pending: list[bytes] | None = None
    pending_at = 0
    while offset < len(data):
        block_left = _BLOCK_SIZE - offset % _BLOCK_SIZE
        if block_left < _RECORD_HEADER.size:
            offset += block_left  # zero padding at the end of a block
            continue
        if offset + _RECORD_HEADER.size > len(data):
            # Preallocated zeros end the log cleanly; anything else is a record header cut off.
            return records, (None if not data[offset:].strip(b"\0") else offset)
        checksum, length, kind = _RECORD_HEADER.unpack_from(data, offset)
        start = offset + _RECORD_HEADER.size
        end = start + length
        if kind == _ZERO and length == 0:
            offset += block_left  # preallocated space: the rest of the block is empty
            continue
        if end > len(data):
            return records, offset
        payload = data[start:end]
        if zlib.crc32(bytes([kind]) + payload) != checksum:
            raise ValueError(f"{str(path)!r}: corrupt record at byte {offset} (checksum mismatch).")
        if kind == _FULL:
            records.append(payload)
        elif kind == _FIRST:
            pending, pending_at = [payload], offset
        elif kind == _MIDDLE and pending is not None:
            pending.append(payload)
        elif kind == _LAST and pending is not None:
            pending.append(payload)
            records.append(b"".join(pending))
            pending = None
        else:
            raise ValueError(f"{str(path)!r}: unexpected record type {kind} at byte {offset}.")
        offset = end
    # A record whose FIRST fragment is here but not its LAST one was cut off too.
    return records, (None if pending is None else pending_at)


def read_offline_run(path: str | Path, *, wait_s: float = 0.0) -> OfflineRun:
    """Read a W&B run's history, summary and config from its ``.wandb`` file, without W&B's services.

    Read it after ``wandb.finish()``. Even then, wandb 0.31's writer may still be flushing the last records for a
    moment (seen under load): ``wait_s`` re-reads until the run's exit record is there, or that many seconds pass.

    Args:
        path: a ``run-*.wandb`` file, an ``offline-run-*`` directory, or a ``wandb/`` directory (its latest run).
        wait_s: how long to wait for the exit record of a run that was finished a moment ago.

    Raises:
        FileNotFoundError: see `find_run_file`.
        ValueError: see `iter_records`.
    """
    deadline = time.monotonic() + wait_s
    while True:
        run = _read_once(find_run_file(path))
        if run.exit_code is not None or time.monotonic() >= deadline:
            return run
        time.sleep(0.05)


def _read_once(run_file: Path) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2 as pb

    payloads, truncated_at = _read_records(run_file)
    run = OfflineRun(path=run_file, truncated_at=truncated_at)
    for payload in payloads:
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            run.history.append({_item_key(item): _item_value(item) for item in record.history.item})
        elif kind == "summary":
            _apply_updates(run.summary, record.summary.update, record.summary.remove)
        elif kind == "config":
            _apply_updates(run.config, record.config.update, record.config.remove)
        elif kind == "run":
            run.run_id = record.run.run_id or run.run_id
            run.project = record.run.project or run.project
            _apply_updates(run.config, record.run.config.update, record.run.config.remove)
        elif kind == "metric":
            name = record.metric.name or record.metric.glob_name
            summary = [f.name for f, on in record.metric.summary.ListFields() if on is True]
            run.metrics[name] = {"step_metric": record.metric.step_metric, "summary": summary}
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run


def _item_key(item: Any) -> str:
    return item.key or ".".join(item.nested_key)


def _item_value(item: Any) -> Any:
    # Newer writers may use the typed oneof instead of `value_json`.
    typed = item.WhichOneof("value") if item.DESCRIPTOR.oneofs_by_name.get("value") else None
    if typed == "none":
        return None
    if typed == "json":
        return json.loads(item.json)
    if typed is not None:
        return getattr(item, typed)
    return json.loads(item.value_json) if item.value_json else None


def _apply_updates(target: dict[str, Any], updates: Any, removes: Any) -> None:
    for item in updates:
        path = [item.key] if item.key else list(item.nested_key)
        node = target
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[path[-1]] = _item_value(item)
    for item in removes:
        path = [item.key] if item.key else list(item.nested_key)
        node = target
        for part in path[:-1]:
            node = node.get(part, {})
        if isinstance(node, dict):
            node.pop(path[-1], None)
