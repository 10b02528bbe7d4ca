"""The grid a run evaluates: rules x timings x k x budgets, each cell one `Eviction`.

A cell's rule (`--rules`) is a registered rule's name (`snapkv`, `h2o`, ...), optionally
prefixed `adakv_` for AdaKV head-level budgets over that rule's scores (alpha 0.2), or
`global_` for one pool across every layer and head (KVzip's allocation, alpha 0); `full` is
the one cell without eviction.
Cell ids are stable strings (`snapkv/dge/k2/b128`), the keys of predictions and tables. A
cell that also compresses while decoding ends in its decode budget and interval
(`snapkv/prefill/b128/d128/i32`); timing "decode" compresses only while decoding, at its
budget (`snapkv/decode/b128/d128/i32`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dge_jax.eviction.decode_spec import DecodeCompression
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import KINDS, OBSERVES_DRAFTS, WITH_K, Adaptive, Lookahead, Timing
from dge_jax.rules.registry import RULES, WRAPPERS, make_rule, resolve, rule_fields

ADAKV_PREFIX = "adakv_"
# a rule's head-budget prefix -> (Eviction.head_budget, Eviction.alpha)
HEAD_BUDGET_PREFIXES = {ADAKV_PREFIX: ("adakv", 0.2), "global_": ("global", 0.0)}


def split_rule(rule: str) -> tuple[str, str, float]:
    """(registered rule name, head_budget, alpha) of a cell's rule: `global_kvzip` -> kvzip,
    global, 0."""
    for prefix, (head_budget, alpha) in HEAD_BUDGET_PREFIXES.items():
        if rule.startswith(prefix):
            return rule.removeprefix(prefix), head_budget, alpha
    return rule, "uniform", 0.2


@dataclasses.dataclass(frozen=True)
class Cell:
    """One evaluated configuration; `rule == "full"` has no timing, k or budget."""

    rule: str
    timing: str = "prefill"
    k: int = 1
    budget: int = 0
    adaptive: bool = False  # k is then k_max; the rule and threshold are run settings
    decode_budget: int = 0  # > 0: compress while decoding, every `interval` tokens
    interval: int = 0

    @property
    def id(self) -> str:
        if self.rule == "full":
            return "full"
        drafts = self.timing in WITH_K
        k = f"/k{self.k}{'a' if self.adaptive else ''}" if drafts else ""
        decode = f"/d{self.decode_budget}/i{self.interval}" if self.decode_budget else ""
        return f"{self.rule}/{self.timing}{k}/b{self.budget}{decode}"

    @property
    def without_decode(self) -> Cell:
        """The same cell with no compression while decoding (its prefill-only baseline)."""
        return dataclasses.replace(self, decode_budget=0, interval=0)

    @property
    def rule_name(self) -> str:
        """The registered rule's name: `rule` without its head-budget prefix."""
        return split_rule(self.rule)[0]

    def rule_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """The subset of `options` this cell's rule takes (none for full)."""
        if self.rule == "full":
            return {}
        fields = rule_fields(self.rule_name)
        return {k: v for k, v in options.items() if k in fields and v is not None}

    def eviction(
        self, rule_options: dict[str, Any], adaptive: Adaptive | None = None,
        draft_weight: float = 1.0, ties: str = "later", sliding: str = "window",
        lookahead: Lookahead | None = None,
    ) -> Eviction | None:
        """The `Eviction` of this cell; options a rule does not take are left out. `ties`:
        which of equal scores is kept (`Eviction.ties`); `sliding`: `Eviction.sliding`;
        `lookahead`: a "lookahead" cell's first stage (None: LAQ's defaults)."""
        if self.rule == "full":
            return None
        options = self.rule_options(rule_options)
        _, head_budget, alpha = split_rule(self.rule)
        if self.adaptive and adaptive is None:
            raise ValueError(f"cell {self.id} is adaptive but no adaptive rule was given")
        return Eviction(
            rule=make_rule(self.rule_name, **options),
            budget=self.budget,
            timing=Timing(self.timing, self.k, adaptive=adaptive if self.adaptive else None,
                          draft_weight=draft_weight if self.timing in OBSERVES_DRAFTS else 1.0,
                          lookahead=lookahead if self.timing == "lookahead" else None),
            head_budget=head_budget,
            alpha=alpha,
            ties=ties,
            sliding=sliding,
            decode=DecodeCompression(self.decode_budget, self.interval) if self.decode_budget
            else None,
        )


