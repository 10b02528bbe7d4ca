"""Decoding-time compression (`dge_jax.eviction.decode_compression`): equality with FullKV when the
budget holds everything, SnapKV's kept sets after every compression against a step-by-step
NumPy reference of the same rule, masked = compacted logits, StreamingLLM's exact kept
sets, flat memory in the answer length, composition with every timing, and the refusals."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy_reference import ref_compact, ref_snapkv_keep
from tiny_model import jax_model

import dge_jax
from dge_jax.eviction import decode_compression
from dge_jax.eviction.decode_spec import DecodeCompression
from dge_jax.eviction.evict import Eviction, SelectionSpec
from dge_jax.eviction.timing import Timing
from dge_jax.rules.h2o import H2O
from dge_jax.rules.registry import make_rule
from dge_jax.rules.snapkv import SnapKV
from dge_jax.rules.streamingllm import StreamingLLM
from dge_jax.runtime import decoding
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.recorders import QueryWindow, Recording
from dge_jax.text.prompts import cut_at_eos, prepare
from dge_jax.text.sampling import Greedy

NEW = 30  # answer tokens


@pytest.fixture(scope="module")
def model():
    return jax_model()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(3, 128, 36).tolist(), rng.integers(3, 128, 21).tolist()]


def recorded(model, prompts, ev):
    """`generate` with `ev`, recording what every decode-time compression kept."""
    return dge_jax.generate(model, prompts, max_new_tokens=NEW, eviction=ev,
                            record_compressions=True)  # fmt: skip


@pytest.fixture(scope="module")
def full_tokens(model, prompts):
    return dge_jax.generate(model, prompts, max_new_tokens=NEW).tokens


@pytest.mark.parametrize(
    "rule, timing",
    [
        (SnapKV(window=4), Timing("decode")),  # nothing evicted before decoding
        (H2O(window=4), Timing("dge", 2)),  # carried attention sums, after a draft
        (make_rule("expectedattention"), Timing("prefill")),
    ],
    ids=["snapkv-decode", "h2o-dge", "expectedattention-prefill"],
)
def test_budget_holding_everything_gives_fullkv_tokens(model, prompts, full_tokens, rule, timing):
    """decode budget >= prompt + max_new_tokens: every compression keeps everything, so the
    tokens are FullKV's (rows of different lengths, finishing together)."""
    big = 36 + NEW
    ev = Eviction(rule, big, timing, decode=DecodeCompression(budget=big, interval=8))
    out = recorded(model, prompts, ev)
    assert out.tokens == full_tokens
    # 29 decode steps after the first token (28 under dge(2), one drafted): 4 blocks of 8
    assert len(out.compressions[0]) == 4


@pytest.mark.slow
@pytest.mark.parametrize(
    "ev",
    [
        Eviction(SnapKV(window=4), 16, Timing("decode"), decode=DecodeCompression(16, 6)),
        Eviction(H2O(window=4), 24, Timing("dge", 2), decode=DecodeCompression(16, 5)),
    ],
    ids=["snapkv-decode", "h2o-dge"],
)
def test_batched_rows_finishing_apart_get_what_they_get_alone(model, prompts, ev):
    """Rows of different lengths, one stopping early on an EOS: in a batch each row gets the
    tokens and the compressions it gets alone (a finished row's cache is left as it was)."""
    plain = dge_jax.generate(model, prompts, max_new_tokens=NEW, eviction=ev).tokens
    eos = next(t for t in plain[0][8:] if t not in plain[1])  # only row 0 will stop
    run = functools.partial(dge_jax.generate, model, max_new_tokens=NEW, eviction=ev,
                            extra_eos_ids=(eos,), record_compressions=True)  # fmt: skip
    both = run(prompts)
    assert len(both.tokens[0]) < NEW == len(both.tokens[1])
    for row, prompt in enumerate(prompts):
        alone = run([prompt])
        assert alone.tokens[0] == both.tokens[row]
        assert alone.compressions[0] == both.compressions[row]


# ---------------------------------------------------------------------------------------------
# A step-by-step reference of the loop: decode steps one at a time, SnapKV scored in NumPy
# (float64) from the cache and the block's queries, kept sets compacted in NumPy
# (`numpy_reference.ref_snapkv_keep`, `ref_compact`).


