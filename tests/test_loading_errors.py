"""Bad checkpoints and bad requests fail early with a clear error.

Each test breaks a writable copy of a tiny checkpoint (conftest.checkpoint_copy) in one way
and checks both the exception type and that the message names the problem, so a user can fix
it without reading a traceback.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dge_jax
from dge_jax.checkpoints.hf import CheckpointError, load_hf_checkpoint
from dge_jax.config import ConfigError
from dge_jax.distribution.sharding import make_mesh
from dge_jax.generation import generate_grid
from dge_jax.text.prompts import check_request

_DROP = object()  # edit_config(folder, key=_DROP) removes the key


def edit_config(folder: pathlib.Path, **changes) -> None:
    """Sets (or, for the value `_DROP`, removes) keys of folder/config.json."""
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DROP:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


def edit_tensors(folder: pathlib.Path, edit) -> None:
    """Rewrites folder/model.safetensors with edit({name: array}) -> {name: array}."""
    path = folder / "model.safetensors"
    tensors = edit(dict(load_file(path)))
    save_file(tensors, path, metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------
# Folders and files


def test_missing_folder(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(CheckpointError, match="no_such_model.*does not exist"):
        load_hf_checkpoint(missing)
    # dge_jax.load also accepts embedded model names, so its message says what it tried.
    with pytest.raises(ValueError, match="no_such_model.*neither a checkpoint folder"):
        dge_jax.load(missing)


def test_missing_config(checkpoint_copy):
    folder = checkpoint_copy("llama")
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_checkpoint(folder)


def test_missing_safetensors_file(checkpoint_copy):
    folder = checkpoint_copy("llama")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_checkpoint(folder)


def test_truncated_safetensors_file(checkpoint_copy):
    folder = checkpoint_copy("llama")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated") as exc:
        load_hf_checkpoint(folder)
    assert str(exc.value).endswith(f"Download or copy the checkpoint into {folder} again")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_damaged_file_in_the_model_cache_says_to_delete_it(checkpoint, tmp_path, monkeypatch, name):
    """A cut file in a cached conversion (embedded model / .gguf): delete the folder, and the
    next load converts it again."""
    import shutil

    from dge_jax.checkpoints.embedded import cache_root

    monkeypatch.setenv("DGE_JAX_CACHE", str(tmp_path / "cache"))
    folder = cache_root() / "smollm2-135m-instruct-0123456789ab"
    shutil.copytree(checkpoint("llama_chat"), folder)
    data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as exc:
        dge_jax.load(folder)
    message = str(exc.value)
    assert message.startswith(f"cannot read {folder / name} (") and "\n" not in message
    assert message.endswith(
        f"{folder} is dge_jax's cached conversion of a GGUF model: delete it "
        f"(rm -r {folder}) and the next load converts it again"
    )


def test_shard_listed_in_index_but_missing(checkpoint_copy):
    folder = checkpoint_copy("llama_sharded")
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"shard.*missing.*{shards[1].name}"):
        load_hf_checkpoint(folder)


def test_pickle_only_folder_is_refused(checkpoint_copy):
    import torch

    folder = checkpoint_copy("llama")
    (folder / "model.safetensors").unlink()
    torch.save({"model.norm.weight": torch.ones(64)}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pickle.*safetensors"):
        load_hf_checkpoint(folder)


def test_unsupported_dtype(checkpoint):
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        load_hf_checkpoint(checkpoint("llama"), dtype="int8")


# ---------------------------------------------------------------------------------------------
# config.json


@pytest.mark.parametrize(
    "changes, error",
    [
        (dict(model_type="gpt2"),
         r"unknown model_type 'gpt2'.*supported: gemma2, .*llama, mistral, phi3, qwen2"),
        (dict(model_type=_DROP), r"no 'model_type'"),
        (
            dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
            r"rope type 'yarn'.*not supported",
        ),
        (
            dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}),
            r"rope type 'linear' needs \['factor'\]",
        ),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "beta_fast": 32}),
            r"unknown rope parameter\(s\) \['beta_fast'\]",
        ),
        (dict(attn_logit_softcapping=50.0), r"field\(s\) \['attn_logit_softcapping'\]"),
        (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
        (dict(num_attention_heads=4, num_key_value_heads=3), r"not a multiple"),
        (dict(vocab_size=_DROP), r"no 'vocab_size'"),
        (dict(rms_norm_eps=None),
         r"^config.json field rms_norm_eps is null, but it must be a positive number; set it"),
        (dict(max_position_embeddings=None),
         r"^config.json field max_position_embeddings is null, but it must be an integer >= 1"),
        (dict(num_hidden_layers="2"),
         r'^config.json field num_hidden_layers is "2" \(a string\), but it must be an integer'),
        (dict(tie_word_embeddings="false"),
         r'^config.json field tie_word_embeddings is "false" \(a string\), but it must be true '
         r"or false"),
    ],
    ids=[
        "unknown_model_type",
        "no_model_type",
        "rope_yarn",
        "rope_missing_factor",
        "rope_unknown_param",
        "unknown_numeric_key",
        "activation",
        "heads",
        "missing_vocab_size",
        "null_rms_norm_eps",
        "null_max_position_embeddings",
        "string_layers",
        "string_bool",
    ],
)  # fmt: skip
def test_bad_config(checkpoint_copy, changes, error):
    folder = checkpoint_copy("llama")
    edit_config(folder, **changes)
    with pytest.raises(ConfigError, match=error):
        load_hf_checkpoint(folder)


def test_transformers_bookkeeping_keys_load(checkpoint_copy, checkpoint):
    """What transformers 5.x keeps for itself (5.2 wrote `ignore_keys_at_rope_validation:
    null`) does not describe the model: the checkpoint loads as without it."""
    folder = checkpoint_copy("llama")
    edit_config(folder, ignore_keys_at_rope_validation=None, _commit_hash="0" * 40,
                attn_implementation="sdpa", _attn_implementation_autoset=True)  # fmt: skip
    _, cfg, params = load_hf_checkpoint(folder)
    _, expected, expected_params = load_hf_checkpoint(checkpoint("llama"))
    assert cfg == expected
    np.testing.assert_array_equal(params.layers.wq, expected_params.layers.wq)


def test_old_style_yarn_rope_scaling_is_refused(checkpoint_copy):
    """The pre-transformers-5 spelling (rope_scaling + rope_theta) is checked as strictly."""
    folder = checkpoint_copy("llama3_old")
    edit_config(folder, rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match=r"rope type 'yarn'.*not supported"):
        load_hf_checkpoint(folder)


def test_mistral_sliding_window_is_read(checkpoint_copy):
    """Mistral's window (transformers masks with it on every layer) becomes layer_windows."""
    folder = checkpoint_copy("mistral_old")
    edit_config(folder, sliding_window=16)  # < max_position_embeddings = 256
    _, cfg, _ = load_hf_checkpoint(folder)
    assert cfg.layer_windows == (16,) * cfg.num_layers


