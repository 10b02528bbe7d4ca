"""Real `config.json` files of popular checkpoints parse to the right `ModelConfig`.

The files below are the checkpoints' own config.json (Hugging Face Hub, main branch), written
out verbatim so that the strict parser is tested against what users actually load, not only
against what today's transformers writes. They go through `checkpoint.parse_config`, the entry
`load` uses (family by model_type, then the family's strict parser). The same configs, read by
transformers 5 and written back with `save_pretrained`, must parse to the same result.
"""

from __future__ import annotations

import json

import pytest

from dge_jax.checkpoints.hf import parse_config
from dge_jax.config import ConfigError

LLAMA_2_7B = """{
  "_name_or_path": "meta-llama/Llama-2-7b-hf",
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 11008,
  "max_position_embeddings": 4096,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 32,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "tie_word_embeddings": false,
  "torch_dtype": "float16",
  "transformers_version": "4.31.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
}"""

LLAMA_31_8B_INSTRUCT = """{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.42.3",
  "use_cache": true,
  "vocab_size": 128256
}"""

LLAMA_32_1B = """{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
}"""

MISTRAL_7B_INSTRUCT_V02 = """{
  "architectures": ["MistralForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.36.0",
  "use_cache": true,
  "vocab_size": 32000
}"""

MISTRAL_7B_INSTRUCT_V03 = """{
  "architectures": ["MistralForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.42.0.dev0",
  "use_cache": true,
  "vocab_size": 32768
}"""

# Mistral 7B v0.1 attends over a 4096-token sliding window on every layer (transformers applies
# it): parsed as layer_windows.
MISTRAL_7B_V01 = """{
  "architectures": ["MistralForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "sliding_window": 4096,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.34.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
}"""

QWEN25_7B_INSTRUCT = """{
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "hidden_act": "silu",
  "hidden_size": 3584,
  "initializer_range": 0.02,
  "intermediate_size": 18944,
  "max_position_embeddings": 32768,
  "max_window_layers": 28,
  "model_type": "qwen2",
  "num_attention_heads": 28,
  "num_hidden_layers": 28,
  "num_key_value_heads": 4,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 131072,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.1",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 152064
}"""

QWEN3_8B = """{
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 12288,
  "max_position_embeddings": 40960,
  "max_window_layers": 36,
  "model_type": "qwen3",
  "num_attention_heads": 32,
  "num_hidden_layers": 36,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}"""

# Exported by nanotron: is_llama_config, rope_interleaved, and transformers.js's settings.
SMOLLM2_135M_INSTRUCT = """{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 576,
  "initializer_range": 0.041666666666666664,
  "intermediate_size": 1536,
  "is_llama_config": true,
  "max_position_embeddings": 8192,
  "model_type": "llama",
  "num_attention_heads": 9,
  "num_hidden_layers": 30,
  "num_key_value_heads": 3,
  "pad_token_id": 2,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_interleaved": false,
  "rope_scaling": null,
  "rope_theta": 100000,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers.js_config": {
    "kv_cache_dtype": {
      "q4f16": "float16",
      "fp16": "float16"
    }
  },
  "transformers_version": "4.42.3",
  "use_cache": true,
  "vocab_size": 49152
}"""

TINYLLAMA_11B_CHAT = """{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 5632,
  "max_position_embeddings": 2048,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 22,
  "num_key_value_heads": 4,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 10000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.35.0",
  "use_cache": true,
  "vocab_size": 32000
}"""

LLAMA3_ROPE_8 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
LLAMA3_ROPE_32 = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)

