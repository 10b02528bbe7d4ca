"""`dge_jax.generate` beyond parity: compile-once buckets, sampling, EOS handling.

Greedy parity with transformers lives in test_parity.py; here the model is the tiny untied
GQA llama of conftest, and references are our own greedy decode and teacher-forced logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dge_jax
from dge_jax.runtime import decoding, stacking
from dge_jax.text.prompts import bucket_length, pad_left
from dge_jax.text.sampling import Greedy, Sampling

# Most tests share prompts of lengths (20, 13) -> bucket 32 and N new tokens, so the jitted
# prefill compiles once for the module and each sampler compiles only its decode loop.
LENGTHS = (20, 13)
N = 16


@pytest.fixture(scope="module")
def model(checkpoint):
    return dge_jax.load(checkpoint("llama"))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, seed=5)


@pytest.fixture(scope="module")
def greedy(model, prompts) -> list[list[int]]:
    """Greedy tokens for `prompts` (no EOS: the model has no tokenizer)."""
    tokens = dge_jax.generate(model, prompts, max_new_tokens=N).tokens
    assert [len(t) for t in tokens] == [N, N]
    return tokens


def random_prompts(lengths, seed=0, vocab=128):
    rng = np.random.RandomState(seed)
    return [rng.randint(1, vocab, n).tolist() for n in lengths]


def teacher_forced(model, prompts, generated) -> list[np.ndarray]:
    """Per row, [N, V] logits that predicted each generated token (one forward pass)."""
    seqs = [p + g[:-1] for p, g in zip(prompts, generated, strict=True)]
    t = max(map(len, seqs))
    tokens, lengths = pad_left(seqs, t)
    logits = decoding.teacher_forced_logits(
        model.forward, model.config, model.params, jnp.asarray(tokens), jnp.asarray(lengths)
    )
    logits = np.asarray(logits)
    return [logits[i, t - len(g) :] for i, g in enumerate(generated)]


# ---------------------------------------------------------------------------------------------
# Buckets and compilation


def test_bucket_length():
    assert [bucket_length(n) for n in (1, 10, 16, 17, 20, 25, 30, 32)] == [16] * 3 + [32] * 5
    assert [bucket_length(n) for n in (300, 512, 513, 1500)] == [512, 512, 1024, 1536]
    assert bucket_length(40, chunk=16) == 48


def test_prompt_lengths_in_one_bucket_compile_once(model):
    """Prompts of 20, 25 and 30 tokens share bucket 32: prefill and decode compile once each.

    A fresh forward function (a static argument of the jitted functions) guarantees a cold
    cache whatever other tests compiled; it also counts how often JAX traces the model.
    """
    traced = []

    def counting_forward(cfg, params, tokens, *args, **kwargs):
        traced.append(tuple(tokens.shape))
        return model.family.forward(cfg, params, tokens, *args, **kwargs)

    counted = dataclasses.replace(
        model, family=dataclasses.replace(model.family, forward=counting_forward)
    )

    def cache_sizes():
        return decoding.prefill_prompt._cache_size(), decoding.decode_loop._cache_size()

    lengths = (20, 25, 30)
    assert {bucket_length(n) for n in lengths} == {32}
    before = cache_sizes()
    results = []
    for i, prompt in enumerate(random_prompts(lengths, seed=1)):
        results.append(dge_jax.generate(counted, [prompt], max_new_tokens=8))
        if i == 0:
            first, traced_first = cache_sizes(), list(traced)
            assert first == (before[0] + 1, before[1] + 1)
            # prefill traced the model on the bucket ([1, 32]), decode on one token ([1, 1])
            assert (1, 32) in traced and (1, 1) in traced
    assert cache_sizes() == first
    assert traced == traced_first  # no retrace for 25 and 30 tokens
    assert all(len(r.tokens[0]) == 8 for r in results)


@pytest.mark.parametrize("chunk", [24, 384])
def test_bucket_is_a_multiple_of_any_chunk(chunk):
    """`prefill` needs the padded length to be a multiple of min(chunk, length).

    Fails today: for n <= chunk `bucket_length` returns the next power of two, which for a
    chunk that is not a power of two is neither a multiple of the chunk nor below it
    (chunk 24, n 20 -> 32; chunk 384, n 300 -> 512), so `generate(..., chunk=24)` raises
    "prompt length 32 is not a multiple of the prefill chunk 24".
    """
    for n in range(1, 3 * chunk):
        t = bucket_length(n, chunk)
        assert t >= n and t % min(chunk, t) == 0, (n, t)


def test_generate_with_a_chunk_that_is_not_a_power_of_two(model, prompts, greedy):
    """The same bug end to end (see test_bucket_is_a_multiple_of_any_chunk)."""
    assert dge_jax.generate(model, prompts, max_new_tokens=N, chunk=24).tokens == greedy


def test_chunk_size_does_not_change_tokens(model, prompts, greedy):
    """chunk 8: the prompt bucket becomes 24 and prefill runs three chunks."""
    assert dge_jax.generate(model, prompts, max_new_tokens=N, chunk=8).tokens == greedy


# ---------------------------------------------------------------------------------------------
# Sampling


def test_sampling_is_reproducible_and_differs_across_seeds(model, prompts, greedy):
    sampler = Sampling(temperature=1.0, top_k=20, top_p=0.9)

    def run(seed):
        return dge_jax.generate(model, prompts, max_new_tokens=N, sampler=sampler, seed=seed)

    a, b, c = run(3), run(3), run(4)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    assert a.tokens != greedy


@pytest.mark.parametrize("seed", [0, 7])
def test_top_k_1_equals_greedy(model, prompts, greedy, seed):
    sampler = Sampling(temperature=1.5, top_k=1)
    out = dge_jax.generate(model, prompts, max_new_tokens=N, sampler=sampler, seed=seed)
    assert out.tokens == greedy


def test_generated_tokens_stay_in_the_top_k(model, prompts):
    """Every sampled token is among the k best of the logits that chose it."""
    k = 5
    sampler = Sampling(temperature=2.0, top_k=k)
    out = dge_jax.generate(model, prompts, max_new_tokens=N, sampler=sampler, seed=11)
    chosen_ranks = []
    for logits, tokens in zip(teacher_forced(model, prompts, out.tokens), out.tokens, strict=True):
        top = np.argsort(-logits, axis=-1)[:, :k]
        assert all(t in top[s] for s, t in enumerate(tokens)), (tokens, top)
        chosen_ranks += [list(top[s]).index(t) for s, t in enumerate(tokens)]
    assert len(set(chosen_ranks)) > 1  # it really sampled, not just argmax


def _nucleus(logits: np.ndarray, temperature: float, top_p: float) -> set[int]:
    """Tokens whose preceding probability mass (sorted descending) is below top_p."""
    z = logits / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    return set(order[before < top_p].tolist())


def test_generated_tokens_stay_in_the_nucleus(model, prompts):
    sampler = Sampling(temperature=1.0, top_p=0.5)
    out = dge_jax.generate(model, prompts, max_new_tokens=N, sampler=sampler, seed=5)
    sizes = []
    for logits, tokens in zip(teacher_forced(model, prompts, out.tokens), out.tokens, strict=True):
        for s, t in enumerate(tokens):
            nucleus = _nucleus(logits[s], 1.0, 0.5)
            sizes.append(len(nucleus))
            assert t in nucleus, (s, t, sorted(nucleus))
    assert max(sizes) > 1 and max(sizes) < model.config.vocab_size // 2


def _draws(sampler, logits, n: int = 400) -> np.ndarray:
    """[n, B] tokens: `sampler` on logits [B, V] tiled n times (rows draw independently)."""
    b = logits.shape[0]
    tokens = sampler(jnp.tile(logits, (n, 1)), jax.random.PRNGKey(0))
    return np.asarray(tokens).reshape(n, b)


def test_sampler_never_leaves_top_k_or_nucleus():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 64)) * 2, jnp.float32)
    top5 = np.argsort(-np.asarray(logits), axis=-1)[:, :5]
    draws = _draws(Sampling(temperature=3.0, top_k=5), logits)
    for b in range(3):
        assert set(draws[:, b].tolist()) == set(top5[b].tolist())  # all of them, nothing else
    draws = _draws(Sampling(temperature=1.0, top_p=0.6), logits)
    for b in range(3):
        nucleus = _nucleus(np.asarray(logits[b]), 1.0, 0.6)
        assert set(draws[:, b].tolist()) <= nucleus and len(nucleus) > 1
    draws = _draws(Sampling(temperature=0.7, top_k=1), logits)
    assert (draws == np.asarray(logits).argmax(-1)).all()
    greedy = Greedy()(logits, jax.random.PRNGKey(1))
    assert greedy.dtype == jnp.int32 and (np.asarray(greedy) == top5[:, 0]).all()


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)]
)
def test_bad_sampling_parameters(kwargs):
    with pytest.raises(ValueError, match="temperature|top_k|top_p"):
        Sampling(**kwargs)


# ---------------------------------------------------------------------------------------------
# EOS


def test_generation_stops_at_eos_and_keeps_it(model, prompts, greedy):
    """Each row ends at its first EOS (included); rows that never emit it run to the limit."""
    eos = next(t for t in greedy[0][2:] if t not in greedy[0][:2])  # first emitted at step >= 2
    out = dge_jax.generate(model, prompts, max_new_tokens=N, extra_eos_ids=[eos]).tokens
    for row, got in zip(greedy, out, strict=True):
        want = row[: row.index(eos) + 1] if eos in row else row
        assert got == want
    assert out[0][-1] == eos and len(out[0]) < N


def test_eos_as_first_token_stops_at_once(model, prompts, greedy):
    first = greedy[0][0]
    out = dge_jax.generate(model, prompts, max_new_tokens=N, extra_eos_ids=[first]).tokens
    assert out[0] == [first]
    assert out[1] == (greedy[1][: greedy[1].index(first) + 1] if first in greedy[1] else greedy[1])


def test_a_single_new_token_is_the_prefill_argmax(model, prompts, greedy):
    out = dge_jax.generate(model, prompts, max_new_tokens=1)
    assert out.tokens == [row[:1] for row in greedy]


# ---------------------------------------------------------------------------------------------
# Layer groupings: one scanned group of all layers vs one group per layer


def test_scan_and_unrolled_layer_loops_decode_the_same(model, prompts):
    """decode's two layer groupings are one computation: same tokens, same final cache (up
    to float summation order), each back in the grouping it was given."""
    cfg, params = model.config, model.params
    tokens, lengths = pad_left(prompts, 32)
    pre = decoding.prefill_prompt(
        model.forward, cfg, params, jnp.asarray(tokens), jnp.asarray(lengths),
        decoding.PrefillSpec(48),
    )
    first = jnp.argmax(pre.logits, axis=-1).astype(jnp.int32)
    finals = {}
    for loop in ("scan", "unrolled"):
        start = decoding.start_state(
            pre.cache, first, jnp.asarray(lengths), N, (), jax.random.PRNGKey(0)
        )
        start = jax.tree.map(jnp.copy, start)  # decode donates its state: one copy per loop
        finals[loop] = decoding.decode_loop(
            model.forward, cfg, params, start, decoding.StepSpec(Greedy(), ()), layer_loop=loop
        )
    scan, unrolled = finals["scan"], finals["unrolled"]
    np.testing.assert_array_equal(np.asarray(unrolled.tokens), np.asarray(scan.tokens))
    assert unrolled.cache.group_sizes == scan.cache.group_sizes == (cfg.num_layers,)
    np.testing.assert_array_equal(np.asarray(unrolled.cache.pos), np.asarray(scan.cache.pos))
    np.testing.assert_allclose(np.asarray(unrolled.cache.k), np.asarray(scan.cache.k), atol=1e-5)
    np.testing.assert_allclose(np.asarray(unrolled.cache.v), np.asarray(scan.cache.v), atol=1e-5)


@pytest.mark.parametrize("batch", [1, 2])
def test_compiled_decode_loop_copies_no_cache_buffer(model, batch):
    """The decode loop updates its cache buffers in place: its compiled body holds no copy
    of a cache-sized array. (XLA:CPU copied every batch-1 buffer 2-4 times per step while
    attention read the buffer its write had just produced; see
    dge_jax.kernels.layer_attention.cache_layer_attention.)"""
    import re

    cfg = model.config
    slots = 40
    cache = dge_jax.runtime.cache.init_cache(
        cfg.num_layers, batch, cfg.num_kv_heads, slots, cfg.head_dim
    )
    state = decoding.start_state(cache, jnp.ones((batch,), jnp.int32), jnp.full((batch,), 8), 4,
                                 (), jax.random.PRNGKey(0))  # fmt: skip
    for loop in ("scan", "unrolled"):
        hlo = decoding.decode_loop.lower(
            model.forward, cfg, model.params, state, decoding.StepSpec(Greedy(), ()),
            layer_loop=loop,
        ).compile().as_text()  # fmt: skip
        # A layer's buffer [B, Hkv, S, D], or a group's [Lg, B, Hkv, S, D] (any Lg).
        buffer = rf"f32\[(?:\d+,)?{batch},{cfg.num_kv_heads},{slots},{cfg.head_dim}\]"
        copies = re.findall(rf"= {buffer}\{{[\d,]*\}} copy\(", hlo)
        # Copies outside the loop (the unrolled loop's one regrouping) are allowed: count
        # those of the while body only, the largest computation with "region" in its name.
        bodies = [c for c in re.split(r"\n(?=\S)", hlo) if "region" in c.split("\n")[0]]
        body = max(bodies, key=len)
        in_loop = re.findall(rf"= {buffer}\{{[\d,]*\}} copy\(", body)
        assert in_loop == [], f"{loop}: {len(in_loop)} cache copies per step ({len(copies)} in all)"


@pytest.mark.parametrize("grouping", ["one layer each", "first alone"])
def test_forward_over_any_layer_grouping_equals_the_one_group_forward(model, prompts, grouping):
    """The same forward over the same layers in other groups (`regroup`): same logits, same
    queries, and a cache holding the same entries, in the grouping it was given."""
    from dge_jax.runtime.cache import init_cache, regroup
    from dge_jax.runtime.recorders import QueryWindow, Recording

    cfg = model.config
    nl = cfg.num_layers
    sizes = (1,) * nl if grouping == "one layer each" else (1, nl - 1)
    tokens, lengths = pad_left(prompts, 32)
    positions = decoding.prompt_positions(jnp.asarray(lengths), 32)
    cache = init_cache(nl, 2, cfg.num_kv_heads, 40, cfg.head_dim)
    args = (jnp.asarray(tokens), positions)
    window = Recording.of(QueryWindow(4))
    one = model.forward(cfg, model.params, *args, cache, logits="all", recording=window)
    grouped = model.forward(
        cfg, model.params, *args, regroup(cache, sizes), logits="all", recording=window
    )
    assert grouped.cache.group_sizes == sizes and one.cache.group_sizes == (nl,)
    assert (grouped.cache.num_layers, grouped.cache.batch_size, grouped.cache.capacity) == (
        one.cache.num_layers, one.cache.batch_size, one.cache.capacity)  # fmt: skip
    assert grouped.cache.nbytes() == one.cache.nbytes()
    np.testing.assert_array_equal(grouped.cache.num_kept(), one.cache.num_kept())
    np.testing.assert_array_equal(grouped.cache.index, one.cache.index)
    np.testing.assert_allclose(np.asarray(grouped.logits), np.asarray(one.logits), atol=1e-4)
    np.testing.assert_allclose(np.asarray(grouped.recorded[0]), np.asarray(one.recorded[0]),
                               atol=1e-5)  # fmt: skip
    for name in ("k", "v", "pos"):
        got, want = getattr(grouped.cache, name), getattr(one.cache, name)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    back = regroup(grouped.cache, (nl,))
    assert back.group_sizes == (nl,)
    np.testing.assert_array_equal(np.asarray(back.pos), np.asarray(one.cache.pos))


def test_unknown_layer_loop_is_a_clear_error(model, prompts):
    state = decoding.start_state(
        dge_jax.runtime.cache.init_cache(model.config.num_layers, 1, model.config.num_kv_heads, 8,
                                 model.config.head_dim),
        jnp.zeros((1,), jnp.int32), jnp.asarray([4]), 2, (), jax.random.PRNGKey(0),
    )  # fmt: skip
    with pytest.raises(ValueError, match="layer_loop must be 'scan' or 'unrolled'"):
        decoding.decode_loop(
            model.forward, model.config, model.params, state, decoding.StepSpec(Greedy(), ()),
            layer_loop="python",
        )  # fmt: skip


def test_split_rows_undoes_stack_states(model):
    """stack_states interleaves the members' rows; split_rows gives each member its own."""
    cfg = model.config
    states = []
    for c in range(3):
        cache = dge_jax.runtime.cache.init_cache(
            cfg.num_layers, 2, cfg.num_kv_heads, 8, cfg.head_dim
        )
        first = jnp.asarray([10 * c + 1, 10 * c + 2], jnp.int32)
        states.append(decoding.start_state(cache, first, jnp.full((2,), 4), 3, (),
                                           jax.random.PRNGKey(0)))  # fmt: skip
    stacked = stacking.stack_states(states)
    for got, state in zip(stacking.split_rows(np.asarray(stacked.tokens), 3), states, strict=True):
        np.testing.assert_array_equal(got, np.asarray(state.tokens))
    assert np.asarray(stacked.tokens)[:, 0].tolist() == [1, 11, 21, 2, 12, 22]