def parse_cell_id(cell_id: str) -> Cell:
    """Inverse of `Cell.id` (reports read cells back from prediction files)."""
    if cell_id == "full":
        return Cell("full")
    rule, timing, *rest = cell_id.split("/")
    fields = {part[0]: part[1:] for part in rest}  # k2 / k8a, b128, d128, i32
    k_text = fields.get("k", "1")
    adaptive = k_text.endswith("a")
    return Cell(rule, timing, int(k_text.removesuffix("a")), int(fields["b"]), adaptive,
                int(fields.get("d", 0)), int(fields.get("i", 0)))


def cell_order(cell_id: str) -> tuple:
    """Sort key of tables: FullKV first, then by rule and numeric budget (b64 before
    b128), prefill, DGE, DGE-W, DGE-D, lookahead, then k, adaptive, decode budget and
    interval."""
    c = parse_cell_id(cell_id)
    timing = {"prefill": 0, "dge": 1, "dge_w": 2, "dge_d": 3, "lookahead": 4}.get(c.timing, 5)
    return (c.rule != "full", c.rule, c.budget, timing, c.k, c.adaptive, c.decode_budget,
            c.interval)


def check_rule(rule: str) -> None:
    """Raises for a cell's rule that names no registered rule (with or without a head-budget
    prefix)."""
    name = split_rule(rule)[0]
    if rule == "full":
        return
    known = sorted(n for n in RULES if n != "full")
    reason = ""
    try:
        cls, _ = resolve(name)
    except ValueError as err:
        reason = f"; {err}" if "inner rule" in str(err) else ""
        cls = None
    if cls is None or cls.name == "full":
        wrapped = ", ".join(f"{w}_<rule>" for w in sorted(WRAPPERS))
        raise ValueError(
            f"unknown rule {rule!r}; known: full, {', '.join(known)}, {wrapped}, and "
            f"adakv_<rule> or global_<rule>{reason}"
        )


def build_cells(
    rules: Sequence[str], timings: Sequence[str], ks: Sequence[int], budgets: Sequence[int],
    adaptive_k_max: int | None = None, decode_budgets: Sequence[int] = (),
    intervals: Sequence[int] = (32,),
) -> list[Cell]:
    """Every cell of the grid, FullKV first; "prefill" cells ignore k (they evict at k=1).

    adaptive_k_max adds, for dge and dge_w, an adaptive cell drafting at most that k.
    decode_budgets adds, next to each cell, its variants that also compress while decoding
    (every decode budget x interval; not for "lookahead", which evicts once); timing
    "decode" cells compress only while decoding, one per decode budget and interval (their
    budget is the decode budget).
    """
    if "decode" in timings and not decode_budgets:
        raise ValueError("timing 'decode' compresses only while decoding: give decode budgets")
    for n in (*decode_budgets, *intervals):
        if n < 1:
            raise ValueError(f"decode budgets and intervals must be >= 1, got {n}")
    for rule in rules:
        check_rule(rule)
    for t in timings:
        if t not in KINDS:
            raise ValueError(f"unknown timing {t!r}; choose from {', '.join(KINDS)}")
    for k in ks:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
    if "dge_d" in timings and min(ks) < 2:
        raise ValueError("timing dge_d observes only the k - 1 drafted queries: give k >= 2")
    for b in budgets:
        if b < 1:
            raise ValueError(f"budgets must be >= 1, got {b}")
    cells = [Cell("full")] if "full" in rules else []
    variants = [(d, i) for d in decode_budgets for i in intervals]
    for rule in (r for r in rules if r != "full"):
        for timing in timings:
            if timing == "decode":
                cells += [Cell(rule, timing, 1, d, False, d, i) for d, i in variants]
                continue
            for k in ([1] if timing == "prefill" else ks):
                for budget in budgets:
                    cells.append(Cell(rule, timing, k, budget))
                    if timing != "lookahead":
                        cells += [Cell(rule, timing, k, budget, False, d, i)
                                  for d, i in variants]  # fmt: skip
            if adaptive_k_max and timing in ("dge", "dge_w"):
                for budget in budgets:
                    cells.append(Cell(rule, timing, adaptive_k_max, budget, adaptive=True))
    return list(dict.fromkeys(cells))