def test_qwen2_sliding_window_flag_slides_from_max_window_layers(checkpoint_copy):
    folder = checkpoint_copy("qwen2")
    # layer_types null: transformers derives them (the saved ones say "full" on every layer)
    edit_config(folder, use_sliding_window=True, sliding_window=16, max_window_layers=1,
                layer_types=None)  # fmt: skip
    _, cfg, _ = load_hf_checkpoint(folder)
    assert cfg.layer_windows == (0, 16)


# ---------------------------------------------------------------------------------------------
# Tensors against the key table and the config


def test_tensor_with_wrong_shape(checkpoint_copy):
    folder = checkpoint_copy("llama")
    edit_tensors(folder, lambda t: t | {"model.norm.weight": t["model.norm.weight"].reshape(8, 8)})
    with pytest.raises(CheckpointError, match=r"final_norm has shape \(8, 8\).*implies \(64,\)"):
        load_hf_checkpoint(folder)


def test_one_layer_with_wrong_shape(checkpoint_copy):
    folder = checkpoint_copy("llama")
    name = "model.layers.1.self_attn.k_proj.weight"  # [32, 64]
    edit_tensors(folder, lambda t: t | {name: t[name].reshape(64, 32)})
    with pytest.raises(CheckpointError, match=r"layers\.wk: layer\(s\) \[1\] have a shape"):
        load_hf_checkpoint(folder)


