"""Sliding layers that hold their window, not the prompt (`dge_jax.runtime.window_cache`).

- `make_room` moves a sliding group's last window - 1 slots to the front when a step would
  overflow it (the module docstring's worked example, by hand);
- prefill's cache of a tiny Gemma 3 at a prompt 8x its window: sliding layers hold window +
  one prefill step slots, global layers the prompt, and fewer bytes than the full layout;
- the bounded layout gives the full layout's tokens and kept sets for FullKV and for every
  rule that can run on it, under every timing before decoding and every head budget mode
  (the `make_room` moves happen in prefill, the draft and decoding);
- cells that need the full layout (KVzip, sliding="evict", decode-time compression) get it
  under "auto", and "bounded" refuses them by name.

The tiny Gemma 3 checkpoint (conftest "gemma3": window 8 on layer 0, layer 1 global) is a
transformers model saved to disk; its parity is tests/test_parity.py's.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import jax_config, jax_model

import dge_jax
from dge_jax.eviction.decode_spec import DecodeCompression
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import dge, dge_w, prefill
from dge_jax.rules.registry import RULES, make_rule, rule_fields
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime.cache import LayerGroup
from dge_jax.runtime.window_cache import layer_capacities, make_room

NEW, CHUNK = 12, 8


@pytest.fixture(scope="module")
def gemma3(checkpoint):
    return dge_jax.load(checkpoint("gemma3"))


def _prompts(vocab: int, lengths=(40, 29)) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def _run(model, prompts, cells, layout, chunk=CHUNK):
    """The grid's results and the cache prefill built."""
    seen = {}

    def hook(stage, fn, *args, **kwargs):
        out = fn(*args, **kwargs)
        seen.setdefault(stage, out)
        return out

    out = dge_jax.generate_grid(model, prompts, cells, max_new_tokens=NEW, chunk=chunk,
                                sliding_cache=layout, hook=hook)  # fmt: skip
    return out, seen["prefill"].cache


def test_make_room_keeps_the_window_in_position_order():
    """The module docstring's example: window 4, 7 slots holding positions 0..6, a 3-token
    step: positions 4, 5, 6 move to slots 0..2, the rest empty, index 7 -> 3; a step that
    fits changes nothing."""
    pos = jnp.arange(7, dtype=jnp.int32).reshape(1, 1, 1, 7)
    k = jnp.broadcast_to(pos[..., None].astype(jnp.float32), (1, 1, 1, 7, 2))
    group = LayerGroup(k=k, v=-k, pos=pos, index=jnp.asarray([7], jnp.int32))
    moved = make_room(group, window=4, t=3)
    assert moved.pos[0, 0, 0].tolist() == [4, 5, 6, -1, -1, -1, -1]
    assert moved.k[0, 0, 0, :3, 0].tolist() == [4, 5, 6]
    assert moved.v[0, 0, 0, :3, 0].tolist() == [-4, -5, -6]
    assert moved.index.tolist() == [3]
    roomy = dataclasses.replace(group, index=jnp.asarray([4], jnp.int32))
    assert make_room(roomy, window=4, t=3).pos.tolist() == pos.tolist()
    # too small for the window and a step: a full-layout cache, never moved
    assert make_room(group, window=6, t=3) is group


def test_capacities_of_the_bounded_layout():
    assert layer_capacities((8, 0, 8), 100, 16) == (24, 100, 24)
    assert layer_capacities((8, 0), 20, 16) == 20  # a short prompt: every layer alike
    assert layer_capacities((), 50, 16) == 50


def test_a_prompt_8x_the_window_holds_the_window_on_sliding_layers():
    """Tiny Gemma-3-like model (windows 16 on 5 of 6 layers), a 128-token prompt: prefill's
    sliding groups have 16 + 16 slots and hold at most the last 31 positions, the global
    layer the prompt; the cache's bytes fall with its slots (35 % of the full layout's); after a
    DGE eviction at budget 20 the global heads hold 20 entries, the sliding ones their
    window's 15."""
    window, length = 16, 128
    cfg = jax_config(layer_windows=(window,) * 5 + (0,), num_layers=6)
    model = jax_model(cfg, seed=4)
    prompts = _prompts(cfg.vocab_size, (length,))
    ev = Eviction(SnapKV(window=4), budget=20, timing=dge(2))
    (_, result), cache = _run(model, prompts, [None, ev], "bounded", chunk=16)
    (_, full_result), full = _run(model, prompts, [None, ev], "full", chunk=16)
    assert cache.capacities[:5] == (window + 16,) * 5
    assert cache.capacities[5] >= length and full.capacities == (cache.capacities[5],) * 6
    pos = np.asarray(cache.groups[0].pos)  # after prefill: the last step's window
    assert pos.max() == length - 1 and pos[pos >= 0].min() >= length - (window + 16)
    cap = cache.capacities[5]  # bytes per slot alike: slots in all, 5 * 32 + cap against 6 * cap
    assert cache.nbytes() * 6 * cap == full.nbytes() * (5 * (window + 16) + cap)
    next_pos = length + result.k[0] - 1
    for layer in range(5):
        assert all(h == list(range(next_pos - window + 1, next_pos))
                   for h in result.kept[0][layer])  # fmt: skip
    assert [len(h) for h in result.kept[0][5]] == [20] * cfg.num_kv_heads
    assert result.tokens == full_result.tokens and result.kept == full_result.kept


