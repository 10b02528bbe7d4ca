"""Parity with transformers on tiny random checkpoints of every family.

For each checkpoint variant (see conftest.VARIANTS) and a batch of two prompts of different
lengths, in f32:

- prefill logits (`teacher_forced_logits` over every position, and chunked `prefill`'s last
  logits) match transformers' forward within 1e-4;
- greedy `dge_jax.generate` (chunked prefill + the `decode` while_loop) of 32 tokens equals
  `transformers.generate(do_sample=False)`;
- decode steps taken one at a time on the cache (`decode_body`) pick the argmax of, and have
  the logits of, one teacher-forced forward over prompt + generated tokens (the "greedy
  decode equals teacher forcing" test).

The reference model is read back from the saved folder with `from_pretrained`, so both sides
interpret the same config.json (old-style keys included).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import dge_jax
from dge_jax.config import RopeConfig
from dge_jax.runtime import decoding
from dge_jax.text.prompts import bucket_length, pad_left
from dge_jax.text.sampling import Greedy

PARITY_VARIANTS = [
    "llama",
    "llama_linear_old",
    "llama3",
    "llama3_old",
    "mistral_old",
    "qwen2",
    "qwen3",
    "mistral_sliding",
    "qwen2_sliding",
    "gemma2",
    "gemma3",
]
LOGITS_TOL = 1e-4  # f32 on both sides: observed max |Δ| ~1e-6
NEW_TOKENS = 32
PREFILL_CHUNK = 8  # smaller than every prompt, so prefill runs several chunks

# What each variant must parse to: guards against a parity that holds only because both sides
# silently fell back to the same default (e.g. old rope keys read as "default" rope).
EXPECTED_CONFIG = {
    "llama": dict(num_kv_heads=2, head_dim=16, tie_word_embeddings=False, rope_kind="default"),
    "llama_linear_old": dict(
        num_kv_heads=4,
        head_dim=16,
        tie_word_embeddings=True,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        rope_kind="linear",
        rope_factor=2.0,
    ),
    "llama3": dict(num_kv_heads=1, rope_kind="llama3", rope_factor=8.0, rope_original_max=32),
    "llama3_old": dict(num_kv_heads=1, rope_kind="llama3", rope_factor=8.0, rope_original_max=32),
    "mistral_old": dict(num_kv_heads=2, rope_kind="default", rope_theta=1e6),
    "qwen2": dict(qkv_bias=True, o_bias=False, tie_word_embeddings=True, qk_norm=False),
    "qwen3": dict(head_dim=32, num_heads=4, qk_norm=True, qkv_bias=False),
    "mistral_sliding": dict(layer_windows=(8, 8)),
    "qwen2_sliding": dict(layer_windows=(0, 8), qkv_bias=True),
    "gemma2": dict(layer_windows=(8, 0), attn_scale=24**-0.5, attn_softcap=1.5,
                   final_softcap=3.0, tie_word_embeddings=True, qk_norm=False,
                   local_theta=None),  # fmt: skip
    "gemma3": dict(layer_windows=(8, 0), attn_scale=24**-0.5, attn_softcap=None, qk_norm=True,
                   rope_kind="linear", rope_factor=2.0, local_theta=100.0),  # fmt: skip
}


def prompt_lengths(name: str) -> tuple[int, int]:
    """Two different lengths; llama3 prompts run past original_max_position_embeddings=32."""
    return (60, 45) if name.startswith("llama3") else (20, 13)


def make_prompts(name: str, vocab: int) -> list[list[int]]:
    rng = np.random.RandomState(sum(map(ord, name)))
    return [rng.randint(0, vocab, n).tolist() for n in prompt_lengths(name)]


@functools.cache
def _hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@functools.cache
def _model(folder, dtype="float32"):
    return dge_jax.load(folder, dtype=dtype)


# The helpers below are cached per checkpoint: each computes one reference or one of our
# runs, and several tests read it, so the suite compiles each jitted function once per variant.


@functools.cache
def _hf_reference(name: str, folder) -> tuple[list[list[int]], list[np.ndarray]]:
    """transformers' greedy tokens [N] per row, and its logits [len + N - 1, V] per row over
    prompt + those tokens (one unpadded forward per row: the logits every step saw)."""
    hf = _hf_model(folder)
    tokens, logits = [], []
    for row in make_prompts(name, hf.config.vocab_size):
        ids = torch.tensor([row])
        with torch.no_grad():
            # An explicit mask: otherwise transformers masks every prompt token equal to the
            # pad id (0 here), and the reference itself is wrong.
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            new = out[0, len(row) :].tolist()
            assert len(new) == NEW_TOKENS
            tokens.append(new)
            logits.append(hf(torch.tensor([row + new[:-1]])).logits[0].numpy())
    return tokens, logits


@functools.cache
def _teacher_forced(name: str, folder) -> list[np.ndarray]:
    """Our `teacher_forced_logits` over the same prompt + reference tokens, one left-padded
    batch of two different lengths; per row [len + N - 1, V] with the padding cut off."""
    model = _model(folder)
    ref_tokens, _ = _hf_reference(name, folder)
    prompts = make_prompts(name, model.config.vocab_size)
    seqs = [p + g[:-1] for p, g in zip(prompts, ref_tokens, strict=True)]
    t = max(map(len, seqs))
    tokens, lengths = pad_left(seqs, t)
    logits = decoding.teacher_forced_logits(
        model.forward, model.config, model.params, jnp.asarray(tokens), jnp.asarray(lengths)
    )
    logits = np.asarray(logits)
    assert logits.dtype == np.float32 and logits.shape == (2, t, model.config.vocab_size)
    return [logits[i, t - len(s) :] for i, s in enumerate(seqs)]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _decode_step(forward, cfg, params, state):
    """One greedy decode step (the body of `decoding.decode_loop`), returning its logits [B, V]."""
    state, out = decoding.decode_body(forward, cfg, params, state, decoding.StepSpec(Greedy(), ()))
    return state, out.logits


@functools.cache
def _stepwise(name: str, folder) -> tuple[np.ndarray, np.ndarray]:
    """Chunked `prefill` then N-1 greedy `decode_body` steps on the cache, one at a time.

    Returns tokens [B, N] and the logits [B, N, V] that chose them (prefill's last logits
    first). The prompt is padded to a multiple of PREFILL_CHUNK, at least two chunks.
    """
    model = _model(folder)
    fwd, cfg, params = model.forward, model.config, model.params
    prompts = make_prompts(name, cfg.vocab_size)
    n = NEW_TOKENS
    t = bucket_length(max(map(len, prompts)), PREFILL_CHUNK)  # a multiple of the chunk
    assert t // PREFILL_CHUNK >= 2
    tokens, lengths = pad_left(prompts, t)
    lengths = jnp.asarray(lengths)
    # The same call as generate(..., chunk=PREFILL_CHUNK) makes, so the compilation is shared.
    pre = decoding.prefill_prompt(
        fwd,
        cfg,
        params,
        jnp.asarray(tokens),
        lengths,
        decoding.PrefillSpec(t + n, chunk=PREFILL_CHUNK),
    )
    first = jnp.argmax(pre.logits, axis=-1).astype(jnp.int32)
    state = decoding.start_state(pre.cache, first, lengths, n, (), jax.random.PRNGKey(0))
    step_logits = [pre.logits]
    for _ in range(n - 1):
        state, logits = _decode_step(fwd, cfg, params, state)
        step_logits.append(logits)
    return np.asarray(state.tokens), np.stack([np.asarray(x) for x in step_logits], axis=1)


@pytest.fixture(params=PARITY_VARIANTS)
def variant(request, checkpoint):
    """(name, folder, Model, prompts) for one parity variant."""
    folder = checkpoint(request.param)
    model = _model(folder)
    return request.param, folder, model, make_prompts(request.param, model.config.vocab_size)


def test_config_parses_to_the_intended_variant(variant):
    name, folder, model, _ = variant
    cfg = model.config
    got = dict(
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        tie_word_embeddings=cfg.tie_word_embeddings,
        qkv_bias=cfg.qkv_bias,
        o_bias=cfg.o_bias,
        mlp_bias=cfg.mlp_bias,
        qk_norm=cfg.qk_norm,
        rope_kind=cfg.rope.kind,
        rope_factor=cfg.rope.factor,
        rope_theta=cfg.rope.theta,
        rope_original_max=cfg.rope.original_max_position_embeddings,
        layer_windows=cfg.layer_windows,
        attn_scale=cfg.attn_scale,
        attn_softcap=cfg.attn_softcap,
        final_softcap=cfg.final_softcap,
        local_theta=cfg.local_rope and cfg.local_rope.theta,
    )
    want = EXPECTED_CONFIG[name]
    assert {k: got[k] for k in want} == want
    # transformers read the same rope kind from the same file (Gemma 3: the global layers')
    hf_rope = _hf_model(folder).config.rope_parameters
    hf_rope = hf_rope.get("full_attention", hf_rope)
    assert hf_rope["rope_type"] == cfg.rope.kind
    assert (model.params.lm_head is None) == cfg.tie_word_embeddings


def test_biases_and_norms_are_nontrivial(variant):
    """The checkpoints really carry non-zero biases and non-unit norms (see conftest)."""
    _, _, model, _ = variant
    layers = model.params.layers
    assert float(jnp.abs(layers.attn_norm - 1).max()) > 0.1
    for field in ("bq", "bk", "bv", "bo", "b_gate", "b_up", "b_down", "q_norm", "k_norm"):
        value = getattr(layers, field)
        if value is not None:
            ref = 1.0 if field.endswith("norm") else 0.0
            assert float(jnp.abs(value - ref).max()) > 0.1, field


def test_teacher_forced_logits_match_transformers(variant):
    """Every position of two left-padded sequences of different lengths (prompt + the
    reference's greedy continuation, 44 to 91 tokens)."""
    name, folder, _, prompts = variant
    ours = _teacher_forced(name, folder)
    _, ref = _hf_reference(name, folder)
    assert len({len(x) for x in ours}) == 2
    for i in range(len(prompts)):
        err = np.abs(ours[i] - ref[i]).max()
        assert err <= LOGITS_TOL, f"{name} row {i}: max |Δlogits| = {err:.2e}"


def test_chunked_prefill_last_logits_match_transformers(variant):
    name, folder, _, prompts = variant
    _, ours = _stepwise(name, folder)
    _, ref = _hf_reference(name, folder)
    for i, row in enumerate(prompts):
        err = np.abs(ours[i, 0] - ref[i][len(row) - 1]).max()
        assert err <= LOGITS_TOL, f"{name} row {i}: max |Δ prefill logits| = {err:.2e}"


def test_greedy_generation_matches_transformers(variant):
    name, folder, model, prompts = variant
    result = dge_jax.generate(model, prompts, max_new_tokens=NEW_TOKENS, chunk=PREFILL_CHUNK)
    ref_tokens, _ = _hf_reference(name, folder)
    assert result.prompt_tokens == prompts
    for i in range(len(prompts)):
        assert len(result.tokens[i]) == NEW_TOKENS
        assert result.tokens[i] == ref_tokens[i], f"{name} row {i}"


def test_decode_steps_equal_teacher_forced_forward(variant):
    """Greedy decode on the cache equals one teacher-forced pass over prompt + its tokens:
    same tokens (argmax at every step) and the same logits at every step."""
    name, folder, _, prompts = variant
    tokens, step_logits = _stepwise(name, folder)  # [B, N], [B, N, V]
    ref_tokens, _ = _hf_reference(name, folder)
    # The stepwise tokens are the reference's, so _teacher_forced ran over prompt + them.
    np.testing.assert_array_equal(tokens, np.asarray(ref_tokens))
    for i, row in enumerate(prompts):
        tf = _teacher_forced(name, folder)[i][len(row) - 1 :]  # [N, V]: predicts token s
        np.testing.assert_array_equal(tf.argmax(-1), tokens[i])
        err = np.abs(tf - step_logits[i]).max()
        assert err <= LOGITS_TOL, f"{name} row {i}: decode vs teacher-forced {err:.2e}"


def test_llama3_scaling_changes_logits_beyond_original_context(checkpoint):
    """The llama3 parity above is not vacuous: default RoPE gives clearly different logits."""
    folder = checkpoint("llama3")
    model = _model(folder)
    prompts = make_prompts("llama3", model.config.vocab_size)
    ref_tokens, _ = _hf_reference("llama3", folder)
    seqs = [p + g[:-1] for p, g in zip(prompts, ref_tokens, strict=True)]
    t = max(map(len, seqs))
    tokens, lengths = pad_left(seqs, t)
    plain_cfg = dataclasses.replace(model.config, rope=RopeConfig(theta=model.config.rope.theta))
    plain = decoding.teacher_forced_logits(
        model.forward, plain_cfg, model.params, jnp.asarray(tokens), jnp.asarray(lengths)
    )
    for i, scaled in enumerate(_teacher_forced("llama3", folder)):
        diff = np.abs(np.asarray(plain[i, t - len(seqs[i]) :]) - scaled)
        assert diff[40:].max() > 1e-2  # positions past original_max_position_embeddings=32


def test_sharded_checkpoint_loads_the_same_params(checkpoint):
    """A checkpoint saved in many shards (+ index) loads to exactly the single-file params."""
    sharded = checkpoint("llama_sharded")
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) >= 3
    assert (sharded / "model.safetensors.index.json").is_file()
    a = _model(sharded).params
    b = _model(checkpoint("llama")).params
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# bf16 weights and activations, f32 softmax and norms: observed max |Δ| ~0.045 on logits ~3.
BF16_TOL = 0.15


