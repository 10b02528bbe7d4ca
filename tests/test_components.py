"""Each numerics component against its transformers (Llama) counterpart, on small random inputs.

RMSNorm (`models.llama_like.rms_norm`), RoPE (`dge_jax.runtime.rope`: default, linear and llama3
scaling), the gated MLP (`models.llama_like.mlp`) and attention over the padded cache
(`dge_jax.kernels.attention.cached_attention` / `written_slot_attention`) each match the module or
function in `transformers.models.llama.modeling_llama` within f32 rounding. The whole-model
parity (tests/test_parity.py) would catch a mismatch too, but not say which component it is.

Layouts: ours x [B, T, H, D] and cache [B, Hkv, S, D]; Hugging Face q [B, H, T, D], k/v
[B, Hkv, S, D]; ours weights [in, out], torch Linear [out, in].
"""

from __future__ import annotations

import math
import types

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("transformers.models.llama.modeling_llama")

from loose_attention import cached as cached_attention  # noqa: E402
from loose_attention import written as written_slot_attention  # noqa: E402

from dge_jax.config import RopeConfig  # noqa: E402
from dge_jax.runtime.rope import apply_rope, inverse_frequencies, rope_tables  # noqa: E402
from models.llama_like import mlp, rms_norm  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)  # f32 on both sides


def t2n(x) -> np.ndarray:
    return x.detach().float().numpy()


def n2t(x: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(x))


# ------------------------------------------------------------------------------ RMSNorm


def test_rms_norm_matches_llama_rms_norm_f32():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 32)).astype(np.float32) * 3
    w = (1 + 0.2 * rng.normal(size=32)).astype(np.float32)
    ref_mod = hf.LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ref_mod.weight.copy_(n2t(w))
        ref = t2n(ref_mod(n2t(x)))
    ours = rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-5)
    assert ours.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(ours), ref, **TOL)


def test_rms_norm_casts_back_to_input_dtype_before_the_weight():
    # bf16 activations, f32 weight: Hugging Face rounds the normalised x to bf16 *then*
    # multiplies by the f32 weight (result f32). Multiplying first would differ by up to a
    # bf16 rounding (~2^-9 relative), far above the f32 tolerance used here.
    rng = np.random.default_rng(1)
    x32 = rng.normal(size=(3, 64)).astype(np.float32) * 2
    w = (1 + 0.2 * rng.normal(size=64)).astype(np.float32)
    x_t = n2t(x32).to(torch.bfloat16)
    ref_mod = hf.LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ref_mod.weight.copy_(n2t(w))
        ref = ref_mod(x_t)
    assert ref.dtype == torch.float32
    x_bf16 = jnp.asarray(t2n(x_t)).astype(jnp.bfloat16)  # the same bf16 values
    ours = rms_norm(x_bf16, jnp.asarray(w), 1e-6)
    assert ours.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(ours), t2n(ref), rtol=1e-6, atol=1e-6)
    # The check discriminates: weight applied in f32 before the cast is measurably different.
    xf = t2n(x_t).astype(np.float32)
    normed = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
    assert np.abs(w * normed - t2n(ref)).max() > 1e-4

    # bf16 weight too (a bf16 model): the result stays bf16 and equals Hugging Face's.
    ref_mod = ref_mod.to(torch.bfloat16)
    with torch.no_grad():
        ref_bf16 = ref_mod(x_t)
    ours_bf16 = rms_norm(x_bf16, jnp.asarray(t2n(ref_mod.weight)).astype(jnp.bfloat16), 1e-6)
    assert ref_bf16.dtype == torch.bfloat16 and ours_bf16.dtype == jnp.bfloat16
    # Same f32 math then one bf16 rounding each: equal up to a rare one-ulp tie difference.
    np.testing.assert_allclose(
        np.asarray(ours_bf16.astype(jnp.float32)), t2n(ref_bf16), rtol=2**-7, atol=0
    )


# ------------------------------------------------------------------------------ RoPE

