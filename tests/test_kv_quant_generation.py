"""Generation and eviction on an int8 cache (`GenerationConfig.kv_quant`), on the tiny random
Llama of the eviction tests (peaked attention, so selections differ and argmaxes are far from
ties):

- decode on an int8 cache equals a teacher-forced forward over an int8 cache;
- a budget at or above the prompt gives the int8 FullKV's tokens under every timing (every
  rule, AdaKV, masking, the draft-based family, decode-time compression), keeping everything;
- below it, every head keeps exactly its budget, as on the plain cache;
- the int8 cache really is int8 (its bytes), and its answers stay near the plain cache's;
- generate_for_contexts extends an int8 cache as the whole prompt's forward would.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from kv_quant_checks import prefill_caches
from tiny_model import jax_model

from dge_jax.eviction.decode_spec import DecodeCompression
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import Lookahead, Timing
from dge_jax.generation import generate, generate_for_contexts, generate_grid
from dge_jax.rules.h2o import H2O
from dge_jax.rules.knorm import KeyNorm
from dge_jax.rules.pyramidkv import PyramidKV
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime import decoding
from dge_jax.runtime.quantized import Int8Entries
from dge_jax.text.prompts import pad_left

WINDOW, NEW, CAP = 8, 6, 64
LENGTHS = (44, 30)
PROMPTS = [np.random.default_rng(n).integers(0, 128, n).tolist() for n in LENGTHS]
STAGE = Lookahead(budget=20, window=12)
TIMINGS = (Timing("prefill"), Timing("dge", 3), Timing("dge_w", 3), Timing("dge_d", 3),
           Timing("lookahead", 3, lookahead=STAGE))  # fmt: skip
# What rules read, once each: the query window (PyramidKV shares SnapKV's scoring), the
# attention sums, the keys alone.
RULES = (SnapKV(window=WINDOW), PyramidKV(window=WINDOW), H2O(window=WINDOW), KeyNorm())
INT8 = dict(max_new_tokens=NEW, kv_quant="int8")


@pytest.fixture(scope="module")
def model():
    return jax_model()


@pytest.fixture(scope="module")
def full_int8(model):
    return generate(model, PROMPTS, **INT8)


def test_decode_on_int8_equals_a_teacher_forced_int8_forward(model, full_int8):
    """Every greedy token is the argmax of the teacher-forced logits over an int8 cache (each
    step reads its own entries quantized too), and those logits differ from the plain
    cache's, a little."""
    seqs = [p + g[:-1] for p, g in zip(PROMPTS, full_int8.tokens, strict=True)]
    t = max(map(len, seqs))
    tokens, lengths = pad_left(seqs, t)
    logits = np.asarray(decoding.teacher_forced_logits(
        model.forward, model.config, model.params, jnp.asarray(tokens), jnp.asarray(lengths),
        kv_quant="int8"))  # fmt: skip
    plain = np.asarray(decoding.teacher_forced_logits(
        model.forward, model.config, model.params, jnp.asarray(tokens), jnp.asarray(lengths)))
    for row, answer in enumerate(full_int8.tokens):
        steps = logits[row, t - len(answer) :]
        np.testing.assert_array_equal(steps.argmax(axis=-1), answer)
    # quantization moved the logits (it is really on), but not far
    gap = np.abs(logits - plain).max()
    assert 1e-6 < gap < 0.05 * np.abs(plain).max(), gap


def _cells(budget):
    cells = [Eviction(r, budget, t, capacity=CAP) for r in RULES for t in TIMINGS]
    cells += [Eviction(SnapKV(window=WINDOW), budget, t, capacity=CAP, head_budget="adakv")
              for t in TIMINGS[:3]]  # fmt: skip
    cells += [Eviction(H2O(window=WINDOW), budget, t, compact=False) for t in TIMINGS[:3]]
    return cells


def test_a_budget_at_the_prompt_is_int8_fullkv_under_every_timing(model, full_int8):
    results = generate_grid(model, PROMPTS, _cells(max(LENGTHS)), **INT8)
    for res in results:
        assert res.tokens == full_int8.tokens
    big = max(LENGTHS) + NEW
    decode = [Eviction(SnapKV(window=4), big, Timing("decode"),
                       decode=DecodeCompression(budget=big, interval=4)),
              Eviction(H2O(window=4), big, Timing("dge", 2),
                       decode=DecodeCompression(budget=big, interval=4))]  # fmt: skip
    for res in generate_grid(model, PROMPTS, decode, **INT8):
        assert res.tokens == full_int8.tokens


def test_every_head_keeps_exactly_its_budget_on_int8(model):
    budget = 12
    cells = [Eviction(r, budget, t, capacity=CAP) for r in RULES[:3] for t in TIMINGS[:3]]
    plain = generate_grid(model, PROMPTS, cells, max_new_tokens=NEW)
    quant = generate_grid(model, PROMPTS, cells, **INT8)
    for ev, p, q in zip(cells, plain, quant, strict=True):
        sizes = {len(h) for row in q.kept for layer in row for h in layer}
        if ev.rule.name != "pyramidkv":  # PyramidKV spreads the budget over layers
            assert sizes == {budget}, (ev, sizes)
        else:
            assert sum(len(h) for h in q.kept[0]) == sum(len(h) for h in p.kept[0])
    # int8 changes some selections or tokens (the scores read dequantized keys), not all
    assert any(p.kept != q.kept or p.tokens != q.tokens for p, q in zip(plain, quant,
                                                                         strict=True))  # fmt: skip
    same = sum(p.tokens == q.tokens for p, q in zip(plain, quant, strict=True))
    assert same >= len(cells) // 2, same


def test_the_int8_cache_holds_int8(model):
    (plain,) = prefill_caches(model, PROMPTS, max_new_tokens=NEW)
    (quant,) = prefill_caches(model, PROMPTS, **INT8)
    assert plain.kv_quant == "none" and quant.kv_quant == "int8"
    k = quant.groups[0].k
    assert isinstance(k, Int8Entries) and k.q.dtype == jnp.int8 and k.dtype == jnp.float32
    # per slot and head: D int8 values and one f32 scale for k and for v, one int32 position
    slots = plain.pos.size
    d = model.config.head_dim
    assert quant.nbytes() == slots * (2 * (d + 4) + 4)
    assert plain.nbytes() == slots * (2 * 4 * d + 4)


def test_contexts_extend_an_int8_cache_as_the_whole_prompt(model):
    rng = np.random.default_rng(3)
    ctx = [rng.integers(3, 128, n).tolist() for n in (40, 29)]
    qs = [[rng.integers(3, 128, n).tolist() for n in row] for row in ((5, 9), (7, 3))]
    out = generate_for_contexts(model, ctx, qs, [None], chunk=16, **INT8)
    for j in range(2):
        whole = generate(model, [c + q[j] for c, q in zip(ctx, qs, strict=True)], chunk=16,
                         **INT8)  # fmt: skip
        assert out[0][j].tokens == whole.tokens