# name: (config.json, expected ModelConfig fields; rope = (kind, theta, extra RopeConfig fields))
CHECKPOINTS = {
    "meta-llama/Llama-2-7b-hf": (
        LLAMA_2_7B,
        dict(family="llama", num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
             rope=("default", 10000.0, {}), tie_word_embeddings=False, vocab_size=32000),
    ),
    "meta-llama/Llama-3.1-8B-Instruct": (
        LLAMA_31_8B_INSTRUCT,
        dict(family="llama", num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
             rope=("llama3", 500000.0, LLAMA3_ROPE_8), tie_word_embeddings=False,
             vocab_size=128256),
    ),
    "meta-llama/Llama-3.2-1B": (
        LLAMA_32_1B,
        dict(family="llama", num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
             rope=("llama3", 500000.0, LLAMA3_ROPE_32), tie_word_embeddings=True,
             vocab_size=128256),
    ),
    "mistralai/Mistral-7B-Instruct-v0.2": (
        MISTRAL_7B_INSTRUCT_V02,
        dict(family="mistral", num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
             rope=("default", 1e6, {}), tie_word_embeddings=False, vocab_size=32000),
    ),
    "mistralai/Mistral-7B-Instruct-v0.3": (
        MISTRAL_7B_INSTRUCT_V03,
        dict(family="mistral", num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
             rope=("default", 1e6, {}), tie_word_embeddings=False, vocab_size=32768),
    ),
    "Qwen/Qwen2.5-7B-Instruct": (
        QWEN25_7B_INSTRUCT,
        dict(family="qwen2", num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
             rope=("default", 1e6, {}), tie_word_embeddings=False, qkv_bias=True,
             o_bias=False, vocab_size=152064),
    ),
    "Qwen/Qwen3-8B": (
        QWEN3_8B,
        dict(family="qwen3", num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
             rope=("default", 1e6, {}), tie_word_embeddings=False, qk_norm=True,
             qkv_bias=False, vocab_size=151936),
    ),
    "HuggingFaceTB/SmolLM2-135M-Instruct": (
        SMOLLM2_135M_INSTRUCT,
        dict(family="llama", num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
             rope=("default", 100000.0, {}), tie_word_embeddings=True, vocab_size=49152),
    ),
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": (
        TINYLLAMA_11B_CHAT,
        dict(family="llama", num_layers=22, num_heads=32, num_kv_heads=4, head_dim=64,
             rope=("default", 10000.0, {}), tie_word_embeddings=False, vocab_size=32000),
    ),
}  # fmt: skip


def check_fields(cfg, expected: dict) -> None:
    expected = dict(expected)
    kind, theta, rope_fields = expected.pop("rope")
    assert (cfg.rope.kind, cfg.rope.theta) == (kind, theta)
    for name, value in rope_fields.items():
        assert getattr(cfg.rope, name) == value, name
    if kind == "llama3":
        assert cfg.rope.original_max_position_embeddings == 8192
    for name, value in expected.items():
        assert getattr(cfg, name) == value, name


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_real_config_parses(name):
    text, expected = CHECKPOINTS[name]
    family, cfg = parse_config(json.loads(text))
    assert family.model_type == expected["family"]
    check_fields(cfg, expected)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_config_rewritten_by_transformers_parses_alike(name, tmp_path):
    """transformers 5 reads the file and writes it back (rope_parameters, dtype, layer_types,
    keys it keeps from the original such as nanotron's): same ModelConfig."""
    transformers = pytest.importorskip("transformers")
    raw = json.loads(CHECKPOINTS[name][0])
    transformers.AutoConfig.for_model(**raw).save_pretrained(tmp_path)
    rewritten = json.loads((tmp_path / "config.json").read_text())
    assert parse_config(rewritten)[1] == parse_config(raw)[1]


def test_sliding_windows_as_transformers_reads_them():
    """Mistral v0.1: every layer slides (4096); Qwen2 only with use_sliding_window, from
    max_window_layers on; Llama has no sliding window in transformers, so an active one is
    refused."""
    raw = json.loads(MISTRAL_7B_V01)
    cfg = parse_config(raw)[1]
    assert cfg.layer_windows == (4096,) * 32 and cfg.sliding_layers == tuple(range(32))
    assert parse_config(raw | {"sliding_window": None})[1].layer_windows == ()
    qwen = {"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 4, "num_attention_heads": 2, "sliding_window": 16,
            "max_window_layers": 2}  # fmt: skip
    assert parse_config(qwen)[1].layer_windows == ()
    assert parse_config(qwen | {"use_sliding_window": True})[1].layer_windows == (0, 0, 16, 16)
    llama = qwen | {"model_type": "llama", "max_position_embeddings": 64}
    with pytest.raises(ConfigError, match=r"sliding_window=16 is active.*no sliding window"):
        parse_config(llama)
    with pytest.raises(ConfigError, match=r"sliding_window=0: a window is a positive number"):
        parse_config(raw | {"sliding_window": 0})


