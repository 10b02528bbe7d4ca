"""Eviction on models with sliding-window layers (Gemma 2/3, Mistral v0.1, Qwen2 sliding).

The rule's budget applies to the global layers; a sliding layer keeps exactly the entries its
window still shows a later query (`evict.select_for_budgets`), so:

- a budget no smaller than the prompt reproduces FullKV's tokens under every timing, though
  the sliding layers drop what their window no longer shows;
- every head of a global layer keeps the budget, every sliding layer the last window - 1
  positions before the next query;
- compacted, a sliding layer's capacity follows its window, a global layer's the budget;
- compressing while decoding, every compression keeps the window on sliding layers.

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


def test_decode_time_compression_keeps_the_window_on_sliding_layers(gemma3):
    """Every compression keeps, on the sliding layer, the last window - 1 positions before the
    next query and, on the global layer, at most the budget; a budget over everything the
    answer writes reproduces FullKV."""
    from dge_jax.eviction.decode_spec import DecodeCompression

    prompts, window, new = _prompts(gemma3.config.vocab_size), gemma3.config.window(0), 24
    ev = Eviction(SnapKV(window=4), budget=16, decode=DecodeCompression(budget=16, interval=4))
    (result,) = dge_jax.generate_grid(gemma3, prompts, [ev], max_new_tokens=new,
                                      min_new_tokens=new, record_compressions=True)  # fmt: skip
    for row, prompt in enumerate(prompts):
        events = result.compressions[row]
        assert len(events) >= 4
        for event in events:
            next_pos = len(prompt) + event["step"] - 1  # the step-th answer token pending
            sliding, global_ = event["kept"]
            assert all(h == list(range(next_pos - window + 1, next_pos)) for h in sliding)
            assert all(len(h) <= 16 for h in global_)
    wide = DecodeCompression(budget=128, interval=4)
    cells = [None, Eviction(SnapKV(window=4), budget=128, decode=wide)]
    full, compressed = dge_jax.generate_grid(gemma3, prompts, cells, max_new_tokens=new)
    assert compressed.tokens == full.tokens



def test_decode_budget_under_the_window_holds_the_window_and_keeps_the_budget():
    """A decode budget under a sliding window (Gemma 3: 128 against 512) runs: the loop's one
    capacity holds the window (`DecodeCompression.window_floor`), every compression keeps the
    window's last entries on the sliding layer and at most the budget on the global one, and
    the extra slots change no token (the same cell with a larger floor answers the same)."""
    from dge_jax.eviction.decode_spec import DecodeCompression

    wide_window = jax_model(jax_config(layer_windows=(40, 0)))
    prompts, new = _prompts(wide_window.config.vocab_size, (60, 47)), 24
    cells = [Eviction(SnapKV(window=4), budget=16, decode=DecodeCompression(16, 4, floor))
             for floor in (0, 80)]  # fmt: skip
    out = dge_jax.generate_grid(wide_window, prompts, cells, max_new_tokens=new,
                                min_new_tokens=new, record_compressions=True)  # fmt: skip
    assert out[0].tokens == out[1].tokens
    for row, prompt in enumerate(prompts):
        events = out[0].compressions[row]
        assert len(events) >= 4
        for event in events:
            next_pos = len(prompt) + event["step"] - 1
            sliding, global_ = event["kept"]
            assert all(h == list(range(next_pos - 39, next_pos)) for h in sliding)
            assert all(len(h) <= 16 for h in global_)


def test_every_rule_keeps_the_window_and_the_budget(gemma3, tmp_path):
    """Every registered rule on the tiny Gemma 3, DGE k=2, one grid: a budget over the prompt
    gives FullKV's tokens; a small one keeps the budget per global head (PyramidKV's
    schedule runs over the global layers: one here, so the whole budget) and the window on
    the sliding layer. (With the tests' word-level tokenizer:
    KVzip encodes its repeat instruction.)"""
    import dataclasses

    from conftest import write_tokenizer

    from dge_jax.checkpoints.tokenizer import Tokenizer
    from dge_jax.rules.registry import RULES, make_rule, rule_fields

    write_tokenizer(tmp_path)
    gemma3 = dataclasses.replace(gemma3, tokenizer=Tokenizer.from_folder(tmp_path, {}))

    names = [n for n in sorted(RULES) if n != "full"]
    rules = [make_rule(n, **({"window": 4} if "window" in rule_fields(n) else {}))
             for n in names]  # fmt: skip
    prompts, budget = _prompts(gemma3.config.vocab_size), 12
    cells = [None] + [Eviction(r, budget=b, timing=dge(2)) for b in (64, budget) for r in rules]
    out = dge_jax.generate_grid(gemma3, prompts, cells, max_new_tokens=NEW, chunk=8)
    wide, small = out[1 : 1 + len(rules)], out[1 + len(rules) :]
    for name, result in zip(names, wide, strict=True):
        assert result.tokens == out[0].tokens, name
    for name, result in zip(names, small, strict=True):
        for row, prompt in enumerate(prompts):
            next_pos = len(prompt) + result.k[row] - 1
            sliding, global_ = result.kept[row]
            assert all(h == list(range(next_pos - 7, next_pos)) for h in sliding), name
            assert [len(h) for h in global_] == [budget] * len(global_), name


def test_the_option_to_evict_sliding_layers_too(gemma3):
    """Eviction(sliding="evict"): the sliding layer keeps the budget as well, chosen by the
    rule among the entries its window still shows; a budget over the prompt still gives
    FullKV's tokens."""
    prompts, budget, window = _prompts(gemma3.config.vocab_size), 5, gemma3.config.window(0)
    cells = [None, Eviction(SnapKV(window=2), budget=64, timing=dge(2), sliding="evict"),
             Eviction(SnapKV(window=2), budget=budget, timing=dge(2), sliding="evict")]  # fmt: skip
    full, wide, small = dge_jax.generate_grid(gemma3, prompts, cells, max_new_tokens=NEW, chunk=8)
    assert wide.tokens == full.tokens
    for row, prompt in enumerate(prompts):
        next_pos = len(prompt) + small.k[row] - 1
        sliding, global_ = small.kept[row]
        for head in sliding:
            assert len(head) == budget and min(head) >= next_pos - window + 1
        assert [len(h) for h in global_] == [budget] * len(global_)
    with pytest.raises(ValueError, match="sliding"):
        Eviction(SnapKV(), sliding="keep")


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
