"""What a grid of cells needs before it runs, planned once (`plan_grid` -> `GridPlan`): the
checked cells, what their shared prefill and draft record together, whether sliding layers
get the bounded layout, how much room prefill's cache needs. Then what `dge_jax.stages`
hands on for each cell, one type per stage: `Rewound` -> `Selected` -> `Evicted`, each
complete when made (no field is filled in by a later stage)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from dge_jax.eviction.evict import Eviction, check_eviction, round_up_slots, spreads_budget
from dge_jax.eviction.lookahead import first_stage
from dge_jax.rules.base import Needs
from dge_jax.rules.full import is_full
from dge_jax.runtime.decoding import DecodeState
from dge_jax.runtime.records import DraftRecord
from dge_jax.runtime.window_cache import LAYOUTS
from dge_jax.text.prompts import Request


@dataclasses.dataclass(frozen=True)
class Rewound:
    """One cell at its eviction point (the rewind stage's output).

    eviction: None for FullKV; state: the decode state it evicts from (or, evicting nothing
    before decoding, decodes from); steps: draft steps each row ran before that point ([B]
    int; None: the grid ran no draft, so the state is prefill's); drafts: the record its rule
    observes, the draft rewound to `steps` or its lookahead's (None: it observes none).
    """

    eviction: Eviction | None
    state: DecodeState
    steps: np.ndarray | None
    drafts: DraftRecord | None


@dataclasses.dataclass(frozen=True)
class Selected:
    """One cell with what it keeps (the select stage's output): `Rewound`'s fields and keep,
    the keep mask [L, B, Hkv, S] over `state`'s cache (None: the cell evicts nothing before
    decoding, FullKV or timing "decode")."""

    eviction: Eviction | None
    state: DecodeState
    steps: np.ndarray | None
    drafts: DraftRecord | None
    keep: jax.Array | None


@dataclasses.dataclass(frozen=True)
class Evicted:
    """One cell ready to decode (the evict stage's output); it holds no full cache it no
    longer reads.

    state: the state decoding starts from (evicted: masked or compacted); keep: `Selected`'s
    mask; positions: the slot positions of the cache it indexes (both None: nothing was
    evicted before decoding); steps: as `Rewound`'s; attn: the attention sums aligned with
    the cache, for a decode-time rule that reads them (H2O; None: it reads none).
    """

    eviction: Eviction | None
    state: DecodeState
    keep: jax.Array | None
    positions: jax.Array | None
    steps: np.ndarray | None
    attn: jax.Array | None


@dataclasses.dataclass(frozen=True)
class GridPlan:
    """A grid planned once, before its prefill (`plan_grid`).

    cells: the checked cells (`check_cells`: FullKV as None); recording: what the shared
    prefill and draft record (`GridRecording`); bounded: whether prefill's cache gives
    sliding layers the bounded layout (`dge_jax.runtime.window_cache`); room: the slots
    after the prompt prefill's cache holds.
    """

    cells: tuple[Eviction | None, ...]
    recording: GridRecording
    bounded: bool
    room: int


def plan_grid(
    cells: Sequence[Eviction | None], request: Request, windows: tuple[int, ...], layout: str
) -> GridPlan:
    """The plan of a grid of `cells` for `request`: the cells checked (clear errors before
    compiling), their recording, the sliding layout (`layout`: `GenerationConfig.sliding_cache`)
    and the cache room. windows: the model's layer windows."""
    checked = check_cells(cells, request.max_new_tokens, windows)
    recording = GridRecording.of(checked)
    bounded = _bounded_sliding(checked, windows, layout)
    return GridPlan(tuple(checked), recording, bounded, _cache_room(request, checked))


def check_cells(
    cells: Sequence[Eviction | None], max_new_tokens: int, windows: tuple[int, ...] = ()
) -> list[Eviction | None]:
    """The cells with FullKV as None, each eviction checked (clear errors before compiling);
    windows: the model's layer windows (a compressing decode loop must hold a window).
    `plan_grid` starts here; `generate_for_contexts` checks alone, to split its cells into
    grids before it has their requests."""
    if isinstance(cells, Eviction):
        raise TypeError("cells must be a list of Eviction / None; for one eviction pass [ev]")
    for i, ev in enumerate(cells):
        if ev is not None and not isinstance(ev, Eviction):
            raise TypeError(
                f"eviction (cell {i}) must be a dge_jax.eviction.evict.Eviction or None (no "
                f"eviction), got {ev!r}; e.g. Eviction(SnapKV(), budget=256, "
                "timing=dge_jax.eviction.timing.dge(2))"
            )
    cells = [None if ev is None or is_full(ev.rule) else ev for ev in cells]
    for ev in cells:
        if ev is not None:
            check_eviction(ev, max_new_tokens)
    return [_hold_windows(ev, windows) for ev in cells]


def _hold_windows(ev: Eviction | None, windows: tuple[int, ...]) -> Eviction | None:
    """A cell that compresses while decoding, on a model whose sliding layers keep their
    window (`Eviction.sliding` "window"), with its decode loop's head cap raised to hold the
    longest window less one (`DecodeCompression.window_floor`): the loop has one capacity
    for all layers, the budget still applies to the global layers."""
    if ev is None or ev.decode is None or ev.sliding == "evict" or max(windows, default=0) < 2:
        return ev
    floor = max(windows) - 1
    if ev.decode.head_cap(spreads_budget(ev)) >= floor:
        return ev
    return dataclasses.replace(ev, decode=dataclasses.replace(ev.decode, window_floor=floor))


@dataclasses.dataclass(frozen=True)
class GridRecording:
    """What the shared prefill and draft record, for every cell at once: the union of the
    cells' declared needs (`Needs.__or__`: the largest query window, attention sums if any
    reads them, the one start of query statistics, every rule's own recorders, the one
    reconstruct stage) and the largest draft k. What the forward records is
    `needs.recording` (prefill), and its `steps` (each draft step)."""

    needs: Needs
    draft_steps: int

    @classmethod
    def of(cls, cells: Sequence[Eviction | None]) -> GridRecording:
        """The recording the evicting cells of a grid need together (None: FullKV)."""
        active = [ev for ev in cells if ev is not None]
        needs = Needs()
        for ev in active:
            needs = needs | ev.rule.needs
            if ev.timing.kind == "lookahead":  # its first stage's wider window
                needs = needs | first_stage(ev).rule.needs
        steps = max((ev.timing.draft_steps for ev in active), default=0)
        return cls(needs=needs, draft_steps=steps)


def _cache_room(request: Request, cells: Sequence[Eviction | None]) -> int:
    """Slots after the prompt the shared prefill cache needs: room for every new token when a
    cell decodes in that cache (FullKV, a masked eviction); otherwise only for the drafts and
    for the first block of a cell that evicts only while decoding (every other cell decodes
    from a compacted copy), so that prefill's cache does not grow with the answer length."""
    if any(ev is None or not ev.compact for ev in cells):
        return request.buffer
    need = [ev.timing.draft_steps for ev in cells]
    need += [ev.decode.interval for ev in cells if not ev.timing.before_decoding]
    return min(request.buffer, round_up_slots(max(need + [1])))


def _bounded_sliding(
    cells: Sequence[Eviction | None], windows: tuple[int, ...], layout: str
) -> bool:
    """Whether prefill's cache gives sliding layers the bounded layout
    (`dge_jax.runtime.window_cache`; `GenerationConfig.sliding_cache`): "full" never, "auto"
    when the model has sliding layers and every cell can run on it, "bounded" then too, and
    a clear error naming a cell that cannot. Cells that cannot: sliding="evict" (the rule
    ranks a sliding layer's entries by what it recorded over the whole prompt), KVzip (its
    repeat of the prompt reads every layer's prompt) and decode-time compression (its loop
    scores every layer in one stacked cache)."""
    if layout not in LAYOUTS:
        raise ValueError(f"sliding_cache must be one of {LAYOUTS}, got {layout!r}")
    if layout == "full" or not any(windows):
        return False
    for i, ev in enumerate(cells):
        why = None if ev is None else _needs_full_layout(ev)
        if why and layout == "bounded":
            raise ValueError(f"sliding_cache='bounded' cannot run cell {i}: {why}; use "
                             "sliding_cache='auto' (the full layout for such a grid)")  # fmt: skip
        if why:
            return False
    return True


def _needs_full_layout(ev: Eviction) -> str | None:
    """Why `ev` needs every sliding layer at prompt length (None: it does not)."""
    if ev.sliding == "evict":
        return "Eviction(sliding='evict') ranks sliding layers by their whole-prompt record"
    if ev.rule.needs.reconstruction is not None:
        return f"{type(ev.rule).__name__} repeats the prompt over every layer's prompt entries"
    if ev.decode is not None or not ev.timing.before_decoding:
        return "decode-time compression scores every layer in one stacked cache"
    return None