# ---------------------------------------------------------------------------------------------
# The pipeline's stages and its hook


def test_the_hook_sees_every_stage_in_order_and_changes_nothing(model, prompts, greedy):
    """generate_grid runs its jitted steps through the hook, in pipeline order; a single cell
    decodes its own state (no stack_states copy); tokens equal the hook-free call's."""
    from dge_jax.eviction.evict import Eviction
    from dge_jax.eviction.timing import Timing
    from dge_jax.generation import STAGES, generate_grid
    from dge_jax.rules.snapkv import SnapKV

    seen = []

    def hook(stage, fn, *args, **kwargs):
        seen.append(stage)
        return fn(*args, **kwargs)

    single = dge_jax.generate(model, prompts, max_new_tokens=N, hook=hook)
    assert seen == ["prefill", "decode"] and single.tokens == greedy
    seen.clear()
    cells = [None, Eviction(SnapKV(window=4), 12, Timing("dge", 2)),
             Eviction(SnapKV(window=4), 16, Timing("dge", 2))]  # fmt: skip
    with_hook = generate_grid(model, prompts, cells, max_new_tokens=N, hook=hook)
    plain = generate_grid(model, prompts, cells, max_new_tokens=N)
    assert [r.tokens for r in with_hook] == [r.tokens for r in plain]
    assert with_hook[0].tokens == greedy
    # one draft, one rewind (same k), one scoring for both budgets, one eviction per cell,
    # then a stack and a decode per cache shape
    assert seen[:5] == ["prefill", "draft", "rewind", "keep_masks", "apply_eviction"]
    assert seen.count("keep_masks") == 1 and seen.count("apply_eviction") == 2
    assert seen.count("stack_states") == seen.count("decode") >= 1
    assert set(seen) <= set(STAGES)
    order = [STAGES.index(s) for s in dict.fromkeys(seen)]
    assert order == sorted(order)
