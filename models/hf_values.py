"""Typed reading of config.json values, as transformers 5's strict config classes type them.

A null, a string or a boolean where a number belongs is refused naming the field and what it
must be (`read_int`, `read_float`, `read_bool`, `read_object`), except where transformers
reads null as its default (the caller says so with `null_default`).
"""

from __future__ import annotations

import json
import math
from typing import Any

from dge_jax.config import ConfigError

ABSENT = object()


def _shown(value: Any) -> str:
    """A config value as config.json spells it, with its JSON type when not a number."""
    text = json.dumps(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    if value is None or isinstance(value, int | float) and not isinstance(value, bool):
        return text
    kind = {bool: "a boolean", str: "a string", list: "an array", dict: "an object"}
    return f"{text} ({kind.get(type(value), type(value).__name__)})"


def bad_value(name: str, value: Any, what: str) -> ConfigError:
    """The error for config.json field `name` holding `value` where `what` belongs."""
    return ConfigError(
        f"config.json field {name} is {_shown(value)}, but it must be {what}; set it to the "
        "value the checkpoint was made with"
    )


def _read(
    raw: dict[str, Any], key: str, default: Any, null_default: bool, where: str
) -> tuple[bool, Any]:
    """(True, raw[key]) when it is to be checked; (False, `default`) when raw has no `key`
    (or holds null, with `null_default`). A required key (no default) that is absent raises."""
    value = raw.get(key, ABSENT)
    if value is ABSENT or (value is None and null_default):
        if default is ABSENT:
            raise ConfigError(
                f"config.json has no {where + key!r}, which the model needs; add it with the "
                "value the checkpoint was made with"
            )
        return False, default
    return True, value


def read_int(
    raw: dict[str, Any],
    key: str,
    default: Any = ABSENT,
    *,
    minimum: int = 1,
    null_default: bool = False,
    where: str = "",
) -> int:
    """raw[key] as an integer >= `minimum` (a size or a count); absent: `default` (required
    without one); null: `default` only with `null_default` (transformers reads it so), else
    refused. `where` prefixes the name in messages ("rope_parameters.")."""
    given, value = _read(raw, key, default, null_default, where)
    if not given:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise bad_value(where + key, value, f"an integer >= {minimum}")
    return value


def read_float(
    raw: dict[str, Any],
    key: str,
    default: Any = ABSENT,
    *,
    null_default: bool = False,
    where: str = "",
) -> float:
    """raw[key] as a finite number > 0 (every float the parsers read is a scale, an epsilon
    or a frequency base); absent and null as `read_int`."""
    given, value = _read(raw, key, default, null_default, where)
    if not given:
        return value
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or value <= 0):  # fmt: skip
        raise bad_value(where + key, value, "a positive number")
    return float(value)


def read_bool(raw: dict[str, Any], key: str, default: bool, *, null_default: bool = False) -> bool:
    """raw[key] as true or false; absent: `default`; null as `read_int`."""
    given, value = _read(raw, key, default, null_default, "")
    if given and not isinstance(value, bool):
        raise bad_value(key, value, "true or false")
    return value


def read_object(raw: dict[str, Any], key: str, where: str = "") -> dict[str, Any]:
    """raw[key] as a JSON object; absent or null: {} (no such parameters)."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_value(where + key, value, "an object (or null)")
    return dict(value)
