"""One compressed cache per context, every question answered from it
(`dge_jax.generation.generate_for_contexts`, `dge_jax.runtime.extend`).

- FullKV's answers equal `generate` on context + question, for every question: feeding the
  question to the cache in one step (`extend`) and decoding is the whole prompt's forward;
- a budget >= the context reproduces FullKV under every timing (DGE and DGE-W prefill the
  anchor question and draft, then keep the whole context), on a Llama and on a tiny Gemma 3
  whose sliding layers keep the window the question will see;
- below it, every head keeps exactly the budget, all of it context positions; the prefill
  cell keeps what `generate_grid` keeps of the context alone;
- a question's answer does not depend on the other questions (each is fed to the same
  compressed cache, never to another's answer);
- bad input is refused by name;
- its cells are checked once before they are split into grids, and each grid's plan
  (`grid_plan.plan_grid`) checks them again unchanged (`check_cells` returns a checked cell
  as it is).
"""

from __future__ import annotations

import numpy as np
import pytest

import dge_jax
from dge_jax.eviction.decode_spec import DecodeCompression
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.grid_plan import check_cells
from dge_jax.eviction.timing import Timing, dge, dge_w, prefill
from dge_jax.generation import generate_for_contexts
from dge_jax.rules.full import FullKV
from dge_jax.rules.h2o import H2O
from dge_jax.rules.snapkv import SnapKV

NEW, CHUNK = 10, 16
TIMINGS = (prefill(), dge(2), dge_w(2))


@pytest.fixture(scope="module")
def llama(checkpoint):
    return dge_jax.load(checkpoint("llama"))


@pytest.fixture(scope="module")
def gemma3(checkpoint):
    return dge_jax.load(checkpoint("gemma3"))


def _rows(vocab: int, contexts=(40, 29), questions=((5, 9), (7, 3))):
    rng = np.random.default_rng(3)
    ctx = [rng.integers(3, vocab, n).tolist() for n in contexts]
    qs = [[rng.integers(3, vocab, n).tolist() for n in row] for row in questions]
    return ctx, qs


def _tokens(results):
    return [r.tokens for r in results]


def test_fullkv_answers_equal_the_whole_prompt(llama):
    ctx, qs = _rows(llama.config.vocab_size)
    out = generate_for_contexts(llama, ctx, qs, [None], max_new_tokens=NEW, chunk=CHUNK)
    for j in range(2):
        whole = dge_jax.generate(llama, [c + q[j] for c, q in zip(ctx, qs, strict=True)],
                                 max_new_tokens=NEW, chunk=CHUNK)  # fmt: skip
        assert out[0][j].tokens == whole.tokens
        assert out[0][j].prompt_tokens == whole.prompt_tokens


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_budget_of_the_whole_context_is_fullkv(family, request):
    model = request.getfixturevalue(family)
    ctx, qs = _rows(model.config.vocab_size)
    cells = [None] + [Eviction(rule, budget=48, timing=t)
                      for rule in (SnapKV(window=4), H2O()) for t in TIMINGS]  # fmt: skip
    out = generate_for_contexts(model, ctx, qs, cells, max_new_tokens=NEW, chunk=CHUNK)
    for i, cell in enumerate(out[1:], 1):
        assert _tokens(cell) == _tokens(out[0]), cells[i]
        for row, kept in enumerate(cell[0].kept):  # the whole context, nothing past it
            n = len(ctx[row])
            for layer, heads in enumerate(kept):  # a sliding layer: what the next query sees
                w = model.config.window(layer)
                want = list(range(n - w + 1 if w else 0, n))
                assert all(sorted(h) == want for h in heads), (cells[i], layer)


def test_below_the_context_every_head_keeps_the_budget_of_context(llama):
    ctx, qs = _rows(llama.config.vocab_size)
    budget = 16
    cells = [Eviction(SnapKV(window=4), budget=budget, timing=t) for t in TIMINGS]
    out = generate_for_contexts(llama, ctx, qs, cells, max_new_tokens=NEW, chunk=CHUNK)
    for cell in out:
        for row, kept in enumerate(cell[0].kept):
            for layer in kept:
                for head in layer:
                    assert len(head) == budget
                    assert max(head) < len(ctx[row])
    alone = dge_jax.generate_grid(llama, ctx, cells[:1], max_new_tokens=NEW, chunk=CHUNK)
    assert out[0][0].kept == alone[0].kept  # prefill timing: the context's own selection
    # DGE's draft changes what it keeps (else the drafted queries would not matter here)
    assert out[1][0].kept != out[2][0].kept


