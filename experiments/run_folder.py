"""A run folder belongs to one configuration: its identity, its extent, and its history.

The *identity* of a run is everything besides the grid and the samples that changes a
prediction: model (and a fingerprint of its files), dtype, suite, rule options, timing
settings, lengths, batch size, protocol, library version. The *data* are the checksums of the
files (or generator inputs) each dataset's rows come from. The *extent* is what the run
covers: datasets, cells and samples per dataset.

`open_run` is the one gate: the same identity resumes; another identity is refused with the
keys that differ; a command asking for cells or samples the folder does not cover is refused
unless `extend`, which adds them (the report then shows n for every cell). `config.json` keeps
the identity, the data checksums, the extent and every command that wrote the folder.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import pathlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

from experiments.predictions import config_hash, prediction_files

CONFIG_FILE = "config.json"
LOCK_FILE = ".lock"  # flock'ed by the runner that writes the folder; holds its pid
FORMAT = 2  # config.json layout; folders of the first runner (no run_id) are refused
# The identity's key for the rules' options (--window, --kernel, ...) keeps the spelling every
# folder stores, from before the scoring rules were called rules: it is hashed into the run id
# and into each prediction line's key, so another spelling would make every earlier folder
# another configuration and recompute its predictions.
RULE_OPTIONS_KEY = "policy_options"
_HASHED_IN_FULL = (".json", ".jinja", ".txt", ".model")  # small files whose bytes matter


class RunFolderError(ValueError):
    """A folder that cannot take this run; the message says what differs and what to do."""


class RunFolderBusy(RuntimeError):
    """Another process holds the folder's lock; the message names its pid."""


def _holder_pid(path: pathlib.Path) -> str:
    """The pid the lock's holder wrote, or "unknown" (it may not have written it yet)."""
    for _ in range(20):
        try:
            pid = path.read_text().strip()
        except OSError:
            pid = ""
        if pid:
            return pid
        time.sleep(0.025)
    return "unknown"


@contextlib.contextmanager
def locked(out_dir: str | os.PathLike) -> Iterator[pathlib.Path]:
    """Holds an exclusive lock on run folder `out_dir` (created if absent) while in the block.

    `fcntl.flock` on OUT_DIR/.lock, which holds the holder's pid; the kernel drops the lock
    when the process dies, so a killed run leaves no stale lock (only the file, which the next
    runner reuses). Raises RunFolderBusy, naming the holder's pid, if another process holds
    it. The file is removed on release (while still locked: a runner that opened it meanwhile
    sees it is gone and opens the new one). Reading a folder (the report) takes no lock.
    """
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunFolderBusy(
                f"{out_dir} is in use by another runner (pid {_holder_pid(path)}); wait for "
                "it to end (or stop it), or use another --out_dir") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        held = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev,
                                                                         held.st_ino):
            break
        os.close(fd)  # released and removed by its last holder between open and flock
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes (a 100 MB LongBench file takes about 0.2 s)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def files_fingerprint(folder: str | os.PathLike) -> str:
    """Short hash of a checkpoint folder's files, by content (`file_fingerprint` of each).

    Configs, tokenizer and every file under 64 MiB are hashed in full; larger (weight) files
    by size, safetensors header and evenly spaced sampled blocks. A re-saved checkpoint with
    other values of the same shapes thus gets another fingerprint, unless its change is
    confined to bytes between the sampled blocks of a file over 64 MiB (see
    `file_fingerprint`). A folder of small text files (the synthetic haystack) keeps the
    fingerprint the earlier, size-based version gave it.
    """
    folder = pathlib.Path(folder)
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if path.suffix in _HASHED_IN_FULL:
            digest.update(f"{rel}:{sha256_file(path)}\n".encode())
        else:
            digest.update(f"{rel}:content:{file_fingerprint(path)}\n".encode())
    return digest.hexdigest()[:16]


