"""RoPE parameters of a Hugging Face config.json (`rope_parameters` or `rope_theta` +
`rope_scaling`) as a `RopeConfig`, checked as strictly as the rest of the config: an unknown
rope type or parameter is refused, and so is what `ignore_keys_at_rope_validation` would let
transformers load unchecked.
"""

from __future__ import annotations

import math
from typing import Any

from dge_jax.config import ConfigError, RopeConfig
from models.hf_values import ABSENT, bad_value, read_float, read_int, read_object

# What transformers 5.25's rope validation requires of each rope type this library runs
# (`_validate_<type>_rope_parameters`); a required key the config's
# `ignore_keys_at_rope_validation` lists counts as missing there, and the config is refused.
ROPE_REQUIRED = {
    "default": frozenset({"rope_type"}),
    "linear": frozenset({"rope_type", "factor"}),
    "llama3": frozenset({"rope_type", "rope_theta", "factor", "low_freq_factor",
                         "high_freq_factor", "original_max_position_embeddings"}),
    "longrope": frozenset({"rope_type", "short_factor", "long_factor",
                           "original_max_position_embeddings"}),
}  # fmt: skip
IGNORE_KEY = "ignore_keys_at_rope_validation"


def rope_ignored(raw: dict[str, Any]) -> frozenset[str]:
    """The rope parameter names config.json's `ignore_keys_at_rope_validation` lists (null or
    absent: none). transformers only skips them when it validates `rope_parameters`: an
    unknown one is then loaded unchecked, a required one makes the config fail to load."""
    value = raw.get(IGNORE_KEY)
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad_value(IGNORE_KEY, value, "null or a list of rope parameter names")
    return frozenset(value)


def _check_ignored(kind: str, params: dict[str, Any], ignored: frozenset[str],
                   prefix: str, known: set[str]) -> None:  # fmt: skip
    """Refuse what transformers refuses or would load unchecked: a listed key rope type `kind`
    requires, or a listed key this library does not know that `params` holds."""
    required = sorted(ignored & ROPE_REQUIRED[kind])
    if required:
        raise ConfigError(
            f"config.json's {IGNORE_KEY} lists {required}, which rope type {kind!r} needs; "
            "transformers then counts it as missing and refuses the config; drop it from the list"
        )
    unchecked = sorted(ignored & (set(params) - known))
    if unchecked:
        raise ConfigError(
            f"unknown rope parameter(s) {unchecked} in {prefix[:-1]}: config.json's {IGNORE_KEY}"
            " lists them, so transformers loads them unchecked, but they may change the "
            "numerics and this library does not know them; loading stops here"
        )


def parse_rope(
    raw: dict[str, Any], *, where: str | None = None, ignored: frozenset[str] | None = None
) -> RopeConfig:
    """RopeConfig from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`.

    where: the name of the parameters' object in messages (default: the key they came from).
    ignored: the config's `ignore_keys_at_rope_validation` (default: read from `raw`).
    """
    ignored = rope_ignored(raw) if ignored is None else ignored
    params = read_object(raw, "rope_parameters")
    scaling = read_object(raw, "rope_scaling")
    source = "rope_parameters"
    if not params:
        params, source = scaling, "rope_scaling"
    prefix = (source if where is None else where) + "."
    if "rope_theta" in params:
        theta = read_float(params, "rope_theta", where=prefix)
    else:
        theta = read_float(raw, "rope_theta", 10000.0)
    params.pop("rope_theta", None)
    name = "rope_type" if "rope_type" in params else "type"
    kind = params.pop("rope_type", params.pop("type", "default")) or "default"
    if not isinstance(kind, str):
        raise bad_value(prefix + name, kind, 'a rope type name such as "default"')
    partial = params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0) or isinstance(partial, bool):
        raise ConfigError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if kind == "default":
        expected: set[str] = set()
    elif kind == "linear":
        expected = {"factor"}
    elif kind == "llama3":
        expected = {
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        }
    elif kind == "longrope":
        _check_ignored(kind, params, ignored, prefix, LONGROPE_KEYS)
        return _parse_longrope(raw, params, theta, prefix)
    else:
        raise ConfigError(
            f"rope type {kind!r} (config rope_parameters/rope_scaling) is not supported; "
            "supported: default, linear, llama3, longrope"
        )
    _check_ignored(kind, params, ignored, prefix, expected)
    unknown = set(params) - expected
    if unknown:
        raise ConfigError(f"unknown rope parameter(s) {sorted(unknown)} for rope type {kind!r}")
    missing = expected - set(params)
    if missing:
        raise ConfigError(f"rope type {kind!r} needs {sorted(missing)} in rope_parameters")
    fields = {
        k: (read_int(params, k, where=prefix) if k == "original_max_position_embeddings"
            else read_float(params, k, where=prefix))
        for k in params
    }  # fmt: skip
    return RopeConfig(theta=theta, kind=kind, **fields)


LONGROPE_KEYS = {"short_factor", "long_factor", "factor", "attention_factor",
                 "original_max_position_embeddings"}  # fmt: skip


def _parse_longrope(
    raw: dict[str, Any], params: dict[str, Any], theta: float, prefix: str
) -> RopeConfig:
    """LongRoPE as transformers' `_compute_longrope_parameters` reads it: both factor lists;
    `original_max_position_embeddings` from the rope parameters, else the config's top level;
    `factor` default max_position_embeddings / original; `attention_factor` default
    sqrt(1 + log(factor) / log(original)) (1 when factor <= 1); a null one is its default."""
    unknown = set(params) - LONGROPE_KEYS
    if unknown:
        raise ConfigError(f"unknown rope parameter(s) {sorted(unknown)} for rope type 'longrope'")
    missing = {"short_factor", "long_factor"} - set(params)
    if missing:
        raise ConfigError(f"rope type 'longrope' needs {sorted(missing)} in rope_parameters")
    key = "original_max_position_embeddings"
    if params.get(key) is not None:
        original = read_int(params, key, where=prefix)
    elif raw.get(key, ABSENT) is ABSENT:
        raise ConfigError(f"rope type 'longrope' needs {key}; add it to rope_parameters")
    else:
        original = read_int(raw, key)
    factor = read_float(params, "factor", None, null_default=True, where=prefix)
    if factor is None:
        factor = read_int(raw, "max_position_embeddings") / original
    attention = read_float(params, "attention_factor", None, null_default=True, where=prefix)
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = {}
    for name in ("short_factor", "long_factor"):
        value = params[name]
        if not isinstance(value, list | tuple) or not all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in value
        ):
            raise ConfigError(f"longrope {name} must be a list of numbers, got {value!r}")
        factors[name] = tuple(float(x) for x in value)
    return RopeConfig(
        theta=theta,
        kind="longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        attention_factor=float(attention),
        **factors,
    )
