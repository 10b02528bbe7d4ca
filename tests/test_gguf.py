"""GGUF -> Hugging Face conversion: dequantization, q/k un-permutation, a tiny file end to end.

No real model here: every GGUF is written by gguf.GGUFWriter from small numpy arrays in
tmp_path, so this module runs in seconds. The real SmolLM2 file is tests/test_embedded_model.py.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from safetensors.numpy import load_file
from tokenizers import Tokenizer, pre_tokenizers

from dge_jax.checkpoints.gguf import convert_gguf_to_hf, dequantize, hf_name, unpermute_qk

# ---------------------------------------------------------------------------------------------
# Dequantization


# Worst-case error of quantize -> dequantize, as a fraction of each 32-value block's max |x|
# (a half step of the grid, with room for the clamp at the grid's edge).
ROUND_TRIP_TOL = {
    QType.F32: 0.0,
    QType.F16: 1e-3,
    QType.BF16: 1 / 128,
    QType.Q8_0: 1 / 127,
    QType.Q5_0: 1 / 16,
    QType.Q5_1: 2 / 31,
    QType.Q4_0: 1 / 8,
    QType.Q4_1: 2 / 15,
}


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_TOL), ids=lambda t: t.name)
def test_dequantize_round_trip(qtype):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 256)).astype(np.float32)
    y = dequantize(gguf.quants.quantize(x, qtype), qtype, x.shape)
    assert y.dtype == np.float32 and y.shape == x.shape
    block_max = np.abs(x).reshape(4, 8, 32).max(-1, keepdims=True)
    err = np.abs(y - x).reshape(4, 8, 32)
    assert (err <= ROUND_TRIP_TOL[qtype] * block_max + 1e-7).all(), float(err.max())


# gguf.quants cannot quantize K-quants, so random blocks are decoded both by the package and by
# these scalar transcriptions of ggml's dequantize_row_q{4,5,6}_K (ggml-quants.c).


def _f16(raw) -> float:
    return float(np.frombuffer(bytes(raw), dtype=np.float16)[0])


def _scale_min_k4(j: int, s) -> tuple[int, int]:
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def _ref_q4_k(b) -> list[float]:
    d, dmin, scales, qs = _f16(b[0:2]), _f16(b[2:4]), b[4:16], b[16:144]
    y = []
    for j in range(4):
        (sc1, m1), (sc2, m2) = _scale_min_k4(2 * j, scales), _scale_min_k4(2 * j + 1, scales)
        q = qs[32 * j : 32 * j + 32]
        y += [d * sc1 * (v & 0xF) - dmin * m1 for v in q]
        y += [d * sc2 * (v >> 4) - dmin * m2 for v in q]
    return y


def _ref_q5_k(b) -> list[float]:
    d, dmin, scales, qh, qs = _f16(b[0:2]), _f16(b[2:4]), b[4:16], b[16:48], b[48:176]
    y = []
    for j in range(4):
        (sc1, m1), (sc2, m2) = _scale_min_k4(2 * j, scales), _scale_min_k4(2 * j + 1, scales)
        u1, u2 = 1 << (2 * j), 2 << (2 * j)
        q = qs[32 * j : 32 * j + 32]
        y += [
            d * sc1 * ((v & 0xF) + 16 * bool(h & u1)) - dmin * m1
            for v, h in zip(q, qh, strict=True)
        ]
        y += [
            d * sc2 * ((v >> 4) + 16 * bool(h & u2)) - dmin * m2 for v, h in zip(q, qh, strict=True)
        ]
    return y


def _ref_q6_k(b) -> list[float]:
    ql_all, qh_all = b[0:128], b[128:192]
    sc_all, d = np.frombuffer(bytes(b[192:208]), dtype=np.int8).tolist(), _f16(b[208:210])
    y = [0.0] * 256
    for n in range(2):
        ql, qh, sc = ql_all[64 * n :], qh_all[32 * n :], sc_all[8 * n :]
        for i in range(32):
            s = i // 16
            q1 = ((ql[i] & 0xF) | ((qh[i] & 3) << 4)) - 32
            q2 = ((ql[i + 32] & 0xF) | (((qh[i] >> 2) & 3) << 4)) - 32
            q3 = ((ql[i] >> 4) | (((qh[i] >> 4) & 3) << 4)) - 32
            q4 = ((ql[i + 32] >> 4) | (((qh[i] >> 6) & 3) << 4)) - 32
            for k, q in enumerate((q1, q2, q3, q4)):
                y[128 * n + i + 32 * k] = d * sc[s + 2 * k] * q
    return y


# type: (reference decoder, byte offsets of the f16 scale fields to set to sane values)
K_QUANTS = {
    QType.Q4_K: (_ref_q4_k, (0, 2)),
    QType.Q5_K: (_ref_q5_k, (0, 2)),
    QType.Q6_K: (_ref_q6_k, (208,)),
}


@pytest.mark.parametrize("qtype", list(K_QUANTS), ids=lambda t: t.name)
def test_dequantize_k_quants_match_ggml_reference(qtype):
    reference, f16_offsets = K_QUANTS[qtype]
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(4, block_bytes), dtype=np.uint8)
    for off in f16_offsets:  # random bytes could be inf/nan scales
        scale = rng.uniform(1e-3, 0.1, size=4).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(4, 2)
    data = blocks.reshape(2, 2 * block_bytes)  # 2 rows of 2 blocks = [2, 512] values
    expected = np.array([reference(b.tolist()) for b in blocks]).reshape(2, 512)
    np.testing.assert_allclose(dequantize(data, qtype, (2, 512)), expected, rtol=1e-5, atol=1e-5)


def test_dequantize_unsupported_type_names_it():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize(np.zeros((1, 66), np.uint8), QType.IQ2_XXS, (1, 256))


# ---------------------------------------------------------------------------------------------
# q/k permutation


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (n_head is n_head_kv for k)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_unpermute_hand_example():
    # One head, head_dim 4: HF rows are [first rotary half | second half] = r0 r1 | r2 r3;
    # llama.cpp interleaves the halves pairwise: r0 r2 r1 r3.
    hf = np.array([[0.0, 0.5], [1.0, 1.5], [2.0, 2.5], [3.0, 3.5]])
    gguf_order = hf[[0, 2, 1, 3]]
    np.testing.assert_array_equal(llama_cpp_permute(hf, 1), gguf_order)
    np.testing.assert_array_equal(unpermute_qk(gguf_order, 1), hf)


@pytest.mark.parametrize("n_heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(n_heads):
    w = np.random.default_rng(n_heads).normal(size=(n_heads * 8, 5))
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(w, n_heads), n_heads), w)
    assert not np.array_equal(llama_cpp_permute(w, n_heads), w)


def test_hf_name_table_and_unknown_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    for bad in ("blk.0.attn_q_norm.weight", "blk.x.attn_q.weight", "output.bias"):
        with pytest.raises(ValueError, match="unknown GGUF tensor"):
            hf_name(bad)


# ---------------------------------------------------------------------------------------------
# A tiny llama GGUF, written here, converted back

TINY = dict(hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=8)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"

# HF name suffix -> GGUF name suffix, per layer.
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def tiny_tokens() -> list[str]:
    return SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "ll", "hell"]


def tiny_hf_tensors(tied: bool) -> dict[str, np.ndarray]:
    """Random HF-layout Llama tensors for TINY, with as many embedding rows as tokens."""
    rng = np.random.default_rng(0)
    h, i, d = TINY["hidden"], TINY["inter"], TINY["head_dim"]
    q, kv, v = TINY["heads"] * d, TINY["kv_heads"] * d, len(tiny_tokens())
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (v, h)
    per_layer = [(h,), (q, h), (kv, h), (kv, h), (h, q), (h,), (i, h), (i, h), (h, i)]
    for n in range(TINY["layers"]):
        for suffix, shape in zip(LAYER_NAMES, per_layer, strict=True):
            shapes[f"model.layers.{n}.{suffix}"] = shape
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def to_gguf_name(hf: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    _, _, n, suffix = hf.split(".", 3)
    return f"blk.{n}.{LAYER_NAMES[suffix]}"


def write_tiny_gguf(
    path, tensors, *, qtype=QType.F32, arch="llama", extra_kv=None, extra=None, add_bos=False
):
    """A llama GGUF for HF-layout `tensors`, q/k permuted as llama.cpp does; 2-D weights `qtype`."""
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_context_length(128)
    w.add_embedding_length(TINY["hidden"])
    w.add_block_count(TINY["layers"])
    w.add_feed_forward_length(TINY["inter"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(TINY["head_dim"])
    tokens = tiny_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(TEMPLATE)
    for key, value in (extra_kv or {}).items():
        w.add_key_value(key, value[0], value[1])
    for name, x in tensors.items():
        if name.endswith("q_proj.weight"):
            x = llama_cpp_permute(x, TINY["heads"])
        elif name.endswith("k_proj.weight"):
            x = llama_cpp_permute(x, TINY["kv_heads"])
        t = qtype if x.ndim == 2 else QType.F32
        data = gguf.quants.quantize(x, t)
        w.add_tensor(to_gguf_name(name), data, raw_dtype=t if data.dtype == np.uint8 else None)
    for name, x in (extra or {}).items():
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "qtype, tied", [(QType.F32, False), (QType.F16, True), (QType.Q8_0, False)], ids=str
)
def test_tiny_gguf_converts_back_to_the_same_tensors(tmp_path, qtype, tied):
    hf = tiny_hf_tensors(tied)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf, qtype=qtype)
    out = convert_gguf_to_hf(path, tmp_path / "hf")

    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(hf)
    for name, x in hf.items():
        # Quantization is row-wise, so it commutes with the q/k row permutation.
        t = qtype if x.ndim == 2 else QType.F32
        want = gguf.quants.dequantize(gguf.quants.quantize(x, t), t)
        np.testing.assert_array_equal(got[name], want, err_msg=name)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is tied
    assert (config["vocab_size"], config["hidden_size"]) == (len(tiny_tokens()), TINY["hidden"])
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert (config["head_dim"], config["num_hidden_layers"]) == (8, 2)
    assert (config["intermediate_size"], config["max_position_embeddings"]) == (64, 128)
    assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_tiny_tokenizer_and_configs(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_tensors(tied=True))
    out = convert_gguf_to_hf(path, tmp_path / "hf")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab = tok.get_vocab()
    ids = tok.encode("<|im_start|>hello 42<|im_end|>").ids  # no BOS; specials stay whole
    assert ids == [1, vocab["hell"], vocab["o"], vocab["Ġ"], vocab["4"], vocab["2"], 2]
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hello 42<|im_end|>"

    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == TEMPLATE and tcfg["add_bos_token"] is False
    assert (tcfg["bos_token"], tcfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    gcfg = json.loads((out / "generation_config.json").read_text())
    assert gcfg == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_add_bos_flag_is_honoured(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_tensors(tied=True), add_bos=True)
    out = convert_gguf_to_hf(path, tmp_path / "hf")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("hello").ids[0] == 1
    assert tok.encode("hello", add_special_tokens=False).ids[0] != 1
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True


def test_bfloat16_output(tmp_path):
    hf = tiny_hf_tensors(tied=True)
    out = convert_gguf_to_hf(write_tiny_gguf(tmp_path / "t.gguf", hf), tmp_path / "hf", "bfloat16")
    got = load_file(str(out / "model.safetensors"))
    assert got["model.norm.weight"].dtype.name == "bfloat16"
    np.testing.assert_allclose(
        got["model.norm.weight"].astype(np.float32), hf["model.norm.weight"], rtol=1 / 128
    )


# ---------------------------------------------------------------------------------------------
# Bad inputs: clear errors, and no folder left behind


def _assert_nothing_written(tmp_path):
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_non_llama_architecture_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "bad.gguf", tiny_hf_tensors(True), arch="qwen2")
    with pytest.raises(ValueError, match="'qwen2'"):
        convert_gguf_to_hf(path, tmp_path / "hf")
    _assert_nothing_written(tmp_path)


def test_unknown_tensor_is_named(tmp_path):
    extra = {"blk.0.attn_q_norm.weight": np.ones(8, np.float32)}
    path = write_tiny_gguf(tmp_path / "bad.gguf", tiny_hf_tensors(True), extra=extra)
    with pytest.raises(ValueError, match="blk.0.attn_q_norm.weight"):
        convert_gguf_to_hf(path, tmp_path / "hf")
    _assert_nothing_written(tmp_path)


def test_missing_tensor_is_an_error(tmp_path):
    hf = tiny_hf_tensors(True)
    del hf["model.layers.1.mlp.up_proj.weight"]
    path = write_tiny_gguf(tmp_path / "bad.gguf", hf)
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        convert_gguf_to_hf(path, tmp_path / "hf")
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize(
    "kv, match",
    [
        ({"llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)}, "yarn"),
        ({"llama.attention.sliding_window": (64, gguf.GGUFValueType.UINT32)}, "sliding_window"),
    ],
    ids=["yarn", "unknown-key"],
)
def test_metadata_that_changes_numerics_is_refused(tmp_path, kv, match):
    path = write_tiny_gguf(tmp_path / "bad.gguf", tiny_hf_tensors(True), extra_kv=kv)
    with pytest.raises(ValueError, match=match):
        convert_gguf_to_hf(path, tmp_path / "hf")


def test_linear_rope_scaling_is_carried(tmp_path):
    kv = {
        "llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
        "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32),
    }
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_tensors(True), extra_kv=kv)
    config = json.loads((convert_gguf_to_hf(path, tmp_path / "hf") / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_existing_folder_is_not_overwritten(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_tensors(True))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        convert_gguf_to_hf(path, tmp_path / "hf")
    assert (tmp_path / "hf" / "keep.txt").read_text() == "mine"
