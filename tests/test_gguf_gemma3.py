"""gemma3 GGUF files -> Hugging Face folders, on a tiny random model written here.

A random transformers Gemma3ForCausalLM is written as llama.cpp writes Gemma 3 (norms as
1 + w, q/k rows unpermuted, the config as `gemma3.*` metadata, a SentencePiece vocabulary
without merges); our conversion must load in dge_jax with transformers' logits for the same
file, and its tokenizer must equal transformers' GGUF tokenizer. Seconds, no real model: the
real file is tests/test_gemma3_embedded.py.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

import dge_jax
from dge_jax.checkpoints.gguf import convert_gguf_to_hf
from dge_jax.checkpoints.gguf_tokenizer import merges_from_vocabulary
from dge_jax.runtime import decoding

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER, WINDOW = 64, 6, 2, 1, 256, 96, 8
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["▁", "a", "b", "c", "d", "e", "h", "l", "o", "t", "1", "2", "\n", "▁t", "he", "▁the",
          "ll", "▁a", "ab", "abc", "▁he", "llo", "▁hello", "  ", "   ", "12", "▁▁"]  # fmt: skip
BYTES = [f"<0x{b:02X}>" for b in range(256)]
NORM_NAMES = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}  # fmt: skip
PROJ_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip


def tokens() -> list[str]:
    return SPECIALS + BYTES + PIECES


def reference_model():
    """A random transformers Gemma 3 text model with the defaults a GGUF file implies."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(tokens()), hidden_size=HIDDEN, intermediate_size=INTER,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, sliding_window=WINDOW, max_position_embeddings=128,
        initializer_range=0.1,
    )  # fmt: skip
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # random, so a missing or unshifted norm shows
                p.copy_(torch.randn_like(p) * 0.3)
    return model


def write_gemma3_gguf(path, model, qtype=QType.F32, extra_kv=None, head_dim=HEAD_DIM):
    """`model` as llama.cpp's convert_hf_to_gguf.py writes Gemma 3."""
    w = gguf.GGUFWriter(str(path), arch="gemma3")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(WINDOW)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    vocab = tokens()
    w.add_token_list(vocab)
    scores = [-1000.0] * len(SPECIALS) + [0.0] * 256 + [-float(i) for i in range(len(PIECES))]
    w.add_token_scores(scores)
    w.add_token_types([3] * len(SPECIALS) + [6] * 256 + [1] * len(PIECES))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    for key, value in (extra_kv or {}).items():
        w.add_key_value(key, value[0], value[1])
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", _quantized(state["model.embed_tokens.weight"], qtype),
                 raw_dtype=qtype if qtype != QType.F32 else None)  # fmt: skip
    w.add_tensor("output_norm.weight", state["model.norm.weight"] + 1)
    for n in range(LAYERS):
        for short, long in NORM_NAMES.items():
            w.add_tensor(f"blk.{n}.{short}.weight", state[f"model.layers.{n}.{long}.weight"] + 1)
        for short, long in PROJ_NAMES.items():
            x = state[f"model.layers.{n}.{long}.weight"]
            w.add_tensor(f"blk.{n}.{short}.weight", _quantized(x, qtype),
                         raw_dtype=qtype if qtype != QType.F32 else None)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _quantized(x: np.ndarray, qtype: QType) -> np.ndarray:
    return x if qtype == QType.F32 else gguf.quants.quantize(x, qtype)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3_gguf")
    path = write_gemma3_gguf(folder / "tiny-gemma3.gguf", reference_model(), QType.Q8_0)
    return path, convert_gguf_to_hf(path, folder / "hf")


def test_config_is_what_transformers_reads(files):
    from transformers import AutoConfig

    path, out = files
    ours = json.loads((out / "config.json").read_text())
    theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    for key in ("model_type", "layer_types", "rope_parameters", "sliding_window",
                "query_pre_attn_scalar", "head_dim", "num_key_value_heads", "rms_norm_eps",
                "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation",
                "max_position_embeddings", "tie_word_embeddings", "vocab_size"):  # fmt: skip
        assert ours[key] == theirs[key], key
    assert ours["layer_types"][-1] == "full_attention" and ours["layer_types"][0] != "full"


def test_logits_match_transformers_gguf_loader(files):
    import torch
    from transformers import AutoModelForCausalLM

    path, out = files
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    model = dge_jax.load(str(out))
    ids = np.random.default_rng(0).integers(4, len(tokens()), size=(1, 24))  # past the window
    got = decoding.teacher_forced_logits(
        model.forward, model.config, model.params, jnp.asarray(ids), jnp.asarray([24])
    )
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=0)


def test_tokenizer_matches_transformers(files):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path, out = files
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ["the hello", " hello  the", "abc12\n\nabcd", "   a    b", "héllo ☃", "",
                 "<start_of_turn>hello<end_of_turn>\n", "<bos>the<eos>"]:  # fmt: skip
        ids = ours.encode(text).ids
        assert ids == theirs.encode(text, add_special_tokens=True), repr(text)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    assert ours.encode("é").ids == [2, *(len(SPECIALS) + b for b in "é".encode())]  # bytes


def test_merges_rank_earlier_tokens_first_then_longer_parts():
    # "abc" cuts into a+bc and ab+c: ab+c has the longer left part, so it ranks first
    assert merges_from_vocabulary(["a", "b", "c", "ab", "bc", "abc"]) == [
        ("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "options, match",
    [
        ({"extra_kv": {"gemma3.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING)}},
         "rope.scaling"),
        ({"head_dim": 128}, "head_dim 128"),  # 27B's width: its attention scale is not 1/16
    ],
    ids=["rope-scaling", "head-dim"],
)  # fmt: skip
def test_what_the_file_cannot_say_is_refused(tmp_path, options, match):
    path = write_gemma3_gguf(tmp_path / "bad.gguf", reference_model(), **options)
    with pytest.raises(ValueError, match=match):
        convert_gguf_to_hf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_progress_is_reported_per_tensor(files, tmp_path):
    path, _ = files
    seen = []
    convert_gguf_to_hf(path, tmp_path / "hf", progress=lambda done, total: seen.append(done))
    assert seen == list(range(1, 2 + LAYERS * 13 + 1))