def test_interleaved_rope_is_refused():
    raw = json.loads(SMOLLM2_135M_INSTRUCT) | {"rope_interleaved": True}
    with pytest.raises(ConfigError, match="rope_interleaved=true: interleaved RoPE .* not supp"):
        parse_config(raw)


def test_llama_attention_bias_means_qkvo_biases():
    """transformers' LlamaAttention puts `attention_bias` on q, k, v and o_proj; so do we."""
    transformers = pytest.importorskip("transformers")
    raw = json.loads(TINYLLAMA_11B_CHAT) | {"attention_bias": True, "mlp_bias": True}
    cfg = parse_config(raw)[1]
    assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias
    tiny = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        vocab_size=8, attention_bias=True, mlp_bias=True,
    )  # fmt: skip
    layer = transformers.LlamaForCausalLM(tiny).model.layers[0]
    attn = layer.self_attn
    assert all(p.bias is not None for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
    assert layer.mlp.down_proj.bias is not None


@pytest.mark.parametrize(
    "text, key",
    [
        (MISTRAL_7B_INSTRUCT_V03, "attention_bias"),
        (MISTRAL_7B_INSTRUCT_V03, "mlp_bias"),
        (QWEN25_7B_INSTRUCT, "attention_bias"),
        (QWEN3_8B, "mlp_bias"),
    ],
    ids=["mistral-attention", "mistral-mlp", "qwen2-attention", "qwen3-mlp"],
)
def test_bias_flag_the_family_ignores_is_refused(text, key):
    """transformers' Mistral / Qwen2 / Qwen3 ignore these flags: a true one is refused, not
    silently dropped (false, as transformers writes for Qwen3's attention_bias, is fine)."""
    raw = json.loads(text)
    parse_config(raw | {key: False})
    with pytest.raises(ConfigError, match=rf"{key}=true in this .* has no such biases"):
        parse_config(raw | {key: True})


# --- null and mistyped values; transformers' bookkeeping keys ----------------------------------

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
FAMILIES = {  # a tiny config.json of each family, as transformers 5 writes the family's keys
    "llama": TINY | {"model_type": "llama", "rms_norm_eps": 1e-5, "attention_bias": False,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
    "mistral": TINY | {"model_type": "mistral", "sliding_window": None},
    "qwen2": TINY | {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 8,
                     "max_window_layers": 1},
    "phi3": TINY | {"model_type": "phi3", "rms_norm_eps": 1e-5, "sliding_window": 128,
                    "original_max_position_embeddings": 64},
    "gemma2": TINY | {"model_type": "gemma2", "head_dim": 16, "sliding_window": 8,
                      "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0},
    "gemma3_text": TINY | {"model_type": "gemma3_text", "head_dim": 16, "sliding_window": 8,
                           "rope_local_base_freq": 1e4},
}  # fmt: skip
# What each value type must be, as the messages say it.
INT, FLOAT, BOOL = "an integer >= 1", "a positive number", "true or false"
TYPED = {
    "vocab_size": INT, "hidden_size": INT, "intermediate_size": INT, "num_hidden_layers": INT,
    "num_attention_heads": INT, "max_position_embeddings": INT, "rms_norm_eps": FLOAT,
    "rope_theta": FLOAT, "tie_word_embeddings": BOOL,
}  # fmt: skip
FAMILY_TYPED = {
    "llama": {"attention_bias": BOOL, "mlp_bias": BOOL},
    "qwen2": {"use_sliding_window": BOOL, "max_window_layers": "an integer >= 0"},
    "phi3": {"original_max_position_embeddings": INT},
    "gemma2": {"query_pre_attn_scalar": FLOAT, "final_logit_softcapping": FLOAT,
               "head_dim": INT},
    "gemma3_text": {"rope_local_base_freq": FLOAT, "sliding_window_pattern": INT},
}  # fmt: skip
SHOWN = {None: "null", "abc": '"abc" (a string)', True: "true (a boolean)", 2.5: "2.5"}


def _typed_cases():
    for family, raw in FAMILIES.items():
        for key, what in {**TYPED, **FAMILY_TYPED.get(family, {})}.items():  # ordered
            for value in SHOWN:
                if value == 2.5 and what == FLOAT or value is True and what == BOOL:
                    continue  # valid
                if value is None and key.endswith("softcapping"):
                    continue  # null: no cap (test_null_is_the_default_...)
                if key == "rope_theta" and "rope_parameters" in raw:
                    continue  # read from rope_parameters (below)
                yield pytest.param(family, key, value, what, id=f"{family}-{key}-{value}")


@pytest.mark.parametrize("family, key, value, what", list(_typed_cases()))
def test_a_null_or_mistyped_field_is_named_with_what_it_must_be(family, key, value, what):
    """No float()/int() error, no bool("false") silently true: the field, its value and what
    it must be (transformers 5's strict config classes refuse these too)."""
    raw = FAMILIES[family] | {key: value}
    with pytest.raises(ConfigError) as error:
        parse_config(raw)
    assert str(error.value) == (
        f"config.json field {key} is {SHOWN[value]}, but it must be {what}; set it to the "
        "value the checkpoint was made with"
    )


@pytest.mark.parametrize(
    "change, name, shown, what",
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": None}},
         "rope_parameters.rope_theta", "null", FLOAT),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": "2"}},
         "rope_parameters.factor", '"2" (a string)', FLOAT),
        ({"rope_parameters": "default"}, "rope_parameters", '"default" (a string)',
         "an object (or null)"),
        ({"layer_types": "full_attention"}, "layer_types", '"full_attention" (a string)',
         "a list of layer kinds (or null)"),
        ({"hidden_act": None}, "hidden_act", "null", "one of ['silu']"),
    ],
)  # fmt: skip
def test_nested_and_structured_fields_are_named_too(change, name, shown, what):
    with pytest.raises(ConfigError) as error:
        parse_config(FAMILIES["llama"] | change)
    start = f"config.json field {name} is {shown}, but it must be {what}"
    assert str(error.value).startswith(start)


