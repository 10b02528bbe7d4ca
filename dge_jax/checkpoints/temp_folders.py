"""Temp folders (and files) of conversions: owner-named, found again when their owner died.

A conversion is written into a temp folder beside its target and renamed into place, so a
reader never sees half a folder. A process killed meanwhile leaves that folder behind (a
converted model is hundreds of MB); the name says which host and process owned it, so the
next use can remove the ones whose owner is gone without touching a live conversion.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import time
from pathlib import Path

# A conversion is written into `.<name>.tmp-<host>-<pid>-<tag>` beside its target and renamed
# into place; a process killed meanwhile leaves it behind, and the name says whose it was.
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<host>[A-Za-z0-9._]+)-(?P<pid>[0-9]+)-[0-9a-f]{8}$")
# Temp folders of converters before owners were named (mkdtemp's 8 random characters).
_LEGACY_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-[a-z0-9_]{8}$")
LEGACY_TEMP_AGE_S = 24 * 3600  # older than any conversion runs


def _host() -> str:
    """This machine's name with every character but letters, digits, '.' and '_' as '_'."""
    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "host"


def temp_name(out: Path) -> str:
    """The temp folder name of a conversion into `out` by this process on this host."""
    return f".{out.name}.tmp-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):  # not a pid this system can have
        return False
    return True


def stale_temps(folder: str | os.PathLike[str]) -> list[Path]:
    """Temp folders under `folder` left by conversions that died: named by this host and a
    process that no longer exists, or (an older converter's, which named no owner) not
    touched for a day. Another host's are never listed: its pids mean nothing here."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stale = []
    for path in folder.iterdir():
        match = _TEMP.match(path.name)
        if match:
            mine = match["host"] == _host()
            if mine and not _pid_alive(int(match["pid"])):  # a folder, or an assembled file
                stale.append(path)
        elif _LEGACY_TEMP.match(path.name) and path.is_dir():
            try:
                old = time.time() - path.stat().st_mtime > LEGACY_TEMP_AGE_S
            except OSError:
                continue
            if old:
                stale.append(path)
    return sorted(stale)


def remove_stale_temps(folder: str | os.PathLike[str]) -> list[Path]:
    """Deletes `stale_temps(folder)`; returns what it deleted."""
    removed = []
    for path in stale_temps(folder):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        if not path.exists():
            removed.append(path)
    return removed
