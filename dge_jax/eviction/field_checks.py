"""The checks `Eviction` runs on its fields: clear errors naming the field and the fix, for
the slips people make (a rule's or timing's name instead of the object, a float budget) and
for timings that cannot serve a rule."""

from __future__ import annotations

import math
import numbers

import numpy as np

from dge_jax.eviction.timing import Timing


def check_rule(rule: object) -> None:
    """Eviction.rule must be a rule object (a name is a common slip)."""
    if isinstance(rule, str):
        raise TypeError(
            f"Eviction.rule must be a rule object, not the string {rule!r}: use "
            f"dge_jax.rules.registry.make_rule({rule!r}) or a rule class of dge_jax.rules, "
            "e.g. dge_jax.rules.snapkv.SnapKV()"
        )
    if isinstance(rule, type) or not hasattr(rule, "scorer"):
        raise TypeError(
            f"Eviction.rule must be a rule instance (e.g. SnapKV(), or "
            f"dge_jax.rules.registry.make_rule('snapkv')), got {rule!r}"
        )


def check_timing(timing: object) -> None:
    """Eviction.timing must be a `Timing` (a kind's name is a common slip)."""
    if isinstance(timing, Timing):
        return
    if isinstance(timing, str):
        fix = {"prefill": "prefill()", "dge": "dge(2)", "dge_w": "dge_w(2)",
               "dge_d": "dge_d(2)"}.get(timing)  # fmt: skip
        fix = f"dge_jax.eviction.timing.{fix}" if fix else f"Timing({timing!r}, k)"
        raise TypeError(
            f"Eviction.timing must be a Timing, not the string {timing!r}: use {fix} "
            "(from dge_jax.eviction.timing: Timing(kind, k), prefill(), dge(k), dge_w(k), "
            "dge_d(k))"
        )
    raise TypeError(
        f"Eviction.timing must be a dge_jax.eviction.timing.Timing, got {timing!r}: use e.g. "
        "dge_jax.eviction.timing.dge(2), prefill(), dge_w(2) or Timing(kind, k)"
    )


def check_budget(budget: object) -> None:
    """Eviction.budget: an int >= 1, or an integer array: [] / per layer [L] / per head
    [L, Hkv] (their sizes are checked against the model when generating)."""
    forms = "an int, or an integer array per layer [L] or per layer and kv head [L, Hkv]"
    if isinstance(budget, bool | np.bool_) or isinstance(budget, str | bytes):
        raise TypeError(f"Eviction.budget (entries kept per kv head) must be {forms}, got "
                        f"{budget!r}")  # fmt: skip
    if isinstance(budget, numbers.Integral):
        if budget < 1:
            raise ValueError(
                f"Eviction.budget must be >= 1 entry per head, got {int(budget)} (entries kept "
                "per kv head)"
            )
        return
    if isinstance(budget, numbers.Real):
        raise TypeError(
            f"Eviction.budget (entries kept per kv head) must be {forms}, got the float "
            f"{budget!r}: round it, e.g. budget={round(budget) if math.isfinite(budget) else 256}"
        )
    try:
        array = np.asarray(budget)
    except (TypeError, ValueError):
        array = np.asarray(None)
    if array.ndim > 2 or array.size == 0 or array.dtype.kind not in "iu":
        raise TypeError(f"Eviction.budget (entries kept per kv head) must be {forms}, got "
                        f"{budget!r}")  # fmt: skip
    if array.min() < 1:
        raise ValueError(
            f"Eviction.budget must be >= 1 entry per head, got {int(array.min())} in {budget!r}"
        )


def check_timing_fits(timing: Timing, rule, decode) -> None:
    """`dge_d` and `lookahead` with a rule that keeps its own records (what a record of no
    prompt, or of another cache's slots, is cannot be said), and `lookahead` with
    compression while decoding, are refused."""
    kind = timing.kind
    if kind in ("dge_d", "lookahead") and rule.needs.recorders:
        why = ("scores with the drafted queries alone, and the rule's records cannot leave "
               "the prompt out" if kind == "dge_d" else "moves what its lookahead recorded "
               "onto the full cache's slots, which the rule's records cannot say how to")
        raise ValueError(
            f"timing {kind} {why}: {type(rule).__name__} keeps its own records "
            "(Needs.recorders); use timing dge or dge_w with this rule"
        )
    if kind == "lookahead" and decode is not None:
        raise ValueError(
            "timing lookahead evicts once, from the full cache, after its lookahead; it does "
            "not also compress while decoding (Eviction.decode): drop decode, or use timing "
            "prefill / dge with decode"
        )
