"""The draft-based family beside DGE: `dge_d` (the drafted queries alone) and `lookahead`
(LAQ's two stages), on the tiny random Llama of the eviction tests.

What they must show: a budget at or above the prompt gives FullKV's tokens under every rule;
every head keeps exactly its budget (uniform, AdaKV's layer pool, the global pool); dge_d's
and lookahead's kept sets equal NumPy references of SnapKV over the queries each observes
(LAQ: stage 1 at the looser budget and wider window, k steps on the compacted copy, stage 2
over the full cache); batched rows whose lookaheads stop apart (one at an EOS) get what they
get alone; and the refusals.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy_reference import ref_compact, ref_snapkv_keep
from test_eviction_generate import RULES, WINDOW  # every scoring rule, at the same window
from tiny_model import jax_model

from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.lookahead import onto_slots
from dge_jax.eviction.timing import Lookahead, Timing, dge_d, lookahead
from dge_jax.generation import generate, generate_for_contexts, generate_grid
from dge_jax.rules.h2o import H2O
from dge_jax.rules.snapkv import SnapKV
from dge_jax.rules.tova import TOVA
from dge_jax.runtime import decoding
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.recorders import QueryWindow, Recording
from dge_jax.text.prompts import prepare
from dge_jax.text.sampling import Greedy

L, HQ, HKV, VOCAB = 2, 4, 2, 128
NEW = 6
CAP = 64  # shared compacted capacity (one compilation of the decode loop)
LENGTHS = (44, 30)
PROMPTS = [np.random.default_rng(n).integers(0, VOCAB, n).tolist() for n in LENGTHS]
STAGE = Lookahead(budget=20, window=12)  # a looser first stage for 30- and 44-token prompts
DGE_D3, LAQ3 = Timing("dge_d", 3), Timing("lookahead", 3, lookahead=STAGE)


@pytest.fixture(scope="module")
def model():
    return jax_model()


@pytest.fixture(scope="module")
def full_tokens(model):
    return generate(model, PROMPTS, max_new_tokens=NEW).tokens


def ev_(rule, budget, timing, **options) -> Eviction:
    return Eviction(rule, budget, timing, capacity=CAP, **options)


# ---------------------------------------------------------------------------------------------
# Timing


def test_timing_properties_and_refusals():
    assert dge_d(3) == DGE_D3 and DGE_D3.draft_steps == 2
    assert DGE_D3.observes_drafts and not DGE_D3.observes_prompt
    assert lookahead(3, 20, 12) == LAQ3 and LAQ3.draft_steps == 0 and LAQ3.observes_drafts
    assert Timing("lookahead", 8).lookahead == Lookahead(512, 32)  # LAQ's defaults
    with pytest.raises(ValueError, match="dge_d observes only the k - 1 drafted"):
        Timing("dge_d", 1)
    with pytest.raises(ValueError, match="lookahead's first stage"):
        Timing("dge", 2, lookahead=Lookahead())
    with pytest.raises(ValueError, match="Lookahead.budget must be an integer >= 1"):
        Lookahead(budget=0)
    with pytest.raises(ValueError, match="slides DGE's window"):
        Timing("dge_d", 3, slide=True)
    with pytest.raises(ValueError, match="adaptive k needs timing dge or dge_w"):
        from dge_jax.eviction.timing import Adaptive

        Timing("lookahead", 3, adaptive=Adaptive())
    from dge_jax.eviction.decode_spec import DecodeCompression

    with pytest.raises(ValueError, match="does not also compress while decoding"):
        Eviction(SnapKV(), 64, LAQ3, decode=DecodeCompression(64, 8))


# ---------------------------------------------------------------------------------------------
# Budget >= prompt: nothing is evicted


@pytest.mark.parametrize("budget", [50, max(LENGTHS)], ids=["above", "equal"])
def test_budget_holding_the_prompt_gives_fullkv(model, full_tokens, budget):
    """Every rule (AdaKV, global and masking too) under dge_d and lookahead keeps every
    prompt entry (and dge_d its drafts) and answers FullKV's tokens."""
    cells = [ev_(rule, budget, t) for rule in RULES for t in (DGE_D3, LAQ3)]
    cells += [ev_(SnapKV(window=WINDOW), budget, t, head_budget=hb)
              for hb in ("adakv", "global") for t in (DGE_D3, LAQ3)]  # fmt: skip
    cells += [ev_(H2O(window=WINDOW), budget, t, compact=False) for t in (DGE_D3, LAQ3)]
    for ev, res in zip(cells, generate_grid(model, PROMPTS, cells, max_new_tokens=NEW),
                       strict=True):  # fmt: skip
        assert res.tokens == full_tokens, ev
        for row, n in enumerate(LENGTHS):
            everything = set(range(n + ev.timing.draft_steps))
            assert all(set(h) == everything for layer in res.kept[row] for h in layer), ev