def test_bfloat16_loading_and_generation(checkpoint):
    folder = checkpoint("llama")
    m16 = _model(folder, "bfloat16")
    dtypes = {x.dtype for x in jax.tree_util.tree_leaves(m16.params)}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    # The f32 teacher-forced run of the parity tests, repeated with bf16 parameters.
    prompts = make_prompts("llama", m16.config.vocab_size)
    ref_tokens, _ = _hf_reference("llama", folder)
    seqs = [p + g[:-1] for p, g in zip(prompts, ref_tokens, strict=True)]
    t = max(map(len, seqs))
    tokens, lengths = pad_left(seqs, t)
    l16 = decoding.teacher_forced_logits(
        m16.forward, m16.config, m16.params, jnp.asarray(tokens), jnp.asarray(lengths)
    )
    assert l16.dtype == jnp.float32  # logits are f32 whatever the parameter dtype
    for i, l32 in enumerate(_teacher_forced("llama", folder)):
        err = np.abs(np.asarray(l16[i, t - len(seqs[i]) :]) - l32).max()
        assert err <= BF16_TOL, f"row {i}: bf16 vs f32 max |Δlogits| = {err:.3f}"
    result = dge_jax.generate(m16, prompts, max_new_tokens=8)
    assert [len(r) for r in result.tokens] == [8, 8]
    assert all(0 <= t < m16.config.vocab_size for row in result.tokens for t in row)
