"""Real config.json files of the local/global-layer families (issue #30), from tests/configs/
(sources in tests/configs/SOURCES.md): each parses as transformers reads it, and a tiny random
checkpoint with its layer pattern (its sliding/global layers, head ratio, RoPEs, caps; fewer
layers, small widths) loads and generates what transformers' forward predicts. Gemma 3's own
chat template renders as transformers renders it, and its EOS ids include <end_of_turn>."""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import dge_jax
from dge_jax.checkpoints.hf import parse_config
from dge_jax.checkpoints.tokenizer import Tokenizer
from dge_jax.config import ConfigError
from dge_jax.runtime import decoding

CONFIGS = pathlib.Path(__file__).parent / "configs"

# name: (family, layers, q heads, kv heads, head dim, layer windows of the first 6 layers,
#        (rope kind, theta), local rope theta, soft caps (attention, final), vocab)
EXPECTED = {
    "gemma-3-1b-it": ("gemma3_text", 26, 4, 1, 256, (512,) * 5 + (0,), ("default", 1e6),
                      1e4, (None, None), 262144),
    "gemma-3-4b-it": ("gemma3_text", 34, 8, 4, 256, (1024,) * 5 + (0,), ("linear", 1e6),
                      1e4, (None, None), 262208),
    "gemma-2-9b-it": ("gemma2", 42, 16, 8, 256, (4096, 0) * 3, ("default", 1e4), None,
                      (50.0, 30.0), 256000),
    "Phi-3-mini-4k-instruct": ("phi3", 32, 32, 32, 96, (2047,) * 6, ("default", 1e4), None,
                               (None, None), 32064),
    "Phi-3-mini-128k-instruct": ("phi3", 32, 32, 32, 96, (262144,) * 6, ("longrope", 1e4),
                                 None, (None, None), 32064),
}  # fmt: skip


def raw_config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.mark.parametrize("name", list(EXPECTED))
def test_real_config_parses(name):
    family, layers, hq, hkv, hd, windows, (kind, theta), local, caps, vocab = EXPECTED[name]
    cfg = parse_config(raw_config(name))[1]
    assert cfg.family == family
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (layers, hq, hkv, hd)
    assert cfg.layer_windows[:6] == windows and len(cfg.layer_windows) == layers
    assert (cfg.rope.kind, cfg.rope.theta) == (kind, theta)
    assert (None if cfg.local_rope is None else cfg.local_rope.theta) == local
    assert (cfg.attn_softcap, cfg.final_softcap) == caps and cfg.vocab_size == vocab


@pytest.mark.parametrize("name", list(EXPECTED))
def test_the_layers_are_those_transformers_reads(name):
    raw = raw_config(name)
    theirs = transformers.AutoConfig.for_model(**raw)
    text = theirs.text_config if raw["model_type"] == "gemma3" else theirs
    cfg = parse_config(raw)[1]
    if hasattr(text, "layer_types"):
        want = tuple(text.sliding_window if t == "sliding_attention" else 0
                     for t in text.layer_types)
    else:  # Phi-3: every layer slides when sliding_window is set
        want = (text.sliding_window,) * text.num_hidden_layers
    assert cfg.layer_windows == want
    assert cfg.num_kv_heads == text.num_key_value_heads
    if raw["model_type"] != "phi3":
        assert cfg.attn_scale == text.query_pre_attn_scalar ** -0.5


def test_a_sliding_window_size_that_differs_is_refused():
    raw = raw_config("gemma-2-9b-it") | {"sliding_window_size": 2048}
    with pytest.raises(ConfigError, match="sliding_window_size=2048 differs from sliding_wind"):
        parse_config(raw)


# --- tiny checkpoints with each config's layer pattern --------------------------------------

VOCAB = 300
LAYERS = {"gemma3_text": 6, "gemma3": 6, "gemma2": 2, "phi3": 2}  # one period of the pattern
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14)  # fmt: skip


def shrink_text(text: dict, model_type: str) -> dict:
    """Small widths and one period of the layer pattern; the head ratio, RoPE kinds, caps,
    scalars and positions kept (longrope's factor lists thinned to the smaller head)."""
    ratio = text.get("num_attention_heads", 8) // text.get("num_key_value_heads", 4)
    out = dict(text) | dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=4 // ratio, num_hidden_layers=LAYERS[model_type],
        initializer_range=0.1, eos_token_id=1, bos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    out.pop("layer_types", None)  # made again from the pattern for the fewer layers
    if model_type != "phi3":
        out["head_dim"] = 16
    if (out.get("sliding_window") or 0) < 10**5:
        out["sliding_window"] = 8  # a prompt of 20 tokens crosses it
    if model_type == "gemma2" and "sliding_window_size" in out:
        out["sliding_window_size"] = out["sliding_window"]
    rope = out.get("rope_scaling") or {}
    if "long_factor" in rope:
        half = 64 // 4 // 2
        step = len(rope["long_factor"]) // half
        out["rope_scaling"] = rope | {k: rope[k][::step][:half]
                                      for k in ("long_factor", "short_factor")}
    return out


