"""Eviction on models with sliding-window layers (Gemma 2/3, Mistral v0.1, Qwen2 sliding).

The rule's budget applies to the global layers; a sliding layer keeps exactly the entries its
window still shows a later query (`evict.select_for_budgets`), so:

- a budget no smaller than the prompt reproduces FullKV's tokens under every timing, though
  the sliding layers drop what their window no longer shows;
- every head of a global layer keeps the budget, every sliding layer the last window - 1
  positions before the next query;
- compacted, a sliding layer's capacity follows its window, a global layer's the budget.

The tiny Gemma 3 checkpoint (conftest "gemma3": window 8 on layer 0, layer 1 global) is a
transformers model saved to disk; its parity is tests/test_parity.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_model import jax_config, jax_model

import dge_jax
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import dge, dge_w, prefill
from dge_jax.rules.h2o import H2O
from dge_jax.rules.snapkv import SnapKV
from dge_jax.rules.streamingllm import StreamingLLM

NEW = 10


@pytest.fixture(scope="module")
def gemma3(checkpoint):
    return dge_jax.load(checkpoint("gemma3"))


def _prompts(vocab: int, lengths=(40, 29)) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def test_a_budget_over_the_prompt_reproduces_fullkv_under_every_timing(gemma3):
    prompts = _prompts(gemma3.config.vocab_size)
    timings = (prefill(), dge(2), dge_w(2))
    cells = [None] + [Eviction(rule, budget=64, timing=t) for rule in (SnapKV(), H2O())
                      for t in timings]  # fmt: skip
    out = dge_jax.generate_grid(gemma3, prompts, cells, max_new_tokens=NEW, chunk=8)
    for i, result in enumerate(out[1:], 1):
        assert result.tokens == out[0].tokens, cells[i]
        for row, prompt in enumerate(prompts):
            sliding = result.kept[row][0]  # layer 0 slides over 8 keys
            assert all(len(head) < len(prompt) for head in sliding)


@pytest.mark.parametrize("head_budget", ["uniform", "adakv", "global"])
def test_global_heads_keep_the_budget_sliding_layers_their_window(gemma3, head_budget):
    prompts = _prompts(gemma3.config.vocab_size)
    budget, window = 12, gemma3.config.window(0)
    assert window == 8 and gemma3.config.window(1) == 0
    for timing in (prefill(), dge(2)):
        ev = Eviction(SnapKV(window=4), budget=budget, timing=timing, head_budget=head_budget)
        (result,) = dge_jax.generate_grid(gemma3, prompts, [ev], max_new_tokens=NEW, chunk=8)
        for row, prompt in enumerate(prompts):
            # k answer tokens were chosen with the full cache (1 at prefill: prefill's
            # logits), the last one pending: the next query is at position len + k - 1
            next_pos = len(prompt) + result.k[row] - 1
            for head in result.kept[row][0]:
                assert head == list(range(next_pos - window + 1, next_pos)), (timing, row)
            global_heads = result.kept[row][1]
            if head_budget == "uniform":
                assert [len(h) for h in global_heads] == [budget] * len(global_heads)
            else:  # the allocators pool the global layer's heads: the total is kept
                assert sum(map(len, global_heads)) == budget * len(global_heads)


def test_compacted_capacities_follow_the_window_and_the_budget():
    """A prompt 8x the window (64): compacted, the sliding layers hold their window's 63
    entries (64 slots + the new tokens), the global layers the budget (192 slots); the
    full cache held the whole prompt in every layer."""
    window, prompt_len, budget = 64, 512, 160
    cfg = jax_config(layer_windows=(window, 0, window, 0), num_layers=4)
    model = jax_model(cfg, seed=3)
    prompts = _prompts(cfg.vocab_size, (prompt_len,))
    seen = {}

    def hook(stage, fn, *args, **kwargs):
        out = fn(*args, **kwargs)
        seen.setdefault(stage, out)
        return out

    ev = Eviction(StreamingLLM(), budget=budget, timing=prefill())
    (result,) = dge_jax.generate_grid(model, prompts, [ev], max_new_tokens=NEW, hook=hook)
    full = seen["prefill"].cache
    assert full.capacities == (full.capacities[0],) * 4 and full.capacities[0] >= prompt_len
    evicted = seen["apply_eviction"]
    room = evicted.capacities[0] - 64
    assert room >= NEW
    assert evicted.capacities == (64 + room, 192 + room, 64 + room, 192 + room)
    assert [len(h) for h in result.kept[0][0]] == [window - 1] * cfg.num_kv_heads
    assert [len(h) for h in result.kept[0][1]] == [budget] * cfg.num_kv_heads


def test_decode_time_compression_refuses_sliding_layers(gemma3):
    from dge_jax.eviction.decode_spec import DecodeCompression

    ev = Eviction(SnapKV(window=4), budget=16, decode=DecodeCompression(budget=16, interval=4))
    with pytest.raises(ValueError, match="sliding-window layers"):
        dge_jax.generate_grid(gemma3, _prompts(gemma3.config.vocab_size), [ev], max_new_tokens=4)


@pytest.mark.parametrize("name", ["gemma3", "gemma2"])
def test_pallas_gives_the_xla_tokens_on_sliding_layers(checkpoint, name):
    """The Pallas kernels (prefill flash with its probs sums, decode) take the layers' windows
    (traced: one compile for the scanned group) and Gemma's logit scale (and Gemma 2's soft
    cap): FullKV, a DGE(2)-SnapKV eviction and a prefill H2O eviction (the probs-sums kernel)
    give attention='xla''s tokens and kept sets."""
    model = dge_jax.load(checkpoint(name))
    prompts = _prompts(model.config.vocab_size)
    cells = [None, Eviction(SnapKV(window=4), budget=12, timing=dge(2)),
             Eviction(H2O(window=4), budget=12, timing=prefill())]  # fmt: skip
    xla, pallas = (dge_jax.generate_grid(model, prompts, cells, max_new_tokens=NEW, chunk=16,
                                         attention=a)
                   for a in ("xla", "pallas"))  # fmt: skip
    for cell, want, got in zip(cells, xla, pallas, strict=True):
        assert got.tokens == want.tokens, cell
        assert got.kept == want.kept, cell