# ---------------------------------------------------------------------------------------------
# Budgets


def test_every_head_keeps_exactly_its_budget(model, full_tokens):
    """Uniform: every head exactly `budget` (dge_d's drafts among them); AdaKV: each layer's
    pool exactly Hkv x budget; global: the whole cache L x Hkv x budget. The first answer token
    is FullKV's under both timings."""
    budget = 16
    cells = [ev_(rule, budget, t, head_budget=hb)
             for rule, hb in ((SnapKV(window=WINDOW), "uniform"), (H2O(window=WINDOW), "uniform"),
                              (TOVA(), "uniform"), (SnapKV(window=WINDOW), "adakv"),
                              (SnapKV(window=WINDOW), "global"))
             for t in (DGE_D3, LAQ3)]  # fmt: skip
    results = generate_grid(model, PROMPTS, cells, max_new_tokens=NEW)
    for ev, res in zip(cells, results, strict=True):
        assert [r[0] for r in res.tokens] == [r[0] for r in full_tokens], ev
        for row, n in enumerate(LENGTHS):
            kept = res.kept[row]
            drafts = set(range(n, n + ev.timing.draft_steps))
            sizes = np.array([[len(h) for h in layer] for layer in kept])
            assert all(drafts <= set(h) for layer in kept for h in layer), ev
            if ev.head_budget == "uniform":
                assert (sizes == budget).all(), (ev, row)
            elif ev.head_budget == "adakv":
                assert (sizes.sum(1) == HKV * budget).all() and len(set(sizes.flat)) > 1, ev
            else:
                assert sizes.sum() == L * HKV * budget and len(set(sizes.flat)) > 1, ev
    # the timings choose differently (else the checks above prove little)
    assert results[0].kept != results[1].kept


# ---------------------------------------------------------------------------------------------
# NumPy references of the selections


def _prefill(model, prompts, window):
    """(request, prefill output recording the last `window` queries, FullKV's first token)."""
    request = prepare(model.tokenizer, model.config, prompts, max_new_tokens=NEW)
    pre = decoding.prefill_prompt(
        model.forward, model.config, model.params, jnp.asarray(request.tokens),
        jnp.asarray(request.lengths),
        decoding.PrefillSpec(request.tokens.shape[1] + request.buffer, request.chunk,
                             Recording.of(QueryWindow(window))),
    )  # fmt: skip
    return request, pre, jnp.argmax(pre.logits, -1).astype(jnp.int32)


def _steps(model, request, state, n):
    """n greedy steps one at a time: their queries [L, B, Hq, n, D] and positions [B, n]
    (-1 where the row had finished)."""
    step = jax.jit(functools.partial(
        decoding.decode_body, model.forward, model.config, model.params,
        spec=decoding.StepSpec(Greedy(), request.eos_ids, recording=Recording.of(QueryWindow(1))),
    ))  # fmt: skip
    qs, q_pos = [], []
    for _ in range(n):
        active, now = ~np.asarray(state.done), np.asarray(state.pos)
        state, out = step(state)
        qs.append(np.asarray(out.recorded[0][:, :, :, 0]))
        q_pos.append(np.where(active, now, -1))
    return state, np.stack(qs, axis=3), np.stack(q_pos, axis=1)


