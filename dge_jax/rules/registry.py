"""Every scoring rule by name, for command lines, runner methods and sweeps.

``make_policy("snapkv", window=8)``; a wrapper takes its inner rule by name and passes the
options it does not have itself on to it: ``make_policy("criticalkv", inner="h2o",
window=16)`` is ``CriticalKV(inner=H2O(window=16))``, and so is the composite name
``make_policy("criticalkv_h2o", window=16)`` (how runner methods name a wrapped rule).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dge_jax.rules.expected_attention import ExpectedAttention
from dge_jax.rules.key_statistics import KeyDiff, LagKV
from dge_jax.rules.kvzip import KVzip
from dge_jax.rules.policies import (
    H2O,
    TOVA,
    FullKV,
    KeyNorm,
    PyramidKV,
    RandomScores,
    SnapKV,
    StreamingLLM,
)
from dge_jax.rules.rule_wrappers import ChunkKV, CriticalKV
from dge_jax.rules.scoring import Policy


def _names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


POLICIES: dict[str, type] = {
    cls.name: cls
    for cls in (
        FullKV, SnapKV, PyramidKV, H2O, StreamingLLM, RandomScores, KeyNorm, TOVA,
        ExpectedAttention, KeyDiff, LagKV, KVzip, CriticalKV, ChunkKV,
    )  # fmt: skip
}
# Wrappers: their `inner` rule is named, and takes the options the wrapper does not.
WRAPPERS = frozenset(name for name, cls in POLICIES.items() if "inner" in _names(cls))


def _default_inner(cls: type) -> Policy:
    return next(f for f in dataclasses.fields(cls) if f.name == "inner").default


def resolve(name: str) -> tuple[type, str | None]:
    """The class a policy name builds, and the inner rule a composite name gives
    ("criticalkv_expectedattention": CriticalKV around ExpectedAttention), else None."""
    key = name.lower()
    if key in POLICIES:
        return POLICIES[key], None
    for wrapper in WRAPPERS:
        inner = key.removeprefix(wrapper + "_")
        if inner != key and inner in POLICIES:
            _check_inner_name(wrapper, inner)
            return POLICIES[wrapper], inner
    composite = ", ".join(f"{w}_<rule>" for w in sorted(WRAPPERS))
    raise ValueError(
        f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}, and {composite}"
    )


def _check_inner_name(wrapper: str, inner: str) -> None:
    if inner.lower() in WRAPPERS or inner.lower() == "full":
        evicting = sorted(set(POLICIES) - WRAPPERS - {"full"})
        raise ValueError(
            f"{wrapper}'s inner rule must be one of {', '.join(evicting)}, got {inner!r}"
        )


def policy_fields(name: str) -> set[str]:
    """The options `make_policy(name, ...)` accepts (a wrapper's include its inner rule's)."""
    cls, inner = resolve(name)
    own = set(_names(cls))
    if "inner" in own:
        inner_cls = POLICIES[inner] if inner else type(_default_inner(cls))
        own |= set(_names(inner_cls))
    return own


def make_policy(name: str, **options: Any) -> Policy:
    """The policy registered as ``name`` built with ``options``; unknown names or options raise.

    For a wrapper, ``inner`` names its inner rule (or a composite name does:
    "chunkkv_keydiff"; default: the dataclass's) and the options the wrapper lacks go to it.
    """
    cls, composite_inner = resolve(name)
    own = _names(cls)
    if "inner" not in own:
        unknown = sorted(set(options) - set(own))
        if unknown:
            raise ValueError(
                f"unknown option(s) {unknown} for policy {cls.name!r}; known: {own or 'none'}"
            )
        return cls(**options)
    if composite_inner and "inner" in options:
        raise ValueError(f"{name!r} names its inner rule already; drop inner=")
    inner = options.pop("inner", composite_inner or _default_inner(cls).name)
    passed = {k: v for k, v in options.items() if k not in own}
    options = {k: v for k, v in options.items() if k in own}
    if not isinstance(inner, str):  # a policy object: used as it is
        if passed:
            raise ValueError(f"options {sorted(passed)} for {cls.name} need inner= by name")
        return cls(inner=inner, **options)
    _check_inner_name(cls.name, inner)
    return cls(inner=make_policy(inner, **passed), **options)