def tiny_checkpoint(name: str, folder: pathlib.Path):
    raw = raw_config(name)
    torch.manual_seed(0)
    if raw["model_type"] == "gemma3":
        cfg = transformers.Gemma3Config(
            text_config=shrink_text(raw["text_config"], "gemma3"), vision_config=VISION,
            mm_tokens_per_image=4, image_token_index=299, boi_token_index=297,
            eoi_token_index=298)  # fmt: skip
        model = transformers.Gemma3ForConditionalGeneration(cfg)
    else:
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**shrink_text(raw, raw["model_type"])))
    model = model.float().eval()
    with torch.no_grad():  # non-trivial norms: a dropped (1 + w) or norm would show
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                torch.nn.init.normal_(p, mean=1.0 if raw["model_type"] == "phi3" else 0.0,
                                      std=0.3)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("name", list(EXPECTED))
def test_a_tiny_checkpoint_of_the_layer_pattern_generates_like_transformers(name, tmp_path):
    hf = tiny_checkpoint(name, tmp_path)
    model = dge_jax.load(tmp_path)
    assert len(model.config.layer_windows) == LAYERS[raw_config(name)["model_type"]]
    prompt = np.random.default_rng(1).integers(3, VOCAB - 4, 20).tolist()
    out = dge_jax.generate(model, [prompt], max_new_tokens=6).tokens[0]
    assert out, "no token generated"
    full = prompt + out
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([full])).logits[0].float().numpy()
    # decode equals the teacher-forced forward of transformers, token by token
    assert ref[len(prompt) - 1:-1].argmax(-1).tolist() == out[: len(full) - len(prompt)]
    logits = decoding.teacher_forced_logits(
        model.forward, model.config, model.params, jnp.asarray([full]),
        jnp.asarray([len(full)]))  # fmt: skip
    assert np.abs(np.asarray(logits)[0] - ref).max() <= 1e-4


# --- Gemma 3's chat template and EOS ids ----------------------------------------------------

WORDS = ["user", "model", "Hello", "there", "Be", "brief", "Hi", "How", "are", "you", "?", "!"]


def gemma_tokenizer_folder(folder: pathlib.Path) -> pathlib.Path:
    """tokenizer.json with Gemma's special tokens at Gemma's ids (<pad> 0, <eos> 1, <bos> 2,
    <start_of_turn> 105, <end_of_turn> 106), tokenizer_config.json with the real Gemma 3 chat
    template, and gemma-3-1b-it's real config.json (eos_token_id [1, 106])."""
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab |= {w: 4 + i for i, w in enumerate(WORDS)}
    vocab |= {f"w{i}": i for i in range(len(vocab), 105)}
    vocab |= {"<start_of_turn>": 105, "<end_of_turn>": 106}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in
                            ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    template = (CONFIGS / "gemma-3-chat_template.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "chat_template": template}))  # fmt: skip
    (folder / "config.json").write_text((CONFIGS / "gemma-3-1b-it.json").read_text())
    return folder


def test_gemma3_chat_template_renders_as_transformers_renders_it(tmp_path):
    folder = gemma_tokenizer_folder(tmp_path / "tok")
    ours = Tokenizer.from_folder(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    conversations = [
        "Hello there",
        [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello !"}, {"role": "user", "content": "How are you ?"}],
    ]  # fmt: skip
    for messages in conversations:
        as_list = ([{"role": "user", "content": messages}] if isinstance(messages, str)
                   else messages)
        want = theirs.apply_chat_template(as_list, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == want
        assert want.startswith("<bos><start_of_turn>user\n")
        assert want.endswith("<end_of_turn>\n<start_of_turn>model\n")
        ids = ours.encode_chat(messages)  # the turn markers are single special tokens
        assert ids[:2] == [2, 105] and ids[-3:] == [106, 105, ours.token_id("model")]
    # the system turn folds into the first user turn, as Gemma 3's template says
    assert "<start_of_turn>user\nBe brief\n\nHi<end_of_turn>" in ours.apply_chat_template(
        conversations[1])
    # an answer ends at <end_of_turn> as well as <eos> (config.json's eos_token_id)
    assert ours.eos_ids == (1, 106)
