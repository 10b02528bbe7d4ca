"""Append-only prediction files that survive being killed at any point.

One JSON line per (sample, cell): written and fsync'ed as soon as the sample's grid is done.
Each line carries `key` = hash(run configuration of that cell, dataset, sample id), so a rerun
skips what is done, a changed configuration never mixes with old lines, and a line cut short
by a kill is dropped (and cut off the file) before anything new is appended.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from collections.abc import Iterable, Iterator
from typing import Any

PREDICTIONS_FILE = "predictions.jsonl"


def config_hash(config: dict[str, Any]) -> str:
    """Short, stable hash of a JSON-able configuration."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def prediction_key(cell_config_hash: str, dataset: str, sample_id: str) -> str:
    """The identity of one prediction line."""
    return hashlib.sha256(f"{cell_config_hash}|{dataset}|{sample_id}".encode()).hexdigest()[:24]


def _complete_lines(data: bytes) -> Iterator[tuple[bytes, dict]]:
    """(raw line, parsed row) for each leading line that is whole and parses.

    Splits on b"\n" only: json.dumps escapes newlines inside strings, while str.splitlines
    would also split on characters such as U+2028 that ensure_ascii=False leaves in place.
    """
    *lines, _tail = data.split(b"\n")  # _tail: b"" after a final newline, else a torn line
    for line in lines:
        try:
            yield line + b"\n", json.loads(line)
        except json.JSONDecodeError:
            return


def read_predictions(path: str | os.PathLike) -> list[dict]:
    """Every complete line of a prediction file (a torn last line is ignored)."""
    path = pathlib.Path(path)
    if not path.is_file():
        return []
    return [row for _, row in _complete_lines(path.read_bytes())]


class PredictionStore:
    """The prediction file of one output folder: done keys, and durable appends."""

    def __init__(self, out_dir: str | os.PathLike):
        self.path = pathlib.Path(out_dir) / PREDICTIONS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repair()
        self.rows = read_predictions(self.path)
        self.done = {row["key"] for row in self.rows}

    def _repair(self) -> None:
        """Cuts a torn last line (a run killed mid-write) so appends start on a fresh line."""
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        good = sum(len(raw) for raw, _ in _complete_lines(data))
        if good != len(data):
            with self.path.open("r+b") as f:
                f.truncate(good)

    def append(self, rows: Iterable[dict]) -> None:
        """Writes rows not already present, then flushes and fsyncs the file."""
        seen = set(self.done)
        new = []
        for r in rows:  # also drops a key repeated within `rows`
            if r["key"] not in seen:
                seen.add(r["key"])
                new.append(r)
        if not new:
            return
        with self.path.open("a", encoding="utf-8") as f:
            for row in new:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rows.extend(new)
        self.done.update(r["key"] for r in new)

    def __iter__(self) -> Iterator[dict]:
        return iter(self.rows)
