"""One live full cache (issue 29): the draft and rewind steps donate their state, the grid
holds no full cache that no cell still reads, every cell still gets what it gets alone, and
`generate` never touches an array its caller holds. On a tiny random Llama whose head size
(24) no other test uses, so the live caches counted here are this module's.

`benchmarks/cost/tpu_aot.py` counts the same at a real model's size, in compiled memory on a TPU
topology (with `benchmarks/cell_memory.py`'s trace of what the grid holds).
"""

from __future__ import annotations

import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import jax_config, jax_model

from dge_jax.eviction.decode_spec import DecodeCompression
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import Timing
from dge_jax.generation import generate, generate_grid
from dge_jax.rules.h2o import H2O
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime import decoding as gen
from dge_jax.runtime.recorders import QueryWindow, Recording
from dge_jax.text.prompts import pad_left
from dge_jax.text.sampling import Greedy

HD, WINDOW, N_NEW = 24, 8, 6
PREFILL, DGE2, DGE_W2, DGE3 = (Timing("prefill", 1), Timing("dge", 2), Timing("dge_w", 2),
                               Timing("dge", 3))  # fmt: skip
PROMPTS = [np.random.default_rng(n).integers(0, 128, n).tolist() for n in (44, 30)]
DGE_CELL = Eviction(SnapKV(window=WINDOW), 14, DGE2)
GRID = [
    None,
    Eviction(SnapKV(window=WINDOW), 14, PREFILL),
    DGE_CELL,
    Eviction(SnapKV(window=WINDOW), 14, DGE_W2),
    Eviction(H2O(window=4), 12, DGE3, compact=False),
    Eviction(SnapKV(window=WINDOW), 16, Timing("decode", 1),
             decode=DecodeCompression(budget=16, interval=4)),
]  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return jax_model(jax_config(head_dim=HD))


def _kv_bytes(cache) -> int:
    return sum(x.nbytes for g in cache.groups for x in (g.k, g.v))


def _start(model, capacity: int = 64 + N_NEW):
    tokens, lengths = pad_left(PROMPTS, 64)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    recording = Recording.of(QueryWindow(WINDOW))
    pre = gen.prefill_prompt(model.forward, model.config, model.params, tokens, lengths,
                             gen.PrefillSpec(capacity, recording=recording))  # fmt: skip
    key = jax.random.PRNGKey(0)
    first = Greedy()(pre.logits, key)
    return lengths, gen.start_state(pre.cache, first, lengths, N_NEW, (), key, buffer=N_NEW)


def test_draft_and_rewind_donate_their_state(model):
    """Both steps' compiled programs alias the whole cache (keys and values) into their
    outputs, and running them deletes the input and leaves the cache where it was."""
    lengths, start = _start(model)
    whole = _kv_bytes(start.cache)
    args = (model.forward, model.config, model.params, start, gen.StepSpec(Greedy(), ()))
    opts = dict(num_steps=2)
    compiled = gen.draft_tokens.lower(*args, **opts).compile()
    assert compiled.memory_analysis().alias_size_in_bytes >= whole
    where = _pointers(start.cache)
    state, record = gen.draft_tokens(*args, **opts)
    assert start.cache.groups[0].k.is_deleted() and start.cache.groups[0].v.is_deleted()
    assert _pointers(state.cache) == where

    steps = jnp.asarray([1, 0])
    compiled = gen.rewind_state.lower(state, record, lengths, steps, eos_ids=()).compile()
    assert compiled.memory_analysis().alias_size_in_bytes >= whole
    rewound, _ = gen.rewind_state(state, record, lengths, steps, eos_ids=())
    assert state.cache.groups[0].k.is_deleted() and state.cache.groups[0].v.is_deleted()
    assert _pointers(rewound.cache) == where


def _pointers(cache) -> list[int]:
    return [x.unsafe_buffer_pointer() for g in cache.groups for x in (g.k, g.v)]


