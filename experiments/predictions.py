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

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import pathlib
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

PREDICTIONS_FILE = "predictions.jsonl"
QUARANTINE_FILE = "predictions.quarantine.jsonl"
_PROCESS_FILE = re.compile(r"predictions\.p(\d+)\.jsonl")
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


def process_file(index: int | None) -> str:
    """The prediction file a process writes: predictions.jsonl (None: the only writer), or
    predictions.p<index>.jsonl for process `index` of a data-parallel run."""
    return PREDICTIONS_FILE if index is None else f"predictions.p{index}.jsonl"


def prediction_files(out_dir: str | os.PathLike) -> list[pathlib.Path]:
    """Every prediction file of a folder: predictions.jsonl, then the processes' by index."""
    out_dir = pathlib.Path(out_dir)
    found = sorted((int(m.group(1)), p) for p in out_dir.glob("predictions.p*.jsonl")
                   if (m := _PROCESS_FILE.fullmatch(p.name)))
    main = out_dir / PREDICTIONS_FILE
    return [main] * main.is_file() + [p for _, p in found]


def read_folder(out_dir: str | os.PathLike, warn: Callable[[str], None] | None = None
                ) -> list[dict]:
    """The usable lines of every prediction file of a folder as one set (a key's first line
    wins: a key is written once, so a repeat is a copy), in file order."""
    return first_by_key(read_predictions(path, warn) for path in prediction_files(out_dir))


def first_by_key(files: Iterable[Iterable[dict]]) -> list[dict]:
    """The rows of several files in order, each key's first row only."""
    seen: set[str] = set()
    out = []
    for rows in files:
        for row in rows:
            if row["key"] not in seen:
                seen.add(row["key"])
                out.append(row)
    return out


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


def quarantine_of(path: pathlib.Path) -> pathlib.Path:
    """Where a prediction file's unusable lines go: predictions.quarantine.jsonl beside
    predictions.jsonl, predictions.p1.quarantine.jsonl beside predictions.p1.jsonl."""
    return path.with_name(path.name.removesuffix(".jsonl") + ".quarantine.jsonl")


def _warn_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


class PredictionStore:
    """The prediction files of one output folder: done keys (of every file), and durable
    appends to this writer's own file.

    process: None for the folder's only writer (predictions.jsonl), else this process's
    index in a data-parallel run (predictions.p<index>.jsonl). `tidy` also quarantines the
    bad lines of files no process of this run writes (those of a run with more processes),
    which the first process does; a file another process of this run owns is only read.
    writes=False: a reader only (the other processes of a model sharded across processes,
    which compute what the first one writes)."""

    def __init__(self, out_dir: str | os.PathLike,
                 warn: Callable[[str], None] = _warn_stderr, process: int | None = None,
                 processes: int = 1, tidy: bool = True, writes: bool = True):
        out_dir = pathlib.Path(out_dir)
        self.path = out_dir / process_file(process)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._warn = warn
        owned = {out_dir / process_file(i) for i in range(processes)} if process is not None \
            else {self.path}
        files = []
        for path in prediction_files(out_dir):
            ours = writes and (path == self.path or tidy and path not in owned)
            good, bad = parse_lines(path.read_bytes())
            if bad and ours:
                self._quarantine(path, good, bad)
            elif bad:
                for b in bad:
                    self._warn(f"{path} line {b.number} is not used: {b.reason} (its own "
                               "process moves it to quarantine)")
            files.append([row for _, row in good])
        self.rows: list[dict] = first_by_key(files)
        self.done = {row["key"] for row in self.rows}

    def _quarantine(self, path: pathlib.Path, good: list[tuple[bytes, dict]],
                    bad: list[BadLine]) -> None:
        """Appends `bad` to `path`'s quarantine file, then atomically rewrites `path` as
        `good`.

        Killed between the two steps, a line is in both files, never in neither.
        """
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        records = b"".join(
            json.dumps({"line": b.number, "reason": b.reason, "quarantined_at": now,
                        # surrogateescape keeps bytes that are not UTF-8, so it loses nothing
                        "raw": b.raw.decode("utf-8", "surrogateescape")}).encode() + b"\n"
            for b in bad)
        quarantine = quarantine_of(path)
        fd = os.open(quarantine, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            _write_all(fd, records)
            os.fsync(fd)
        finally:
            os.close(fd)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as f:
            f.write(b"".join(raw for raw, _ in good))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        for b in bad:
            self._warn(f"{path} line {b.number} is unusable ({b.reason}); moved to "
                       f"{quarantine.name}, every other line kept; what it held is "
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


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Holds Ctrl-C back while in the block: it is acted on (KeyboardInterrupt) right after.

    A Python-level handler, not a signal mask: XLA's threads would take a masked SIGINT and
    the interpreter would still raise it in the main thread, inside the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list = []
    previous = signal.signal(signal.SIGINT, lambda *args: caught.append(args))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(*caught[0])