def test_gemma3_per_layer_kind_rope_fields_are_named_by_their_path():
    raw = FAMILIES["gemma3_text"] | {"rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": None, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"^config.json field rope_parameters.full_attention."
                                          r"factor is null, but it must be a positive number"):
        parse_config(raw)


def test_null_is_the_default_where_transformers_reads_it_so():
    """num_key_value_heads and head_dim: null derives them (transformers' Llama, Mistral,
    Qwen2, Phi-3 do); a null soft cap is no cap; null rope_scaling is the default RoPE."""
    transformers = pytest.importorskip("transformers")
    raw = FAMILIES["llama"] | {"num_key_value_heads": None, "head_dim": None}
    cfg = parse_config(raw)[1]
    hf = transformers.LlamaConfig.from_dict({k: v for k, v in raw.items() if k != "model_type"})
    assert (cfg.num_kv_heads, cfg.head_dim) == (hf.num_key_value_heads, hf.head_dim) == (4, 16)
    gemma = parse_config(FAMILIES["gemma2"] | {"attn_logit_softcapping": None})[1]
    assert gemma.attn_softcap is None
    old = {k: v for k, v in FAMILIES["llama"].items() if k != "rope_parameters"}
    assert parse_config(old | {"rope_scaling": None})[1].rope.kind == "default"


def test_an_absent_required_field_says_to_add_it():
    raw = {k: v for k, v in FAMILIES["llama"].items() if k != "num_hidden_layers"}
    with pytest.raises(ConfigError, match=r"^config.json has no 'num_hidden_layers', which the "
                                          r"model needs; add it with the value"):  # fmt: skip
        parse_config(raw)