class Live:
    """A stage hook that counts, before each step, the full caches alive (k and v of every
    layer and row of prefill's capacity = 1), from `jax.live_arrays()`."""

    def __init__(self):
        self.seen: list[tuple[str, float]] = []
        self.capacity = self.rows = None

    def full_caches(self, num_layers: int) -> float:
        gc.collect()
        kv = [x for x in jax.live_arrays()
              if x.ndim == 5 and x.shape[-1] == HD and x.shape[3] == self.capacity]  # fmt: skip
        return sum(x.shape[0] * x.shape[1] for x in kv) / (2 * num_layers * self.rows)

    def hook(self, stage, fn, *args, **kwargs):
        if self.capacity is not None:
            self.seen.append((stage, self.full_caches(self.layers)))
        out = fn(*args, **kwargs)
        if stage == "prefill":
            self.capacity, self.rows = out.cache.capacity, out.cache.batch_size
            self.layers = out.cache.num_layers
        return out


def test_a_dge_cell_holds_one_full_cache_then_none(model):
    """Draft and rewind update prefill's cache in place; once it is compacted, decode holds
    no full cache."""
    live = Live()
    generate(model, PROMPTS, max_new_tokens=N_NEW, eviction=DGE_CELL, hook=live.hook)
    assert [s for s, _ in live.seen] == ["draft", "rewind", "keep_masks", "apply_eviction",
                                         "decode"]  # fmt: skip
    assert dict(live.seen) == {"draft": 1, "rewind": 1, "keep_masks": 1, "apply_eviction": 1,
                               "decode": 0}  # fmt: skip


@pytest.mark.parametrize("masked", [True, False], ids=["with-masked", "without-masked"])
def test_a_grid_drops_each_full_cache_after_its_last_reader(model, masked):
    """FullKV keeps prefill's cache (the draft runs on a copy); every eviction point shares
    the draft's. The decode-time cell takes the draft's cache when no later cell reads it, and
    copies it when the masked cell (decoded after it) still does. The stack of the FullKV (and
    masked) cells is made, then the caches it copied go; none is left for the compacted ones.
    (Counted in caches of the batch's rows: a stack of two cells is two.)"""
    live = Live()
    cells = GRID if masked else [ev for ev in GRID if ev is None or ev.compact]
    generate_grid(model, PROMPTS, cells, max_new_tokens=N_NEW, hook=live.hook)
    stages = [s for s, _ in live.seen]
    assert stages.count("rewind") == 2 + masked  # at 0 (prefill, decode-time), 1, (2)
    before_decode = [n for s, n in live.seen if s in ("rewind", "keep_masks", "apply_eviction")]
    assert max(before_decode) == 2  # prefill's (FullKV) + the draft's
    compressed = stages.index("decode_compressed")
    assert live.seen[compressed][1] == 2 + masked  # + its own copy
    stacks = [n for s, n in live.seen[compressed + 1 :] if s == "stack_states"]
    decodes = [n for s, n in live.seen[compressed + 1 :] if s == "decode"]
    assert stacks == [1 + masked, 0]  # what the stack copies: prefill's (and the draft's)
    assert decodes == [1 + masked, 0]  # the stack alone: a cache of its cells' rows


def test_a_grid_of_every_kind_gives_each_cell_what_it_gets_alone(model):
    """Tokens and kept sets of FullKV, prefill, dge, dge_w, masked and decode-time cells in
    one grid (one prefill, one draft, caches donated and released) equal each cell alone."""
    grid = generate_grid(model, PROMPTS, GRID, max_new_tokens=N_NEW, record_compressions=True)
    for ev, res in zip(GRID, grid, strict=True):
        alone = generate(model, PROMPTS, max_new_tokens=N_NEW, eviction=ev,
                         record_compressions=True)  # fmt: skip
        assert res.tokens == alone.tokens, ev
        assert res.kept == alone.kept, ev
        assert res.compressions == alone.compressions, ev


def test_generate_leaves_the_callers_arrays_alone(model):
    """Prompts given as a JAX array, and the model's parameters, outlive every donation."""
    tokens = jnp.asarray(np.asarray([PROMPTS[0][:30], PROMPTS[1]], np.int32))
    first = generate(model, tokens, max_new_tokens=N_NEW, eviction=DGE_CELL)
    again = generate_grid(model, tokens, GRID, max_new_tokens=N_NEW)
    assert not tokens.is_deleted()
    assert not any(x.is_deleted() for x in jax.tree.leaves(model.params))
    assert generate(model, tokens, max_new_tokens=N_NEW, eviction=DGE_CELL).tokens == first.tokens
    assert again[2].tokens == first.tokens