# Files up to FULL_HASH_LIMIT bytes are hashed whole; larger ones by SAMPLED_BLOCKS blocks.
FULL_HASH_LIMIT = 64 << 20
SAMPLE_BLOCK = 64 << 10
SAMPLED_BLOCKS = 128
_SAFETENSORS_MAX_HEADER = 100 << 20  # safetensors' own limit on its JSON header


def file_fingerprint(path: str | os.PathLike) -> str:
    """Hex sha256 of one file's content: all of it up to 64 MiB, else a sample.

    A file over `FULL_HASH_LIMIT` (64 MiB) is hashed by its size, its safetensors header (the
    JSON of tensor names, dtypes, shapes and offsets, for `.safetensors` files) and
    `SAMPLED_BLOCKS` (128) blocks of 64 KiB evenly spaced from its first to its last byte
    (8 MiB of a multi-GB file: milliseconds instead of the seconds to minutes a full read
    takes). Limit: a change confined to bytes between sampled blocks goes unseen; on a
    513 MiB file the blocks are 4 MiB apart, so one re-saved tensor of the same shape under
    4 MiB may be missed (a fine-tune or another checkpoint changes nearly every block).
    """
    path = pathlib.Path(path)
    size = path.stat().st_size
    if size <= FULL_HASH_LIMIT:
        return sha256_file(path)
    digest = hashlib.sha256(f"size:{size}\n".encode())
    with open(path, "rb") as f:
        if path.suffix == ".safetensors":
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            digest.update(b"header:" + head + f.read(min(n, _SAFETENSORS_MAX_HEADER, size)))
        last = size - SAMPLE_BLOCK
        for i in range(SAMPLED_BLOCKS):
            f.seek(last * i // (SAMPLED_BLOCKS - 1))
            digest.update(f.read(SAMPLE_BLOCK))
    return digest.hexdigest()


def run_id(identity: dict[str, Any]) -> str:
    """The identity's short hash: the default folder's name and a field of every line."""
    return config_hash(identity)


def default_out_dir(suite: str, model: str, identity: dict[str, Any]) -> pathlib.Path:
    """runs/<suite>/<model name>-<run id>: one folder per configuration, never shared."""
    name = pathlib.Path(str(model).rstrip("/")).name or "model"
    return pathlib.Path("runs") / suite / f"{name}-{run_id(identity)[:8]}"


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every (dotted) key whose value differs."""
    a, b = _flatten(old), _flatten(new)
    missing = object()
    return [f"{key}: {a.get(key, missing)!r} -> {b.get(key, missing)!r}".replace(
        repr(missing), "(absent)") for key in sorted(set(a) | set(b))
        if a.get(key, missing) != b.get(key, missing)]


def _covers(have: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """What `want` (an extent) asks for beyond `have`, as short phrases; [] if covered."""
    extra = []
    cells = [c for c in want["cells"] if c not in have["cells"]]
    if cells:
        extra.append(f"cells {cells}")
    datasets = [d for d in want["datasets"] if d not in have["datasets"]]
    if datasets:
        extra.append(f"datasets {datasets}")
    n_have, n_want = have["num_samples"], want["num_samples"]
    if n_have is not None and (n_want is None or n_want > n_have):
        extra.append(f"{'all' if n_want is None else n_want} samples per dataset (the folder "
                     f"holds {n_have})")
    return extra


def _union(have: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    n_have, n_want = have["num_samples"], want["num_samples"]
    return {
        "datasets": list(dict.fromkeys([*have["datasets"], *want["datasets"]])),
        "cells": list(dict.fromkeys([*have["cells"], *want["cells"]])),
        "num_samples": None if None in (n_have, n_want) else max(n_have, n_want),
    }


def read_config(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The folder's config.json, or None when there is none."""
    path = pathlib.Path(out_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RunFolderError(f"{path} does not parse ({e}); restore it or use another "
                             "--out_dir") from None


def _write_config(out_dir: pathlib.Path, config: dict[str, Any]) -> None:
    """config.json written whole or not at all (a temporary file, then a rename)."""
    path = out_dir / CONFIG_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, path)


def _check_data(old: dict[str, str], new: dict[str, str], out_dir: pathlib.Path) -> None:
    changed = [f"{d}: {old[d][:12]} -> {new[d][:12]}" for d in new if d in old
               and old[d] != new[d]]
    if changed:
        raise RunFolderError(
            f"{out_dir} was run on other data for {', '.join(changed)} (sha256 of the rows' "
            "source); its predictions would mix two versions of the data. Use another "
            "--out_dir for this data (the default folder is named by the configuration, not "
            "the data, so it is this one), or restore the data this folder was run on")


def open_run(out_dir: str | os.PathLike, identity: dict[str, Any], data: dict[str, str],
             extent: dict[str, Any], command: str, extend: bool = False,
             prompt: str | None = None) -> dict[str, Any]:
    """Creates or reopens `out_dir` for this run; returns the folder's config.

    prompt: how the command's prompts were formatted (its history entry's `prompt_format`,
    which results.md names; not part of the identity).
    Raises RunFolderError when the folder holds another configuration, data that changed, or
    (without `extend`) less than the command asks for.
    """
    out_dir = pathlib.Path(out_dir)
    old = read_config(out_dir)
    has_lines = bool(prediction_files(out_dir))
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    entry = {"command": command, "at": now, "extent": extent,
             **({} if prompt is None else {"prompt_format": prompt})}
    if old is None and has_lines or old is not None and old.get("format") != FORMAT:
        raise RunFolderError(
            f"{out_dir} holds predictions of an older runner whose configuration cannot be "
            "checked; use another --out_dir (or move that folder away)")
    if old is None:
        config = {"format": FORMAT, "run_id": run_id(identity), "identity": identity,
                  "data": data, "extent": extent, "history": [entry]}
    else:
        diff = differences(old["identity"], identity)
        if diff:
            weights = (" (model_files fingerprints the checkpoint's files by content; a "
                       "folder written before it did, by size, cannot be checked against "
                       "this checkpoint)" if any(d.startswith("model_files:") for d in diff)
                       else "")
            raise RunFolderError(
                f"{out_dir} holds a run of another configuration ({'; '.join(diff)}){weights}; "
                "mixing them would make every table wrong. Use another --out_dir (or leave it "
                "out: each configuration gets its own folder)")
        _check_data(old["data"], data, out_dir)
        extra = _covers(old["extent"], extent)
        if extra and not extend:
            raise RunFolderError(
                f"{out_dir} holds this configuration for fewer cells or samples than asked "
                f"({'; '.join(extra)}); pass --extend to add them to this folder (the report "
                "shows n for every cell), or use another --out_dir")
        config = {**old, "data": {**old["data"], **data},
                  "extent": _union(old["extent"], extent),
                  "history": [*old["history"], entry]}
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_config(out_dir, config)
    return config


def check_lines(rows: Iterable[dict], where: str) -> None:
    """Refuses prediction lines of several run identities (or, for lines older than run ids,
    one cell under several configurations): a table of them would mix configurations."""
    ids: set[str] = set()
    hashes: dict[tuple[str, str], set[str]] = {}
    for r in rows:
        if "run_id" in r:
            ids.add(r["run_id"])
        hashes.setdefault((r["dataset"], r["cell"]), set()).add(r["config_hash"])
    mixed = sorted(f"{d}/{c}" for (d, c), h in hashes.items() if len(h) > 1)
    if len(ids) > 1 or mixed:
        what = (f"{len(ids)} run configurations ({', '.join(sorted(ids))})" if len(ids) > 1
                else f"cells under several configurations ({', '.join(mixed[:4])})")
        raise RunFolderError(
            f"{where} holds predictions of {what}; a report over them would mix "
            "configurations. Rerun each configuration into its own --out_dir")