def test_each_question_is_answered_from_the_same_cache(llama):
    ctx, qs = _rows(llama.config.vocab_size, questions=((5, 9, 4), (7, 3, 6)))
    cells = [Eviction(SnapKV(window=4), budget=16, timing=t) for t in TIMINGS]
    both = generate_for_contexts(llama, ctx, [q[:2] for q in qs], cells, max_new_tokens=NEW,
                                 chunk=CHUNK)  # fmt: skip
    other = generate_for_contexts(llama, ctx, [[q[0], q[2]] for q in qs], cells,
                                  max_new_tokens=NEW, chunk=CHUNK)  # fmt: skip
    for a, b in zip(both, other, strict=True):
        assert _tokens([a[0]]) == _tokens([b[0]])  # the anchor's answer: same cache
        assert a[0].kept == b[0].kept
    # the prefill cell never sees a question: question 1 alone gives the same answer
    alone = generate_for_contexts(llama, ctx, [q[1:2] for q in qs], cells[:1],
                                  max_new_tokens=NEW, chunk=CHUNK)  # fmt: skip
    assert alone[0][0].tokens == both[0][1].tokens


def test_bad_input_is_refused_by_name(llama):
    ctx, qs = _rows(llama.config.vocab_size)
    snap = SnapKV(window=4)
    with pytest.raises(ValueError, match="same number"):
        generate_for_contexts(llama, ctx, [qs[0], qs[1][:1]], [None], max_new_tokens=NEW)
    with pytest.raises(ValueError, match="one list of questions per context"):
        generate_for_contexts(llama, ctx, qs[:1], [None], max_new_tokens=NEW)
    with pytest.raises(ValueError, match="anchor"):
        generate_for_contexts(llama, ctx, qs, [None], anchor=2, max_new_tokens=NEW)
    with pytest.raises(ValueError, match="chat template yourself"):
        generate_for_contexts(llama, ctx, qs, [None], chat=True, max_new_tokens=NEW)
    decoding = Eviction(snap, budget=16, timing=Timing("decode"),
                        decode=DecodeCompression(budget=16, interval=4))  # fmt: skip
    with pytest.raises(ValueError, match="cell 0 compresses while decoding"):
        generate_for_contexts(llama, ctx, qs, [decoding], max_new_tokens=NEW)
    # cells are checked as generate_grid checks them (grid_plan.check_cells), before anything
    # else reads them: an eviction not in a list, or a cell that is no Eviction, is named
    with pytest.raises(TypeError, match="cells must be a list"):
        generate_for_contexts(llama, ctx, qs, Eviction(snap, budget=16), max_new_tokens=NEW)
    with pytest.raises(TypeError, match=r"eviction \(cell 1\)"):
        generate_for_contexts(llama, ctx, qs, [None, "snapkv"], max_new_tokens=NEW)


def test_checked_cells_are_checked_again_unchanged():
    """generate_for_contexts checks its cells to split them into grids, then each grid's
    plan checks them again: a checked cell passes the second check as the same object
    (FullKV already None, a decode loop's window floor already raised), so the plan is the
    one a grid of the same cells would get from generate_grid."""
    snap = SnapKV(window=4)
    cells = [None, Eviction(FullKV(), budget=16), Eviction(snap, budget=16, timing=dge(2)),
             Eviction(snap, budget=16, decode=DecodeCompression(16, 4))]  # fmt: skip
    windows = (40, 0)
    once = check_cells(cells, NEW, windows)
    assert once[:2] == [None, None]
    assert once[3].decode.window_floor == 39  # raised to hold the window
    twice = check_cells(once, NEW, windows)
    assert all(a is b for a, b in zip(once, twice, strict=True))
