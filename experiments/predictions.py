"""Append-only prediction files that survive being killed at any point and never lose a line.

One JSON line per (sample, cell): written (one `write` per line, on an O_APPEND descriptor)
and fsync'ed as soon as the sample's grid is done. Each line carries `key` = hash(run
configuration of that cell, dataset, sample id), so a rerun skips what is done.

A line that does not parse, anywhere in the file (a torn last line from a kill, a line damaged
by hand or by a disk), is never silently dropped: opening the store moves it, with its line
number and the reason, to `predictions.quarantine.jsonl` (fsync'ed first), warns on stderr, and
rewrites the prediction file with every other line kept byte for byte (a temporary file, then an
atomic rename). The run then recomputes only the predictions that are missing.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import pathlib
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

PREDICTIONS_FILE = "predictions.jsonl"
QUARANTINE_FILE = "predictions.quarantine.jsonl"
# What every prediction line must hold for the runner and the report to use it.
REQUIRED_FIELDS = ("key", "config_hash", "dataset", "sample_id", "cell", "pred", "answers")


def config_hash(config: dict[str, Any]) -> str:
    """Short, stable hash of a JSON-able configuration."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def prediction_key(cell_config_hash: str, dataset: str, sample_id: str) -> str:
    """The identity of one prediction line."""
    return hashlib.sha256(f"{cell_config_hash}|{dataset}|{sample_id}".encode()).hexdigest()[:24]


@dataclasses.dataclass(frozen=True)
class BadLine:
    """A line of a prediction file that cannot be used: its 1-based number, bytes and why."""

    number: int
    raw: bytes
    reason: str


def _check_row(line: bytes) -> tuple[dict | None, str]:
    """(the parsed row, "") for a usable line, else (None, why it is not)."""
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, f"not JSON ({e.msg if hasattr(e, 'msg') else e})"
    if not isinstance(row, dict):
        return None, f"a JSON {type(row).__name__}, not an object"
    missing = [f for f in REQUIRED_FIELDS if f not in row]
    if missing:
        return None, f"lacks the field(s) {missing}"
    if not isinstance(row["key"], str):
        return None, "its 'key' is not a string"
    return row, ""


def parse_lines(data: bytes) -> tuple[list[tuple[bytes, dict]], list[BadLine]]:
    """((raw line with its newline, row) for every usable line, the unusable lines).

    Splits on b"\\n" only: json.dumps escapes newlines inside strings, while str.splitlines
    would also split on characters such as U+2028 that ensure_ascii=False leaves in place.
    A last line without its newline is torn (the process died mid-write) even if it parses.
    """
    *lines, tail = data.split(b"\n")  # tail: b"" after a final newline, else a torn line
    good, bad = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue  # an empty line carries nothing to keep
        row, reason = _check_row(line)
        if row is None:
            bad.append(BadLine(number, line, reason))
        else:
            good.append((line + b"\n", row))
    if tail:
        bad.append(BadLine(len(lines) + 1, tail, "torn: no newline at its end (a killed write)"))
    return good, bad


def read_predictions(path: str | os.PathLike, warn: Callable[[str], None] | None = None
                     ) -> list[dict]:
    """Every usable line of a prediction file; reading never changes the file.

    `warn` is called once per unusable line (the store moves those on its next opening).
    """
    path = pathlib.Path(path)
    if not path.is_file():
        return []
    good, bad = parse_lines(path.read_bytes())
    for b in bad:
        if warn is not None:
            warn(f"{path} line {b.number} is not used: {b.reason}")
    return [row for _, row in good]


def _fsync_dir(folder: pathlib.Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    """One line per call: loops only if the kernel wrote part of it."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _warn_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


class PredictionStore:
    """The prediction file of one output folder: done keys, and durable appends."""

    def __init__(self, out_dir: str | os.PathLike,
                 warn: Callable[[str], None] = _warn_stderr):
        self.path = pathlib.Path(out_dir) / PREDICTIONS_FILE
        self.quarantine_path = self.path.with_name(QUARANTINE_FILE)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._warn = warn
        self.rows: list[dict] = []
        if self.path.is_file():
            good, bad = parse_lines(self.path.read_bytes())
            if bad:
                self._quarantine(good, bad)
            self.rows = [row for _, row in good]
        self.done = {row["key"] for row in self.rows}

    def _quarantine(self, good: list[tuple[bytes, dict]], bad: list[BadLine]) -> None:
        """Appends `bad` to the quarantine file, then atomically rewrites the file as `good`.

        Killed between the two steps, a line is in both files, never in neither.
        """
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        records = b"".join(
            json.dumps({"line": b.number, "reason": b.reason, "quarantined_at": now,
                        # surrogateescape keeps bytes that are not UTF-8, so it loses nothing
                        "raw": b.raw.decode("utf-8", "surrogateescape")}).encode() + b"\n"
            for b in bad)
        fd = os.open(self.quarantine_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            _write_all(fd, records)
            os.fsync(fd)
        finally:
            os.close(fd)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("wb") as f:
            f.write(b"".join(raw for raw, _ in good))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        for b in bad:
            self._warn(f"{self.path} line {b.number} is unusable ({b.reason}); moved to "
                       f"{self.quarantine_path.name}, every other line kept; what it held is "
                       "recomputed if this run needs it")

    def append(self, rows: Iterable[dict]) -> None:
        """Writes rows not already present, one write per line, then fsyncs the file."""
        seen = set(self.done)
        new = []
        for r in rows:  # also drops a key repeated within `rows`
            if r["key"] not in seen:
                seen.add(r["key"])
                new.append(r)
        if not new:
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            for row in new:
                _write_all(fd, (json.dumps(row, ensure_ascii=False) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self.rows.extend(new)
        self.done.update(r["key"] for r in new)

    def __iter__(self) -> Iterator[dict]:
        return iter(self.rows)