def _ref_keep(k, pos, q, q_pos, budget, rule):
    """ref_snapkv_keep over every layer and row: [L, B, Hkv, S] bool."""
    return np.stack([np.stack([ref_snapkv_keep(k[i, r], pos[i, r], q[i, r], q_pos[r], budget,
                                               rule, HQ // HKV) for r in range(k.shape[1])])
                     for i in range(k.shape[0])])  # fmt: skip


def _positions(keep, pos):
    return [[[sorted(int(p) for p in pos[i, r, h][keep[i, r, h]]) for h in range(pos.shape[2])]
             for i in range(pos.shape[0])] for r in range(pos.shape[1])]  # fmt: skip


def test_dge_d_kept_sets_match_snapkv_over_the_draft_queries_alone(model):
    """dge_d(3) at budget 14: SnapKV scored in NumPy with the 2 drafted queries as its only
    window (nothing of the prompt protected) keeps what dge_d keeps; dge and dge_w keep
    something else."""
    rule, budget = SnapKV(window=WINDOW, kernel=3), 14
    cells = [ev_(rule, budget, Timing(kind, 3)) for kind in ("dge_d", "dge", "dge_w")]
    got = generate_grid(model, PROMPTS, cells, max_new_tokens=NEW)
    request, pre, first = _prefill(model, PROMPTS, WINDOW)
    state = decoding.start_state(pre.cache, first, jnp.asarray(request.lengths), NEW,
                                 request.eos_ids, jax.random.PRNGKey(0), buffer=request.buffer)
    state, q, q_pos = _steps(model, request, state, 2)
    k, pos = np.asarray(state.cache.k), np.asarray(state.cache.pos)
    want = _positions(_ref_keep(k, pos, q, q_pos, budget, rule), pos)
    assert got[0].kept == want
    assert got[1].kept != want and got[2].kept != want


def test_lookahead_kept_sets_match_a_numpy_reference_of_laq(model):
    """LAQ with SnapKV, k = 3: stage 1 keeps NumPy-SnapKV's choice at budget 20 over the last 12
    prompt queries; 3 greedy steps on that compacted copy from FullKV's first token give the
    lookahead queries; stage 2 keeps NumPy-SnapKV's choice at budget 14 over the last 8 prompt
    queries plus those 3, from the full prefill cache. Then the answer decodes from the first
    token over exactly that selection."""
    rule, budget = SnapKV(window=WINDOW, kernel=3), 14
    ev = ev_(rule, budget, LAQ3)
    got = generate_grid(model, PROMPTS, [ev, ev_(rule, budget, Timing("prefill", 1))],
                        max_new_tokens=NEW)  # fmt: skip
    request, pre, first = _prefill(model, PROMPTS, STAGE.window)
    k, v, pos = (np.asarray(x) for x in (pre.cache.k, pre.cache.v, pre.cache.pos))
    q, q_pos = np.asarray(pre.obs.q), np.asarray(pre.obs.q_pos)
    stage1 = SnapKV(window=STAGE.window, kernel=3)
    keep1 = _ref_keep(k, pos, q, q_pos, STAGE.budget, stage1)
    nk, nv, npos, index = ref_compact(k, v, pos, keep1, CAP + 3)
    copy = KVCache.stacked(jnp.asarray(nk), jnp.asarray(nv), jnp.asarray(npos), index)
    state = decoding.start_state(copy, first, jnp.asarray(request.lengths), NEW,
                                 request.eos_ids, jax.random.PRNGKey(0), buffer=request.buffer)
    _, q_look, look_pos = _steps(model, request, state, LAQ3.k)
    q2 = np.concatenate([q[:, :, :, -WINDOW:], q_look], axis=3)
    q2_pos = np.concatenate([q_pos[:, -WINDOW:], look_pos], axis=1)
    want = _positions(_ref_keep(k, pos, q2, q2_pos, budget, rule), pos)
    assert got[0].kept == want
    assert got[0].kept != got[1].kept  # the lookahead moved the selection


def test_batched_rows_whose_lookaheads_stop_apart_get_what_they_get_alone(model):
    """An extra EOS that row 0 samples in its lookahead (and row 1 never does): row 0 stops
    its lookahead there, row 1 runs all k steps; each row's kept sets and tokens equal its
    run alone. Under H2O too, whose lookahead attention is moved onto the full cache."""
    seen = []  # per lookahead run: (its tokens [B, N], its step counters [B])

    def hook(stage, fn, *args, **kwargs):
        out = fn(*args, **kwargs)
        if stage == "lookahead":
            seen.append((np.asarray(out[0].tokens), np.asarray(out[0].step)))
        return out

    k = 4
    cells = [ev_(rule, 14, Timing("lookahead", k, lookahead=STAGE))
             for rule in (SnapKV(window=WINDOW), H2O(window=WINDOW))]  # fmt: skip
    generate_grid(model, PROMPTS, cells[:1], max_new_tokens=NEW, hook=hook)
    look = seen[0][0]  # [B, N]: t1, then SnapKV's lookahead tokens
    eos = next(int(t) for t in look[0, 2 : k + 1] if t not in look[1, : k + 1])
    run = functools.partial(generate_grid, model, cells=cells, max_new_tokens=NEW,
                            extra_eos_ids=(eos,), hook=hook)  # fmt: skip
    seen.clear()
    both = run(PROMPTS)
    steps = seen[0][1]  # SnapKV's lookahead (H2O's first stage chooses otherwise)
    assert steps[0] < steps[1] == k + 1  # row 0 stopped its lookahead early
    for row, prompt in enumerate(PROMPTS):
        alone = run([prompt])
        for a, b in zip(alone, both, strict=True):
            assert a.kept[0] == b.kept[row] and a.tokens[0] == b.tokens[row]


def test_onto_slots_moves_attention_by_position():
    """Hand-made: copy slots hold positions [5, 2, 9(own), -1]; the full cache's slots hold
    [0, 1, 2, 3, 4, 5]; attention on 5 and 2 lands on full slots 5 and 2, the rest drops."""
    probs = jnp.asarray([0.1, 0.2, 0.3, 0.4], jnp.float32).reshape(1, 1, 1, 1, 4)
    seen = jnp.asarray([5, 2, 9, -1], jnp.int32).reshape(1, 1, 1, 4)
    full = jnp.arange(6, dtype=jnp.int32).reshape(1, 1, 1, 6)
    out = np.asarray(onto_slots(probs, seen, full)).ravel()
    np.testing.assert_allclose(out, [0, 0, 0.2, 0, 0, 0.1])


# ---------------------------------------------------------------------------------------------
# Shared contexts


def test_lookahead_continues_the_context(model):
    """generate_for_contexts: a lookahead cell compresses the context alone (query-agnostic);
    at a budget holding the context its answers are FullKV's, below it they differ."""
    ctx = [PROMPTS[0][:36], PROMPTS[1][:24]]
    questions = [[PROMPTS[0][36:], [7, 8, 9]], [PROMPTS[1][24:], [10, 11]]]
    cells = [None, ev_(SnapKV(window=WINDOW), 40, LAQ3), ev_(SnapKV(window=WINDOW), 10, LAQ3)]
    out = generate_for_contexts(model, ctx, questions, cells, max_new_tokens=NEW)
    assert [r.tokens for r in out[1]] == [r.tokens for r in out[0]]
    assert [r.tokens for r in out[2]] != [r.tokens for r in out[0]]
    assert all(len(h) == 10 for h in out[2][0].kept[0][0])
