"""Every scoring rule by name, for command lines, the runner's grids and sweeps.

A rule registers itself with ``@register`` on its class. The first time the registry is
read, it imports every module of the `dge_jax.rules` package (`pkgutil.iter_modules`, names
computed at run time), so a new file in dge_jax/rules/ is the only edit a new rule needs.

``make_rule("snapkv", window=8)``; a wrapper takes its inner rule by name and passes the
options it does not have itself on to it: ``make_rule("criticalkv", inner="h2o",
window=16)`` is ``CriticalKV(inner=H2O(window=16))``, and so is the composite name
``make_rule("criticalkv_h2o", window=16)`` (how the runner's --rules name a wrapped rule).
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import pkgutil
from collections.abc import Iterator, MutableMapping, Set
from typing import Any

from dge_jax.rules.base import Rule

_CLASSES: dict[str, type] = {}
_state = {"discovered": False, "discovering": False}


def register(cls: type) -> type:
    """Class decorator: the rule answers to ``cls.name`` (lower case) in the registry."""
    name = cls.name
    if not isinstance(name, str) or name != name.lower() or not name:
        raise ValueError(f"{cls.__qualname__}.name must be a lower-case string, got {name!r}")
    known = _CLASSES.get(name)
    if known is not None and (known.__module__, known.__qualname__) != (
        cls.__module__,
        cls.__qualname__,
    ):
        raise ValueError(
            f"rule name {name!r} is taken by {known.__module__}.{known.__qualname__}; "
            f"give {cls.__module__}.{cls.__qualname__} another name"
        )
    _CLASSES[name] = cls
    return cls


def discover() -> None:
    """Imports every module of this package once, so that each rule file registers itself."""
    if _state["discovered"] or _state["discovering"]:
        return
    _state["discovering"] = True
    try:
        package = __name__.rpartition(".")[0]
        folder = str(pathlib.Path(__file__).resolve().parent)
        for info in sorted(pkgutil.iter_modules([folder]), key=lambda m: m.name):
            importlib.import_module(f"{package}.{info.name}")
        _state["discovered"] = True
    finally:
        _state["discovering"] = False


class _Registry(MutableMapping):
    """name -> rule class, filled by `register`, read after `discover` (names sorted)."""

    def __getitem__(self, name: str) -> type:
        discover()
        return _CLASSES[name]

    def __setitem__(self, name: str, cls: type) -> None:
        _CLASSES[name] = cls

    def __delitem__(self, name: str) -> None:
        del _CLASSES[name]

    def __iter__(self) -> Iterator[str]:
        discover()
        return iter(sorted(_CLASSES))

    def __len__(self) -> int:
        discover()
        return len(_CLASSES)

    def __contains__(self, name: object) -> bool:
        discover()
        return name in _CLASSES

    def __repr__(self) -> str:
        return f"RULES({dict(self.items())!r})"


RULES = _Registry()


def _names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


class _Wrappers(Set):
    """The registered rules that take an ``inner`` rule (read from the registry each time)."""

    def _names(self) -> list[str]:
        return [name for name, cls in RULES.items() if "inner" in _names(cls)]

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


# Wrappers: their `inner` rule is named, and takes the options the wrapper does not.
WRAPPERS = _Wrappers()


def _default_inner(cls: type) -> Rule:
    return next(f for f in dataclasses.fields(cls) if f.name == "inner").default


def resolve(name: str) -> tuple[type, str | None]:
    """The class a rule name builds, and the inner rule a composite name gives
    ("criticalkv_expectedattention": CriticalKV around ExpectedAttention), else None."""
    key = name.lower()
    if key in RULES:
        return RULES[key], None
    for wrapper in WRAPPERS:
        inner = key.removeprefix(wrapper + "_")
        if inner != key and inner in RULES:
            _check_inner_name(wrapper, inner)
            return RULES[wrapper], inner
    composite = ", ".join(f"{w}_<rule>" for w in sorted(WRAPPERS))
    raise ValueError(
        f"unknown rule {name!r}; known: {', '.join(sorted(RULES))}, and {composite}"
    )


def _check_inner_name(wrapper: str, inner: str) -> None:
    if inner.lower() in WRAPPERS or inner.lower() == "full":
        evicting = sorted(set(RULES) - set(WRAPPERS) - {"full"})
        raise ValueError(
            f"{wrapper}'s inner rule must be one of {', '.join(evicting)}, got {inner!r}"
        )


def rule_fields(name: str) -> set[str]:
    """The options `make_rule(name, ...)` accepts (a wrapper's include its inner rule's)."""
    cls, inner = resolve(name)
    own = set(_names(cls))
    if "inner" in own:
        inner_cls = RULES[inner] if inner else type(_default_inner(cls))
        own |= set(_names(inner_cls))
    return own


def make_rule(name: str, **options: Any) -> Rule:
    """The rule registered as ``name`` built with ``options``; unknown names or options raise.

    For a wrapper, ``inner`` names its inner rule (or a composite name does:
    "chunkkv_keydiff"; default: the dataclass's) and the options the wrapper lacks go to it.
    """
    cls, composite_inner = resolve(name)
    own = _names(cls)
    if "inner" not in own:
        unknown = sorted(set(options) - set(own))
        if unknown:
            raise ValueError(
                f"unknown option(s) {unknown} for rule {cls.name!r}; known: {own or 'none'}"
            )
        return cls(**options)
    if composite_inner and "inner" in options:
        raise ValueError(f"{name!r} names its inner rule already; drop inner=")
    inner = options.pop("inner", composite_inner or _default_inner(cls).name)
    passed = {k: v for k, v in options.items() if k not in own}
    options = {k: v for k, v in options.items() if k in own}
    if not isinstance(inner, str):  # a rule object: used as it is
        if passed:
            raise ValueError(f"options {sorted(passed)} for {cls.name} need inner= by name")
        return cls(inner=inner, **options)
    _check_inner_name(cls.name, inner)
    return cls(inner=make_rule(inner, **passed), **options)
