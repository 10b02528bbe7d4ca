"""Gemma beyond tests/test_parity.py's text checkpoints: the text model of a multimodal
Gemma 3 checkpoint (Gemma3ForConditionalGeneration, vision tower skipped at load), that the
sliding window really changes the numbers (a control for the parity tests), Gemma 3's
text-config defaults, and the checks Gemma's config gets."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import dge_jax
from dge_jax.checkpoints.hf import parse_config
from dge_jax.config import ConfigError
from dge_jax.runtime import decoding
from dge_jax.text.prompts import pad_left

TEXT = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
    query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
    max_position_embeddings=256,
)  # fmt: skip
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14)  # fmt: skip


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """A tiny random Gemma3ForConditionalGeneration saved by transformers (text weights under
    language_model.model.*, a SigLIP vision tower and projector beside them)."""
    torch.manual_seed(0)
    cfg = transformers.Gemma3Config(
        text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, image_token_index=299,
        boi_token_index=297, eoi_token_index=298,
    )  # fmt: skip
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # non-trivial norms: (1 + w) with w = 0 would hide a dropped one
        for name, p in model.named_parameters():
            if "norm" in name:
                torch.nn.init.normal_(p, mean=0.0, std=0.3)
    folder = tmp_path_factory.mktemp("gemma3_mm")
    model.save_pretrained(folder)
    return folder, model


def _teacher_forced(model, rows):
    t = max(map(len, rows))
    tokens, lengths = pad_left(rows, t)
    logits = decoding.teacher_forced_logits(
        model.forward, model.config, model.params, jnp.asarray(tokens), jnp.asarray(lengths)
    )
    return [np.asarray(logits)[i, t - len(r) :] for i, r in enumerate(rows)]


def _rows(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, vocab - 4, n).tolist() for n in (30, 19)]


def test_multimodal_checkpoint_runs_its_text_model(multimodal):
    folder, hf = multimodal
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "gemma3" and "vision_tower.head.probe" in _names(folder)
    model = dge_jax.load(folder)
    assert model.config.layer_windows == (8, 0) and model.config.family == "gemma3_text"
    rows = _rows(TEXT["vocab_size"])
    for row, ours in zip(rows, _teacher_forced(model, rows), strict=True):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([row])).logits[0].numpy()
        assert np.abs(ours - ref).max() <= 1e-4


def _names(folder) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "np") as f:
        return set(f.keys())


def test_the_window_changes_the_logits(multimodal):
    """The control behind every sliding parity test: the same weights with a window longer
    than any prompt (layer 0 keeps its local RoPE) give other logits past the window."""
    folder, hf = multimodal
    model = dge_jax.load(folder)
    wide = dataclasses.replace(model.config, layer_windows=(10**6, 0))
    unwindowed = dataclasses.replace(model, config=wide)
    rows = _rows(TEXT["vocab_size"])
    with_window, without = _teacher_forced(model, rows), _teacher_forced(unwindowed, rows)
    for a, b in zip(with_window, without, strict=True):
        assert np.abs(a[:8] - b[:8]).max() <= 1e-5  # within the window: the same
        assert np.abs(a[8:] - b[8:]).max() > 1e-2  # past it: the window shows


def test_gemma3_text_config_defaults_fill_a_sparse_text_config():
    """gemma-3-4b-it's config.json lists only what differs from Gemma3TextConfig's defaults
    in its text_config; the defaults (transformers 5.24) fill the rest, as transformers does."""
    raw = {"model_type": "gemma3", "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024}}  # fmt: skip
    ours = parse_config(raw)[1]
    theirs = transformers.Gemma3TextConfig(**raw["text_config"])
    assert ours.num_heads == theirs.num_attention_heads == 8
    assert ours.num_kv_heads == theirs.num_key_value_heads == 4
    assert ours.head_dim == theirs.head_dim == 256
    assert ours.vocab_size == theirs.vocab_size
    windows = tuple(1024 if t == "sliding_attention" else 0 for t in theirs.layer_types)
    assert ours.layer_windows == windows and windows.count(0) == 5
    assert (ours.rope.kind, ours.rope.factor, ours.rope.theta) == ("linear", 8.0, 1e6)
    assert ours.local_rope is not None and ours.local_rope.theta == 1e4
    assert ours.local_rope.kind == "default"  # the scaling is the global layers' only
    assert ours.attn_scale == 256**-0.5


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
        ({"hidden_activation": "gelu"}, "hidden_act='gelu' is not supported for gemma3_text"),
        ({"layer_types": ["sliding_attention"]}, "layer_types has 1 entries for 2 layers"),
        ({"query_pre_attn_scalar_x": 1}, "query_pre_attn_scalar_x"),
    ],
)
def test_gemma_config_checks(change, error):
    raw = {"model_type": "gemma3_text", **TEXT} | change
    with pytest.raises(ConfigError, match=error):
        parse_config(raw)