def test_config_disagreeing_with_weights(checkpoint_copy):
    folder = checkpoint_copy("llama")
    edit_config(folder, num_key_value_heads=1)  # the weights have 2 kv heads
    with pytest.raises(CheckpointError, match=r"layers\.wk has shape \(2, 64, 32\).*\(2, 64, 16\)"):
        load_hf_checkpoint(folder)


def test_extra_unmapped_tensor(checkpoint_copy):
    folder = checkpoint_copy("llama")
    extra = "model.layers.0.self_attn.rotary_emb.inv_freq"
    edit_tensors(folder, lambda t: t | {extra: np.ones(8, np.float32)})
    with pytest.raises(CheckpointError, match=rf"{extra.replace('.', '[.]')}.*matches no param"):
        load_hf_checkpoint(folder)


def test_tensor_the_config_does_not_expect(checkpoint_copy):
    """A q bias in a checkpoint whose config says attention_bias=false."""
    folder = checkpoint_copy("llama")
    extra = "model.layers.0.self_attn.q_proj.bias"
    edit_tensors(folder, lambda t: t | {extra: np.ones(64, np.float32)})
    with pytest.raises(CheckpointError, match=r"q_proj\.bias.*not expected by this config"):
        load_hf_checkpoint(folder)


def test_missing_tensor_of_one_layer(checkpoint_copy):
    folder = checkpoint_copy("llama")
    edit_tensors(folder, lambda t: {k: v for k, v in t.items() if "1.mlp.up_proj" not in k})
    with pytest.raises(CheckpointError, match=r"layers\.w_up is missing for layer\(s\) \[1\]"):
        load_hf_checkpoint(folder)


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
@pytest.mark.parametrize("layers, message", [
    (1, r"has weights for layer\(s\) \[1\], which config.json does not declare "
        r"\(num_hidden_layers=1: layer 0\)"),
    (4, r"has no weights for layer\(s\) \[2, 3\], but config.json declares "
        r"num_hidden_layers=4"),
], ids=["fewer_declared", "more_declared"])
def test_layer_count_and_weights_disagree(checkpoint_copy, sharded, layers, message):
    """num_hidden_layers against 2 layers of weights: the layers in excess or missing are
    named, with both fixes (not "missing for layer(s) []"); both readers (`convert`,
    `plan_tensors`)."""
    folder = checkpoint_copy("llama")
    edit_config(folder, num_hidden_layers=layers)
    fixes = (r"; use the config.json saved with these weights, or set num_hidden_layers to 2 "
             r"if the model has that many layers$")
    with pytest.raises(CheckpointError, match=r"^the checkpoint " + message + fixes):
        load_hf_checkpoint(folder, mesh=make_mesh(1, 1) if sharded else None)


def test_a_layer_one_tensor_lacks_is_named_when_sharded(checkpoint_copy):
    folder = checkpoint_copy("llama")
    edit_tensors(folder, lambda t: {k: v for k, v in t.items() if "1.mlp.up_proj" not in k})
    with pytest.raises(CheckpointError, match=r"layers\.w_up is missing for layer\(s\) \[1\] "
                                              r"\(its other layers are there\)"):  # fmt: skip
        load_hf_checkpoint(folder, mesh=make_mesh(1, 1))


