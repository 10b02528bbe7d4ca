"""KVzip (`dge_jax.rules.kvzip`) against a NumPy transcription of kvpress's ``KVzipPress``: the
repeat prompts of ``prepare``, the max cross-attention of ``score_kvzip`` (sinks, chunk,
causal repeat tokens), its sinks and its global / layerwise allocations, on a tiny random
Llama with a hand-made character tokenizer; left padding, several chunks, prompts with and
without the template's prefix, and the pipeline under every timing."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import jax_model

from dge_jax import generation
from dge_jax.eviction import grid_plan
from dge_jax.eviction.budgets import adakv_budgets, global_budgets
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import Timing
from dge_jax.rules import kvzip
from dge_jax.rules.kvzip import KVzip, Reconstruction
from dge_jax.runtime import decoding
from dge_jax.runtime.recorders import QueryWindow, Recording
from dge_jax.runtime.records import Observation

VOCAB = 128


class CharTokenizer:
    """One id per character (mod the vocabulary); a chat template around one user turn."""

    chat_template = "<S>sys|user:{content}|end|asst:"
    eos_ids = ()

    def __init__(self, template: bool = True):
        if not template:
            self.chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(int(i)) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.chat_template.format(content=messages[0]["content"])

    def encode_chat(self, messages) -> list[int]:
        return self.encode(self.apply_chat_template(messages))


@pytest.fixture(scope="module")
def model():
    return jax_model(tokenizer=CharTokenizer())


def prompt(text: str, template: bool = True) -> list[int]:
    tok = CharTokenizer()
    return tok.encode_chat(text) if template else tok.encode(text)


# ------------------------------------------------------------------------------ references


def prepare_reference(ids: list[int], tok, rec: Reconstruction) -> list[tuple[int, int, list]]:
    """kvpress KVzipPress.prepare (+ __call__'s prefix/suffix): (start, end, repeat ids)."""
    if tok.chat_template is None:
        prefix, suffix = "", "\n"
    else:
        sep = "\n" + "#" * len("dummy context")
        text = tok.apply_chat_template([{"role": "user", "content": "dummy context" + sep}])
        context, suffix = text.split(sep)
        prefix = context.split("dummy context")[0]
    n_prefix = len(tok.encode(prefix))
    suffix_ids = tok.encode(suffix)
    ctx = ids[n_prefix:]
    size = rec.chunk_size
    chunks = [ctx[i * size : (i + 1) * size] for i in range((len(ctx) - 1) // size + 1)]
    out, start = [], n_prefix
    for i, a in enumerate(chunks):
        if i == 0:
            q = tok.encode("\n\nRepeat the previous context exactly.")
        else:
            q = tok.encode("\n\nRepeat the part of the previous context exactly, starting with")
            q = q + chunks[i - 1][-rec.repeat_tail :]
        out.append((start, start + len(a), q + suffix_ids + a))
        start += len(a)
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def scores_reference(model, ids: list[int], chunks: list[tuple[int, int, list]], sinks: int):
    """kvpress score_kvzip for one prompt: score_val [L, Hkv, n] (0 where never repeated).

    Per chunk (start, end, repeat ids), the repeat tokens' queries and keys come from one
    causal prefill of prompt + repeat ids (what the cache plus the repeat pass compute), cut
    out with NumPy as kvpress does: keys of the sinks, the chunk and the repeat tokens."""
    cfg = model.config
    g = cfg.num_heads // cfg.num_kv_heads
    score = np.zeros((cfg.num_layers, cfg.num_kv_heads, len(ids)), np.float32)
    for start, end, repeat in chunks:
        seq, r = ids + repeat, len(repeat)
        pre = decoding.prefill_prompt(
            model.forward, cfg, model.params, jnp.asarray([seq], jnp.int32),
            jnp.asarray([len(seq)], jnp.int32),
            decoding.PrefillSpec(len(seq), len(seq), Recording.of(QueryWindow(r))),
        )  # fmt: skip
        q = np.asarray(pre.obs.q)[:, 0].reshape(cfg.num_layers, cfg.num_kv_heads, g, r, -1)
        keys = np.asarray(pre.cache.k)[:, 0]  # [L, Hkv, n + r, D]
        sink = min(sinks, start)
        sub = np.concatenate([keys[:, :, :sink], keys[:, :, start:end], keys[:, :, -r:]], 2)
        logits = np.einsum("lkgtd,lkwd->lkgtw", q, sub) / np.sqrt(cfg.head_dim)
        logits[..., -r:][..., np.triu(np.ones((r, r), bool), 1)] = -np.inf  # causal repeat
        score[:, :, start:end] = softmax(logits)[..., sink : sink + end - start].max(axis=(2, 3))
    return score


def global_reference(scores: np.ndarray, budget: int) -> np.ndarray:
    """kvpress's layerwise=False counts: the L·Hkv·B highest of one row, per (layer, head)."""
    L, H, S = scores.shape
    flat = scores.reshape(-1)
    keep = np.argsort(-flat, kind="stable")[: L * H * budget]
    counts = np.zeros(L * H * S, int)
    counts[keep] = 1
    return counts.reshape(L, H, S).sum(-1)


# ---------------------------------------------------------------------------------- tests


def test_template_parts_and_repeat_prompts_follow_kvpress():
    tok = CharTokenizer()
    prefix, suffix = kvzip.template_parts(tok)
    assert prefix == tok.encode("<S>sys|user:") and suffix == tok.encode("|end|asst:")
    assert kvzip.template_parts(CharTokenizer(template=False)) == ([], tok.encode("\n"))
    rec = Reconstruction(sinks=4, chunk_size=9, repeat_tail=3)
    rows = [prompt("abcdefghijklmnopqrstuvwxyz"), prompt("0123456789AB", template=False)]
    chunks = kvzip.repeat_chunks(tok, rows, rec, bucket=512)
    # Row 1 does not start with the template's prefix: dge_jax repeats it from position 0
    # (kvpress, whose contexts always carry the template, would skip the prefix's length).
    expected = [prepare_reference(rows[0], tok, rec), _from_zero(rows[1], tok, rec)]
    for b in range(2):
        got = [
            (int(c.lo[b]), int(c.hi[b]), c.tokens[b, c.tokens.shape[1] - c.lengths[b] :].tolist())
            for c in chunks if c.hi[b] > c.lo[b]
        ]  # fmt: skip
        assert got == expected[b]
    assert len(chunks) == 4  # 26 letters + the 10-token turn end, in chunks of 9


def _from_zero(ids, tok, rec):
    """prepare_reference for a prompt without the template's prefix (context from 0)."""
    shifted = tok.encode("<S>sys|user:") + ids
    n = len(tok.encode("<S>sys|user:"))
    return [(s - n, e - n, r) for s, e, r in prepare_reference(shifted, tok, rec)]


@pytest.mark.parametrize("chunk_size", [2048, 11])
def test_reconstruction_scores_equal_reference_with_left_padding(model, chunk_size):
    rec = Reconstruction(sinks=4, chunk_size=chunk_size, repeat_tail=3)
    rows = [prompt("the quick brown fox jumps over"), prompt("lazy dogs", template=False)]
    t = 64
    tokens, lengths = np.zeros((2, t), np.int32), np.array([len(r) for r in rows], np.int32)
    for b, ids in enumerate(rows):
        tokens[b, t - len(ids) :] = ids
    pre = decoding.prefill_prompt(
        model.forward, model.config, model.params, jnp.asarray(tokens), jnp.asarray(lengths),
        decoding.PrefillSpec(t + 16, chunk=32),
    )  # fmt: skip
    scores, passes = kvzip.reconstruction_scores(
        model.forward, model.config, model.params, model.tokenizer, pre.cache, rows, rec,
        bucket=32,
    )  # fmt: skip
    scores, pos = np.asarray(scores), np.asarray(pre.cache.pos)
    assert passes == (1 if chunk_size == 2048 else 4)  # row 0: 30 tokens after its prefix
    tok = model.tokenizer
    chunk_lists = [prepare_reference(rows[0], tok, rec), _from_zero(rows[1], tok, rec)]
    for b, ids in enumerate(rows):
        ref = scores_reference(model, ids, chunk_lists[b], rec.sinks)
        slots = np.flatnonzero(pos[0, b, 0] >= 0)
        np.testing.assert_allclose(scores[:, b][:, :, slots], ref, rtol=2e-5, atol=1e-7)
        assert np.all(scores[:, b][:, :, pos[0, b, 0] < 0] == 0)  # padding never scores


def test_score_keeps_sinks_scores_template_prefix_zero_and_checks_shape():
    L, B, H, S = 1, 1, 1, 12
    pos = np.full((L, B, H, S), -1, np.int32)
    pos[..., 2:] = np.arange(10)  # two padding slots, then positions 0..9
    recon = np.linspace(0.1, 0.9, S, dtype=np.float32).reshape(L, B, H, S)
    from dge_jax.runtime.cache import KVCache

    zeros = jnp.zeros((L, B, H, S, 4))
    cache = KVCache.stacked(zeros, zeros, jnp.asarray(pos), S)
    obs = Observation(None, None, None, None, prompt_end=jnp.asarray([9]), recon=jnp.asarray(recon))
    got = np.asarray(KVzip(sinks=2).score(cache, obs))[0, 0, 0]
    assert np.all(np.isneginf(got[:2])) and np.all(np.isposinf(got[2:4]))
    np.testing.assert_allclose(got[4:], recon[0, 0, 0, 4:])
    with pytest.raises(ValueError, match="obs.recon has shape"):
        KVzip().score(cache, dataclasses.replace(obs, recon=jnp.zeros((1, 1, 1, 5))))
    with pytest.raises(ValueError, match="obs.recon"):
        KVzip().score(cache, dataclasses.replace(obs, recon=None))


def test_global_budgets_pool_every_layer_and_equal_adakv_on_one_layer():
    rng = np.random.default_rng(0)
    scores = rng.random((3, 2, 4, 20)).astype(np.float32)  # [L, B, Hkv, S], no ties
    scores[1, 0, :, 15:] = -np.inf  # empty slots never count
    got = np.asarray(global_budgets(jnp.asarray(scores), 5, alpha=0.0))
    for b in range(2):
        np.testing.assert_array_equal(got[:, b], global_reference(scores[:, b], 5))
    assert np.all(got.sum(axis=(0, 2)) == 3 * 4 * 5)
    floor = np.asarray(global_budgets(jnp.asarray(scores), 5, alpha=0.4))
    assert floor.min() >= 2 and np.all(floor.sum(axis=(0, 2)) == 60)
    one = jnp.asarray(scores[:1])
    np.testing.assert_array_equal(global_budgets(one, 5, 0.2), adakv_budgets(one, 5, 0.2))


def test_pipeline_dge_and_dge_w_keep_prefills_top_prompt_entries(model):
    """Query-free: DGE and DGE-W keep the same entries, and their prompt part is prefill's
    top (budget - drafts) entries, since drafts count against the budget."""
    rows = [
        "A long context to compress: " + "alpha beta gamma delta " * 4,
        "short one " * 3,
    ]
    rule = KVzip(chunk_size=40)
    cells = [
        Eviction(rule, 24, Timing("prefill")),
        Eviction(rule, 24, Timing("dge", 2)),
        Eviction(rule, 24, Timing("dge_w", 2)),
        Eviction(rule, 24, Timing("prefill"), head_budget="global", alpha=0.0),
    ]
    res = generation.generate_grid(model, rows, cells, max_new_tokens=4, chat=True)
    for b, ids in enumerate(res[0].prompt_tokens):
        n = len(ids)
        assert res[1].kept[b] == res[2].kept[b]
        for layer_pre, layer_dge in zip(res[0].kept[b], res[1].kept[b], strict=True):
            for pre, dge in zip(layer_pre, layer_dge, strict=True):
                prompt_part = [p for p in dge if p < n]
                assert set(prompt_part) <= set(pre)
                assert len(prompt_part) == min(n, 24 - (len(dge) - len(prompt_part)))
        if n > 24:
            pre = res[0].kept[b]
            assert all(len(h) == 24 for layer in pre for h in layer)
            assert all(set(range(4)) <= set(h) for layer in pre for h in layer)  # sinks
            total = sum(len(h) for layer in res[3].kept[b] for h in layer)
            assert total == 24 * model.config.num_layers * model.config.num_kv_heads


def test_grid_cells_must_share_one_reconstruction():
    cells = [Eviction(KVzip(chunk_size=64), 32), Eviction(KVzip(chunk_size=32), 32)]
    with pytest.raises(ValueError, match="one reconstruct stage"):
        grid_plan.GridRecording.of(cells)


def test_model_without_tokenizer_is_a_clear_error(model):
    bare = dataclasses.replace(model, tokenizer=None)
    with pytest.raises(ValueError, match="KVzip repeats the prompt with an instruction"):
        generation.generate(
            bare, [[1, 2, 3, 4, 5, 6, 7, 8]], max_new_tokens=2,
            eviction=Eviction(KVzip(), 8, Timing("prefill")),
        )  # fmt: skip