def _bounded_rules():
    # KVzip needs the full layout; random's draws depend on the shape of what it scores
    names = [n for n in sorted(RULES) if n not in ("full", "kvzip", "random")]
    rules = [make_rule(n, **({"window": 4} if "window" in rule_fields(n) else {}))
             for n in names]  # fmt: skip
    return names, rules


@pytest.mark.parametrize("timing", [prefill(), dge(2), dge_w(2)], ids=str)
def test_bounded_and_full_layouts_agree_for_every_rule(gemma3, timing):
    """FullKV and every rule but KVzip (which needs the full layout) and the random control
    (its draws depend on the shape it scores, a global layer alone here) at budget 12: the
    same tokens and kept sets in both layouts, and the bounded prefill cache is the smaller.
    The control keeps the budget on the global layer and the window on the sliding one."""
    names, rules = _bounded_rules()
    prompts = _prompts(gemma3.config.vocab_size)
    cells = [None] + [Eviction(r, budget=12, timing=timing) for r in rules]
    bounded, small = _run(gemma3, prompts, cells, "bounded")
    full, big = _run(gemma3, prompts, cells, "full")
    assert small.ragged and small.capacities[0] == 8 + CHUNK and not big.ragged
    for name, a, b in zip(["fullkv", *names], bounded, full, strict=True):
        assert a.tokens == b.tokens, name
        assert a.kept == b.kept, name
    (control,), _ = _run(gemma3, prompts, [Eviction(make_rule("random"), budget=12,
                                                     timing=timing)], "bounded")  # fmt: skip
    for row, prompt in enumerate(prompts):
        next_pos = len(prompt) + control.k[row] - 1
        sliding, global_ = control.kept[row]
        assert all(h == list(range(next_pos - 7, next_pos)) for h in sliding)
        assert [len(h) for h in global_] == [12] * len(global_)


@pytest.mark.parametrize("head_budget", ["adakv", "global"])
def test_bounded_layout_under_head_budgets(gemma3, head_budget):
    """AdaKV and the global pool over the bounded layout: the full layout's tokens and
    kept sets (the global pool spans the global layer only in both)."""
    prompts = _prompts(gemma3.config.vocab_size)
    cells = [Eviction(SnapKV(window=4), budget=12, timing=t, head_budget=head_budget)
             for t in (prefill(), dge(2))]  # fmt: skip
    bounded, small = _run(gemma3, prompts, cells, "bounded")
    full, _ = _run(gemma3, prompts, cells, "full")
    assert small.ragged
    for a, b in zip(bounded, full, strict=True):
        assert a.tokens == b.tokens and a.kept == b.kept


def test_cells_that_need_the_full_layout(gemma3):
    """KVzip, sliding='evict' and decode-time compression: "auto" gives them the full layout
    (the grid's prefill cache is of one capacity), "bounded" refuses them by name; a model
    without sliding layers never gets a bounded cache."""
    prompts = _prompts(gemma3.config.vocab_size)
    needs_full = {
        "sliding='evict'": Eviction(SnapKV(window=4), budget=12, sliding="evict"),
        "decode-time compression": Eviction(SnapKV(window=4), budget=16,
                                            decode=DecodeCompression(budget=16, interval=4)),
    }  # fmt: skip
    for why, ev in needs_full.items():
        _, cache = _run(gemma3, prompts, [None, ev], "auto")
        assert not cache.ragged, why
        with pytest.raises(ValueError, match="sliding_cache='bounded' cannot run cell 1"):
            _run(gemma3, prompts, [None, ev], "bounded")
    _, cache = _run(gemma3, prompts, [None], "auto")
    assert cache.ragged
    with pytest.raises(ValueError, match="sliding_cache must be one of"):
        dge_jax.generate(gemma3, prompts, sliding_cache="ring")
    _, cache = _run(jax_model(), prompts, [None], "bounded")
    assert not cache.ragged