def test_missing_untied_head(checkpoint_copy):
    folder = checkpoint_copy("llama")  # tie_word_embeddings=false
    edit_tensors(folder, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    with pytest.raises(CheckpointError, match=r"lacks tensors for parameter\(s\) \['lm_head'\]"):
        load_hf_checkpoint(folder)


# ---------------------------------------------------------------------------------------------
# Requests


@pytest.fixture(scope="module")
def model(checkpoint):
    return dge_jax.load(checkpoint("llama"))


def test_empty_prompt(model, checkpoint):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        dge_jax.generate(model, [[1, 2, 3], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="no prompts given"):
        dge_jax.generate(model, [], max_new_tokens=4)
    chat_model = dge_jax.load(checkpoint("llama_chat"))
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        dge_jax.generate(chat_model, "", max_new_tokens=4)


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_below_one(model, n):
    with pytest.raises(ValueError, match=rf"max_new_tokens must be >= 1, got {n}"):
        dge_jax.generate(model, [[1, 2, 3]], max_new_tokens=n)


@pytest.mark.parametrize("n", [256, 10**9])
def test_max_new_tokens_beyond_the_context(model, n):
    """A request longer than the model's context by itself: lower max_new_tokens (truncating
    the prompt, what a long prompt is told, would not help)."""
    message = (rf"^max_new_tokens={n} leaves no room for a prompt in the model's context of "
               r"256 positions \(prompt and new tokens share it\); lower max_new_tokens below 256$")
    with pytest.raises(ValueError, match=message):
        dge_jax.generate(model, [[1, 2, 3]], max_new_tokens=n)
    with pytest.raises(ValueError, match=message):
        generate_grid(model, [[1, 2, 3]], [None], max_new_tokens=n)
    check_request(model.config, [[1]], 255)  # one prompt token and 255 new ones fill it exactly


@pytest.mark.parametrize("n", [2.0, True, "8"])
def test_max_new_tokens_not_an_int(model, n):
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        check_request(model.config, [[1, 2, 3]], n)


@pytest.mark.parametrize(
    "n, error, message",
    [
        (5, ValueError, r"min_new_tokens must be in \[0, max_new_tokens=4\], got 5"),
        (-1, ValueError, r"min_new_tokens must be in \[0, max_new_tokens=4\], got -1"),
        (1.0, TypeError, "min_new_tokens must be an int"),
    ],
)
def test_min_new_tokens_outside_zero_to_max(model, n, error, message):
    """EOS is banned for min_new_tokens steps: more than max_new_tokens cannot be honoured."""
    with pytest.raises(error, match=message):
        dge_jax.generate(model, [[1, 2, 3]], max_new_tokens=4, min_new_tokens=n)
    with pytest.raises(error, match=message):
        generate_grid(model, [[1, 2, 3]], [None], max_new_tokens=4, min_new_tokens=n)
    check_request(model.config, [[1, 2, 3]], 4, 4)  # min == max: exactly max tokens, no EOS


def test_chat_with_token_id_prompts_is_refused(checkpoint):
    chat_model = dge_jax.load(checkpoint("llama_chat"))
    message = r"chat=True applies the chat template to text prompts; .* token ids"
    with pytest.raises(ValueError, match=message):
        dge_jax.generate(chat_model, [[5, 6, 7]], max_new_tokens=2, chat=True)
    with pytest.raises(ValueError, match=message):
        generate_grid(chat_model, [np.array([5, 6])], [None], max_new_tokens=2, chat=True)


def test_prompt_longer_than_context(checkpoint_copy):
    folder = checkpoint_copy("llama")
    edit_config(folder, max_position_embeddings=48)
    model = dge_jax.load(folder)
    with pytest.raises(ValueError, match=r"prompt 0 has 49 tokens.*context of 48 positions"):
        dge_jax.generate(model, [[5] * 49], max_new_tokens=1)
    # The prompt fits, but not with the tokens asked for.
    with pytest.raises(ValueError, match=r"prompt 1 has 40 tokens.*max_new_tokens=16.*48"):
        dge_jax.generate(model, [[5] * 10, [5] * 40], max_new_tokens=16)
    # Exactly at the limit is fine (and a single new token is a valid request).
    check_request(model.config, [[5] * 47], 1)
    check_request(model.config, [[5] * 40], 8)


def test_token_ids_outside_vocab(model):
    with pytest.raises(ValueError, match=r"outside \[0, 128\): \[128, -1\]"):
        dge_jax.generate(model, [[1, 128, 2, -1]], max_new_tokens=2)


def test_text_prompt_without_tokenizer(model):
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        dge_jax.generate(model, ["hello world"], max_new_tokens=2)