HEAD_DIM = 32
ROPE_CASES = {
    "default": (RopeConfig(theta=10000.0), {"rope_type": "default", "rope_theta": 10000.0}),
    "linear": (
        RopeConfig(theta=10000.0, kind="linear", factor=4.0),
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ),
    # theta 1e4 with head_dim 32: wavelengths 2*pi .. ~3.5e4 cover all three llama3 bands
    # (< 8192/4, between, > 8192), which test_llama3_case_exercises_every_band checks.
    "llama3": (
        RopeConfig(
            theta=10000.0,
            kind="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}
# Two rows, positions past original_max_position_embeddings=8192 included (any order works).
POSITIONS = np.array(
    [
        [0, 1, 2, 7, 100, 2047, 2048, 4096],
        [8191, 8192, 8193, 9000, 12345, 16384, 20000, 32767],
    ],
    dtype=np.int32,
)


def hf_rotary(rope_parameters: dict):
    config = transformers.LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=32768,
        rope_parameters=dict(rope_parameters),
    )
    return hf.LlamaRotaryEmbedding(config)


def test_llama3_case_exercises_every_band():
    cfg = ROPE_CASES["llama3"][0]
    exponents = np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM
    wavelen = 2 * math.pi * cfg.theta**exponents
    old = cfg.original_max_position_embeddings
    high = wavelen < old / cfg.high_freq_factor  # kept
    low = wavelen > old / cfg.low_freq_factor  # divided by factor
    assert high.sum() >= 2 and low.sum() >= 2 and (~high & ~low).sum() >= 2
    ours = inverse_frequencies(cfg, HEAD_DIM)
    plain = inverse_frequencies(RopeConfig(theta=cfg.theta), HEAD_DIM)
    np.testing.assert_array_equal(ours[high], plain[high])
    np.testing.assert_allclose(ours[low], plain[low] / cfg.factor, rtol=1e-6)
    mid = ~high & ~low
    assert np.all(ours[mid] < plain[mid]) and np.all(ours[mid] > plain[mid] / cfg.factor)


@pytest.mark.parametrize("kind", list(ROPE_CASES))
def test_rope_matches_llama_rotary_embedding(kind):
    ours_cfg, hf_params = ROPE_CASES[kind]
    rotary = hf_rotary(hf_params)
    assert rotary.rope_type == kind and rotary.attention_scaling == 1.0

    inv_freq = inverse_frequencies(ours_cfg, HEAD_DIM)
    assert inv_freq.dtype == np.float32 and inv_freq.shape == (HEAD_DIM // 2,)
    np.testing.assert_allclose(inv_freq, t2n(rotary.inv_freq), rtol=1e-6, atol=0)

    rng = np.random.default_rng(2)
    b, t = POSITIONS.shape
    q = rng.normal(size=(b, t, 4, HEAD_DIM)).astype(np.float32)  # ours: [B, T, H, D]
    k = rng.normal(size=(b, t, 2, HEAD_DIM)).astype(np.float32)
    with torch.no_grad():
        cos_ref, sin_ref = rotary(n2t(q), n2t(POSITIONS.astype(np.int64)))
        q_ref, k_ref = hf.apply_rotary_pos_emb(
            n2t(q.transpose(0, 2, 1, 3)), n2t(k.transpose(0, 2, 1, 3)), cos_ref, sin_ref
        )
    cos, sin = rope_tables(jnp.asarray(POSITIONS), inv_freq)
    assert cos.shape == (b, t, HEAD_DIM) and cos.dtype == jnp.float32
    # Angles reach 3.3e4 rad: an f32 angle is only good to ~2e-3 there, so the tables agree to
    # f32 rounding only if both sides form the same f32 product position * inv_freq.
    np.testing.assert_allclose(np.asarray(cos), t2n(cos_ref), **TOL)
    np.testing.assert_allclose(np.asarray(sin), t2n(sin_ref), **TOL)
    q_ours = apply_rope(jnp.asarray(q), cos, sin)
    k_ours = apply_rope(jnp.asarray(k), cos, sin)
    np.testing.assert_allclose(np.asarray(q_ours), t2n(q_ref).transpose(0, 2, 1, 3), **TOL)
    np.testing.assert_allclose(np.asarray(k_ours), t2n(k_ref).transpose(0, 2, 1, 3), **TOL)


# ------------------------------------------------------------------------------ MLP


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "mlp_bias"])
def test_mlp_matches_llama_mlp(bias):
    torch.manual_seed(3)
    d, f = 24, 40
    config = transformers.LlamaConfig(
        hidden_size=d, intermediate_size=f, num_attention_heads=4, mlp_bias=bias, hidden_act="silu"
    )
    ref_mod = hf.LlamaMLP(config).float()
    if bias:  # torch initialises biases uniformly; make them clearly nonzero anyway
        with torch.no_grad():
            for lin in (ref_mod.gate_proj, ref_mod.up_proj, ref_mod.down_proj):
                lin.bias.normal_(0.0, 0.2)
    h = np.random.default_rng(3).normal(size=(2, 5, d)).astype(np.float32)
    with torch.no_grad():
        ref = t2n(ref_mod(n2t(h)))

    def weight(lin):  # torch Linear [out, in] -> ours [in, out]
        return jnp.asarray(t2n(lin.weight).T)

    def bias_of(lin):
        return None if lin.bias is None else jnp.asarray(t2n(lin.bias))

    lp = types.SimpleNamespace(
        w_gate=weight(ref_mod.gate_proj),
        w_up=weight(ref_mod.up_proj),
        w_down=weight(ref_mod.down_proj),
        b_gate=bias_of(ref_mod.gate_proj),
        b_up=bias_of(ref_mod.up_proj),
        b_down=bias_of(ref_mod.down_proj),
    )
    assert (lp.b_gate is None) == (not bias)
    ours = mlp(jnp.asarray(h), lp)
    assert ours.shape == (2, 5, d)
    np.testing.assert_allclose(np.asarray(ours), ref, **TOL)


# ------------------------------------------------------------------------------ attention

HQ, HKV, D = 4, 2, 16


def hf_attention(q, k, v, slot_pos, query_pos):
    """transformers' eager attention with the cache mask 0 <= slot pos <= query pos.

    q [B, T, Hq, D] (ours), k/v [B, Hkv, S, D], slot_pos [B, Hkv, S] (per kv head), query_pos
    [B, T]. Returns out [B, T, Hq, D] and the probabilities [B, Hq, T, S].
    """
    visible = (slot_pos[:, :, None, :] >= 0) & (
        slot_pos[:, :, None, :] <= query_pos[:, None, :, None]
    )  # [B, Hkv, T, S]
    visible = np.repeat(visible, HQ // HKV, axis=1)  # kv head j serves q heads jG..jG+G-1
    mask = np.where(visible, 0.0, np.finfo(np.float32).min).astype(np.float32)
    module = types.SimpleNamespace(num_key_value_groups=HQ // HKV, training=False)
    with torch.no_grad():
        out, probs = hf.eager_attention_forward(
            module,
            n2t(q.transpose(0, 2, 1, 3)),
            n2t(k),
            n2t(v),
            n2t(mask),
            scaling=D**-0.5,
        )
    return t2n(out), t2n(probs)


def hf_probs_sum(probs, query_pos):
    """Per-slot attention summed over the real (non-padding) queries: [B, Hq, S]."""
    real = (query_pos >= 0)[:, None, :, None]
    return (probs * real).sum(axis=2)


def _ours(fn, q, k, v, slot_pos, query_pos, *extra, **kw):
    arrays = [jnp.asarray(a) for a in (q, k, v, slot_pos, query_pos)]
    out, sums = fn(*arrays, *extra, return_probs_sum=True, **kw)
    return np.asarray(out), np.asarray(sums)


def prefill_case():
    """A causal prefill of T = 7 tokens over a cache of S = 7 slots holding them; row 1 is
    left-padded by 3 (positions -1, written with pos -1)."""
    rng = np.random.default_rng(4)
    b, t = 2, 7
    query_pos = np.array([list(range(t)), [-1, -1, -1, 0, 1, 2, 3]], dtype=np.int32)
    slot_pos = np.repeat(query_pos[:, None, :], HKV, axis=1)
    q = rng.normal(size=(b, t, HQ, D)).astype(np.float32)
    k = rng.normal(size=(b, HKV, t, D)).astype(np.float32)
    v = rng.normal(size=(b, HKV, t, D)).astype(np.float32)
    return q, k, v, slot_pos, query_pos


def decode_case():
    """One decode query per row over a cache of S = 10 slots with holes (pos -1: evicted, per
    kv head), an unwritten slot at the end (pos -1, holding garbage K/V) and, in row 1,
    slots past the query position (masked by pos <= query pos)."""
    rng = np.random.default_rng(5)
    b, s = 2, 10
    slot_pos = np.array(
        [
            [[0, 1, -1, 3, 4, 5, -1, 7, -1, -1], [0, -1, 2, 3, -1, 5, 6, 7, -1, -1]],
            [[-1, -1, 0, 1, 2, -1, 4, 5, 6, -1], [-1, -1, 0, -1, 2, 3, 4, -1, 6, -1]],
        ],
        dtype=np.int32,
    )
    query_pos = np.array([[8], [5]], dtype=np.int32)  # row 1: slots at pos 6 are masked
    q = rng.normal(size=(b, 1, HQ, D)).astype(np.float32)
    k = rng.normal(size=(b, HKV, s, D)).astype(np.float32)
    v = rng.normal(size=(b, HKV, s, D)).astype(np.float32)
    k[..., 9, :] = 1e3  # unwritten: visible to no one, whatever it holds
    v[..., 9, :] = 1e3
    return q, k, v, slot_pos, query_pos


@pytest.mark.parametrize("keys_major", [False, True], ids=["rows_major", "keys_major"])
def test_cached_attention_prefill_gqa_left_padding(keys_major):
    q, k, v, slot_pos, query_pos = prefill_case()
    ref_out, ref_probs = hf_attention(q, k, v, slot_pos, query_pos)
    out, sums = _ours(cached_attention, q, k, v, slot_pos, query_pos, keys_major=keys_major)
    real = query_pos >= 0  # padding queries' outputs are unused (finite, never compared)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[real], ref_out[real], **TOL)
    np.testing.assert_allclose(sums, hf_probs_sum(ref_probs, query_pos), **TOL)
    assert np.all(sums[1, :, :3] == 0)  # the padding slots get no attention


@pytest.mark.parametrize("block", [3, 7, 16])
def test_written_slot_attention_prefill_gqa_left_padding(block):
    q, k, v, slot_pos, query_pos = prefill_case()
    ref_out, ref_probs = hf_attention(q, k, v, slot_pos, query_pos)
    out, sums = _ours(
        written_slot_attention, q, k, v, slot_pos, query_pos, jnp.int32(7), block=block
    )
    real = query_pos >= 0
    np.testing.assert_allclose(out[real], ref_out[real], **TOL)
    np.testing.assert_allclose(sums, hf_probs_sum(ref_probs, query_pos), **TOL)


@pytest.mark.parametrize("keys_major", [False, True], ids=["rows_major", "keys_major"])
def test_cached_attention_decode_over_cache_with_empty_slots(keys_major):
    q, k, v, slot_pos, query_pos = decode_case()
    ref_out, ref_probs = hf_attention(q, k, v, slot_pos, query_pos)
    out, sums = _ours(cached_attention, q, k, v, slot_pos, query_pos, keys_major=keys_major)
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(sums, hf_probs_sum(ref_probs, query_pos), **TOL)
    empty = np.repeat(slot_pos < 0, HQ // HKV, axis=1)
    assert np.all(sums[empty] == 0)


@pytest.mark.parametrize("block", [3, 4, 9])
def test_written_slot_attention_decode_over_cache_with_empty_slots(block):
    q, k, v, slot_pos, query_pos = decode_case()
    ref_out, ref_probs = hf_attention(q, k, v, slot_pos, query_pos)
    # Slots [0, 9) written; slot 9 (garbage, pos -1) is past num_slots and never read.
    out, sums = _ours(
        written_slot_attention, q, k, v, slot_pos, query_pos, jnp.int32(9), block=block
    )
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(sums, hf_probs_sum(ref_probs, query_pos), **TOL)