def test_snapkv_kept_sets_match_step_by_step_numpy_reference(model, prompts):
    """Timing "decode" (the prompt first evicted with the cache): after every compression,
    the kept positions equal the NumPy reference's, and so do the tokens; at one
    compression the compacted cache and the full-size cache masked to the same entries
    give the same next logits."""
    rule, budget, interval = SnapKV(window=4, kernel=3), 20, 6
    spec = DecodeCompression(budget=budget, interval=interval)
    ev = Eviction(rule, budget, Timing("decode"), decode=spec)
    out = recorded(model, prompts, ev)

    cfg, params = model.config, model.params
    request = prepare(model.tokenizer, model.config, prompts, max_new_tokens=NEW)
    tokens, lengths = jnp.asarray(request.tokens), jnp.asarray(request.lengths)
    t = request.tokens.shape[1]
    pre = decoding.prefill_prompt(
        model.forward, cfg, params, tokens, lengths,
        decoding.PrefillSpec(t + request.buffer, chunk=request.chunk),
    )  # fmt: skip
    first = jnp.argmax(pre.logits, -1).astype(jnp.int32)
    state = decoding.start_state(
        pre.cache, first, lengths, NEW, request.eos_ids, jax.random.PRNGKey(0),
        buffer=request.buffer,
    )  # fmt: skip
    step = jax.jit(
        functools.partial(
            decoding.decode_body, model.forward, cfg, params,
            spec=decoding.StepSpec(Greedy(), request.eos_ids,
                                   recording=Recording.of(QueryWindow(1))),
        )  # fmt: skip
    )
    capacity, groups = spec.capacity(), cfg.num_heads // cfg.num_kv_heads
    events, checked_masking = [], False
    while not bool(np.all(state.done)):
        qs, q_pos = [], []
        for _ in range(interval):
            if bool(np.all(state.done)):
                break
            active, pos_now = ~np.asarray(state.done), np.asarray(state.pos)
            state, fwd = step(state)
            qs.append(np.asarray(fwd.recorded[0][:, :, :, 0]))
            q_pos.append(np.where(active, pos_now, -1))
        q = np.stack(qs, axis=3)  # [L, B, Hq, W, D]
        q_pos = np.stack(q_pos, axis=1)  # [B, W]
        cache = state.cache
        k, v, pos = (np.asarray(x) for x in (cache.k, cache.v, cache.pos))
        keep = np.stack([
            np.stack([ref_snapkv_keep(k[i, r], pos[i, r], q[i, r], q_pos[r], budget, rule,
                                      groups) for r in range(k.shape[1])])
            for i in range(k.shape[0])
        ])  # fmt: skip
        nk, nv, npos, index = ref_compact(k, v, pos, keep, capacity)
        compacted = KVCache.stacked(jnp.asarray(nk), jnp.asarray(nv), jnp.asarray(npos), index)
        if not checked_masking and not bool(np.all(state.done)):
            masked = cache.with_pos(jnp.asarray(np.where(keep, pos, -1)))
            logits = [
                step(decoding.DecodeState(**{**vars(state), "cache": c}))[1].logits
                for c in (masked, compacted)
            ]
            np.testing.assert_allclose(logits[0], logits[1], atol=1e-5)
            checked_masking = True
        state = decoding.DecodeState(**{**vars(state), "cache": compacted})
        events.append((np.asarray(state.step), npos))
    assert checked_masking and len(events) == -(-(NEW - 1) // interval)
    for row in range(len(prompts)):
        got = out.compressions[row]
        want = [
            [[sorted(int(p) for p in head if p >= 0) for head in layer] for layer in npos[:, row]]
            for _, npos in events
        ]
        assert [e["kept"] for e in got] == want[: len(got)]
        assert [e["step"] for e in got] == [int(s[row]) for s, _ in events][: len(got)]
    ref_tokens = decoding.decode_loop(  # finish nothing: the state is done, tokens are final
        model.forward, cfg, params, state, decoding.StepSpec(Greedy(), request.eos_ids)
    ).tokens
    ids = cut_at_eos(np.asarray(ref_tokens)[:, :NEW], request.eos_ids)
    assert ids == out.tokens


def test_streamingllm_keeps_sinks_and_most_recent_after_every_compression(model, prompts):
    """StreamingLLM composed with prefill-time eviction at a larger budget: after each
    compression every head holds the 4 sinks and the newest budget - 4 positions."""
    budget, interval = 16, 5
    ev = Eviction(StreamingLLM(), 24, Timing("prefill"),
                  decode=DecodeCompression(budget=budget, interval=interval))  # fmt: skip
    out = recorded(model, prompts, ev)
    lengths = [len(p) for p in prompts]
    for row, events in enumerate(out.compressions):
        assert events, "no compression ran"
        for e in events:
            # step answer tokens exist; the first step - 1 were fed, at len .. len + step - 2
            newest = lengths[row] + e["step"] - 2
            want = [0, 1, 2, 3, *range(newest - (budget - 4) + 1, newest + 1)]
            assert all(head == want for layer in e["kept"] for head in layer), (row, e["step"])


def test_cache_bytes_flat_in_answer_length(model, prompts):
    """The loop's final cache has the spec's capacity however many tokens are generated;
    FullKV's grows with them."""
    spec = DecodeCompression(budget=16, interval=8)
    request = prepare(model.tokenizer, model.config, prompts, max_new_tokens=64)
    sizes = {}
    for new in (16, 64):
        pre = decoding.prefill_prompt(
            model.forward, model.config, model.params, jnp.asarray(request.tokens),
            jnp.asarray(request.lengths), decoding.PrefillSpec(request.tokens.shape[1] + new),
        )  # fmt: skip
        state = decoding.start_state(
            pre.cache, jnp.argmax(pre.logits, -1).astype(jnp.int32),
            jnp.asarray(request.lengths), new, (), jax.random.PRNGKey(0),
        )  # fmt: skip
        full_bytes = state.cache.nbytes()
        loop = decode_compression.CompressionLoop(
            model.forward, model.config, Greedy(), (),
            SelectionSpec(StreamingLLM(), head_cap=spec.head_cap()), 8, spec.capacity(),
        )  # fmt: skip
        state, _, _ = decode_compression.decode_compressed(
            loop, model.params, state, jnp.int32(16)
        )
        assert int(np.min(state.step)) == new
        sizes[new] = (full_bytes, state.cache.nbytes(), state.cache.capacity)
    assert sizes[16][1] == sizes[64][1] and sizes[64][2] == spec.capacity() == 16 + 8
    assert sizes[64][0] > sizes[16][0]


def test_an_eviction_names_its_selection_once():
    """`SelectionSpec.for_eviction`: the spec the select stage and the decode loop build from
    a cell (head budgets, alpha, ties, the timing's slide), with a sweep's rules or a cap."""
    ev = Eviction(SnapKV(window=4), 32, Timing("dge", 2, slide=True), head_budget="adakv",
                  alpha=0.3, ties="earlier")  # fmt: skip
    spec = SelectionSpec.for_eviction(ev, head_cap=48)
    assert spec == SelectionSpec(ev.rule, "adakv", 0.3, "earlier", head_cap=48, slide=True)
    sweep = (SnapKV(window=4), make_rule("pyramidkv", window=4))
    assert SelectionSpec.for_eviction(ev, sweep) == SelectionSpec(
        sweep, "adakv", 0.3, "earlier", slide=True
    )


def test_adakv_heads_stay_under_their_cap(model, prompts):
    """AdaKV at decode time: per-head counts differ, each layer's pool stays the budget's,
    and no head exceeds the cap the fixed capacity leaves (`head_cap`)."""
    spec = DecodeCompression(budget=16, interval=4)
    ev = Eviction(SnapKV(window=4), 16, Timing("decode"), head_budget="adakv", decode=spec)
    out = recorded(model, prompts, ev)
    counts = np.array([[[len(h) for h in layer] for layer in e["kept"]]
                       for e in out.compressions[0][1:]])  # fmt: skip
    assert counts.max() <= spec.head_cap(spread=True)
    assert np.all(counts.sum(-1) <= 16 * counts.shape[-1])
    assert len(np.unique(counts)) > 1  # the allocator moved entries between heads


def test_decode_budgets_of_one_bucket_share_one_compiled_loop(model, prompts):
    """The decode budget is traced: budgets 20 and 28 (head cap 32 both) compile the loop
    once, and keep what each asks for."""
    fn = decode_compression.decode_compressed
    runs = {}
    before = None
    for budget in (20, 28):
        ev = Eviction(SnapKV(window=4), budget, Timing("decode"),
                      decode=DecodeCompression(budget, interval=6))  # fmt: skip
        runs[budget] = recorded(model, prompts, ev)
        before = fn._cache_size() if before is None else before
    assert fn._cache_size() == before
    for budget, out in runs.items():
        last = out.compressions[0][-1]["kept"]
        assert {len(h) for layer in last for h in layer} == {budget}


@pytest.mark.parametrize(
    "ev, match",
    [
        (Eviction(make_rule("kvzip"), 64, Timing("prefill"), decode=DecodeCompression(64, 8)),
         "no decode-time form"),
        (Eviction(SnapKV(window=8), 64, Timing("prefill"), decode=DecodeCompression(12, 8)),
         "decode budget 12 is smaller"),
        (Eviction(SnapKV(), 64, Timing("decode")), "needs Eviction.decode"),
        (Eviction(SnapKV(window=4), 64, Timing("decode"), decode=DecodeCompression(32, 8)),
         "budget = decode budget"),
        (Eviction(SnapKV(window=4), 64, Timing("prefill"), compact=False,
                  decode=DecodeCompression(32, 8)), "compacts the cache"),
    ],
    ids=["kvzip", "budget", "no-spec", "decode-budget", "masked"],
)  # fmt: skip
def test_refusals_name_the_problem(model, prompts, ev, match):
    with pytest.raises(ValueError, match=match):
        dge_jax.generate(model, prompts, max_new_tokens=8, eviction=ev)
