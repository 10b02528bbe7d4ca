"""PyramidKV (arXiv 2406.02069): SnapKV's scores with budgets falling from bottom to top."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from dge_jax.rules.base import PyramidSchedule, check_fields
from dge_jax.rules.registry import register
from dge_jax.rules.snapkv import SnapKV


@register
@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    """PyramidKV (arXiv 2406.02069): SnapKV's scores with budgets falling from bottom to top.

    Its ``layer_schedule`` is KVCache-Factory's ``PyramidKVCluster`` schedule (beta 20,
    `base.PyramidSchedule`); its ``scorer`` is SnapKV with the same settings.
    """

    beta: int = 20

    name: ClassVar[str] = "pyramidkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, ints={"beta": 1})

    @property
    def scorer(self) -> SnapKV:
        """The rule whose scores this one selects from: SnapKV with the same settings (a
        grid scores SnapKV and PyramidKV cells of one timing once)."""
        return SnapKV(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SnapKV)})

    @property
    def layer_schedule(self) -> PyramidSchedule:
        """KVCache-Factory's linear pyramid over this rule's window (`PyramidSchedule`)."""
        return PyramidSchedule(window=self.window, beta=self.beta)