def _bookkeeping_dropped_by_transformers() -> set[str]:
    """The keys `PreTrainedConfig._remove_keys_not_serialized` drops on save (read from its
    source: what transformers 5 keeps to itself and earlier 5.x releases wrote)."""
    import ast
    import inspect
    import textwrap

    transformers = pytest.importorskip("transformers")
    source = textwrap.dedent(inspect.getsource(
        transformers.PreTrainedConfig._remove_keys_not_serialized))  # fmt: skip
    loop = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.For))
    return {ast.literal_eval(e) for e in loop.iter.elts}


def test_transformers_bookkeeping_covers_what_transformers_keeps_to_itself():
    from models.hf_config import TRANSFORMERS_BOOKKEEPING

    dropped = _bookkeeping_dropped_by_transformers()
    assert "ignore_keys_at_rope_validation" in dropped  # the list was read
    assert dropped <= TRANSFORMERS_BOOKKEEPING


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_bookkeeping_keys_change_nothing(family):
    """A config.json saved by transformers 5.2 carries `ignore_keys_at_rope_validation: null`
    (5.25 drops it on save); it and transformers' other bookkeeping keys parse as without."""
    from models.hf_config import TRANSFORMERS_BOOKKEEPING

    raw = FAMILIES[family]
    with_keys = raw | {key: None for key in TRANSFORMERS_BOOKKEEPING} | {
        "ignore_keys_at_rope_validation": ["mrope_section"], "attn_implementation": "sdpa"}
    assert parse_config(raw | {"ignore_keys_at_rope_validation": None}) == parse_config(raw)
    assert parse_config(with_keys) == parse_config(raw)


ROPES = {  # a rope of each type this library runs, as rope_parameters
    "default": {"rope_type": "default", "rope_theta": 1e4},
    "linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}  # fmt: skip


@pytest.mark.parametrize("kind", list(ROPES))
def test_listing_a_required_rope_key_is_refused_as_transformers_refuses_it(kind):
    """transformers drops the listed keys before its rope checks: a required one is then
    missing and the config does not load; here it is refused naming the list and the key."""
    transformers = pytest.importorskip("transformers")
    from models.hf_rope import ROPE_REQUIRED

    raw = FAMILIES["llama"] | {"rope_parameters": ROPES[kind]}
    hf_raw = {k: v for k, v in raw.items() if k != "model_type"}
    for key in sorted(ROPE_REQUIRED[kind]):
        listed = {"ignore_keys_at_rope_validation": [key]}
        with pytest.raises(KeyError, match="Missing required keys"):
            transformers.LlamaConfig.from_dict(hf_raw | listed)
        with pytest.raises(ConfigError, match=rf"lists \['{key}'\], which rope type '{kind}' "
                                              r"needs; transformers then counts it as missing"):
            parse_config(raw | listed)
    optional = {"ignore_keys_at_rope_validation": ["partial_rotary_factor", "rope_theta"]}
    if "rope_theta" not in ROPE_REQUIRED[kind]:
        transformers.LlamaConfig.from_dict(hf_raw | optional)
        assert parse_config(raw | optional) == parse_config(raw)


def test_an_ignored_rope_key_is_checked_in_each_gemma3_layer_kind():
    raw = FAMILIES["gemma3_text"] | {"ignore_keys_at_rope_validation": ["scale"],
                                     "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "scale": 2}}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"unknown rope parameter\(s\) \['scale'\] in "
                                          r"rope_parameters.sliding_attention: config.json's"):
        parse_config(raw)
    with pytest.raises(ConfigError, match=r"lists \['factor'\], which rope type 'linear'"):
        parse_config(raw | {"ignore_keys_at_rope_validation": ["factor"]})


@pytest.mark.parametrize("value", ["factor", {"factor": True}, [1]])
def test_ignore_keys_at_rope_validation_is_null_or_a_list_of_names(value):
    with pytest.raises(ConfigError, match=r"^config.json field ignore_keys_at_rope_validation "
                                          r"is .*, but it must be null or a list of rope"):
        parse_config(FAMILIES["phi3"] | {"ignore_keys_at_rope_validation": value})
