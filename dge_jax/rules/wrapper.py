"""What rules built on another rule's scores share (CriticalKV, ChunkKV): the `Wrapper` base,
which reads what its inner rule reads, and the check of the inner rule.

Because a wrapper's needs are its inner rule's, it works under every timing the inner rule
does: under DGE the drafted queries inform the inner scores, and the wrapper's stage
follows them.
"""

from __future__ import annotations

from dge_jax.rules.base import Needs, PyramidSchedule, Rule, ScoringRule
from dge_jax.rules.full import is_full


def check_inner(owner: object, inner: object) -> None:
    """TypeError unless ``inner`` is an evicting scoring rule."""
    if not isinstance(inner, ScoringRule) or is_full(inner):
        raise TypeError(
            f"{type(owner).__name__}.inner must be an evicting scoring rule (e.g. SnapKV()), "
            f"got {inner!r}"
        )


class Wrapper(ScoringRule):
    """A rule around ``inner``: it needs what the inner rule needs (`needs`) and keeps its
    per-layer budgets (`layer_schedule`); a subclass adds its own needs with ``|``."""

    inner: Rule

    @property
    def needs(self) -> Needs:
        """The inner rule's needs."""
        return self.inner.needs

    @property
    def layer_schedule(self) -> PyramidSchedule | None:
        """The inner rule's per-layer budgets (PyramidKV's), if any."""
        return self.inner.layer_schedule
