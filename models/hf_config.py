"""Strict reading of Hugging Face `config.json` files into `ModelConfig`.

Keys fall in three groups: read (they set a `ModelConfig` field), checked (they must hold a
value this library implements, e.g. `hidden_act == "silu"`, `rope_interleaved == false`, or a
bias flag only where the family has that bias), and inert (bookkeeping such as `architectures`
or `use_cache`, transformers' own serialization bookkeeping, `TRANSFORMERS_BOOKKEEPING`, and
what nanotron and transformers.js write besides). Any other key is an error: an unknown key may
change the numerics, and a silent wrong answer is worse than a clear refusal.

Values are typed as transformers 5's strict config classes type them (`models/hf_values.py`;
null is the default only where transformers reads it so: `num_key_value_heads`, `head_dim`);
RoPE parameters are read by `models/hf_rope.py`.
"""

from __future__ import annotations

from typing import Any

from dge_jax.config import ConfigError, ModelConfig
from models.hf_rope import parse_rope
from models.hf_values import bad_value, read_bool, read_float, read_int

# Keys transformers 5.x keeps for itself and ignores when it reads a config.json: what
# `PreTrainedConfig._remove_keys_not_serialized` drops on save (5.25; earlier 5.x releases
# wrote some of them, e.g. `ignore_keys_at_rope_validation: null` by 5.2), what its
# `__post_init__` pops or skips on load (`_commit_hash`, the `_attn_implementation` /
# `_experts_implementation` spellings; 4.4x wrote `_attn_implementation_autoset`), and the
# attention / experts kernel choices, which pick an implementation of the same numerics. None
# of them describes the model.
TRANSFORMERS_BOOKKEEPING = frozenset(
    {
        "ignore_keys_at_rope_validation",
        "_is_quantized",
        "_auto_class",
        "_commit_hash",
        "_post_init_done",
        "_output_attentions",
        "_attn_implementation",
        "_attn_implementation_internal",
        "_attn_implementation_autoset",
        "attn_implementation",
        "_experts_implementation",
        "_experts_implementation_internal",
        "experts_implementation",
        "base_model_tp_plan",
        "base_model_pp_plan",
        "base_model_ep_plan",
        "base_model_fsdp_plan",
        "distributed_config",
    }
)

INERT_KEYS = TRANSFORMERS_BOOKKEEPING | frozenset(
    {
        "_name_or_path",
        "_model_name_or_path",
        "architectures",
        "attention_dropout",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "unk_token_id",
        "chunk_size_feed_forward",
        "dtype",
        "torch_dtype",
        "id2label",
        "label2id",
        "initializer_range",
        "is_encoder_decoder",
        "model_type",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
        "transformers_version",
        "use_cache",
        "pretraining_tp",
        "max_window_layers",
        "tokenizer_class",
        "bos_token",
        "eos_token",
        "quantization_config_none",
        "finetuning_task",
        "task_specific_params",
        "tie_encoder_decoder",
        "torchscript",
        "add_cross_attention",
        "cross_attention_hidden_size",
        "decoder_start_token_id",
        "sep_token_id",
        "prefix",
        "is_decoder",
        "use_bfloat16",
        "tf_legacy_loss",
        "pruned_heads",
        "architectures_",
        "embd_pdrop",
        "resid_pdrop",
        "layer_types",
        "sliding_window",
        "use_sliding_window",
        "attention_bias",
        "mlp_bias",
        "head_dim",
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "tie_word_embeddings",
        "hidden_act",
        "partial_rotary_factor",
        "rope_interleaved",  # nanotron (SmolLM); checked: only false (split halves)
        "is_llama_config",  # nanotron's export marker
        "transformers.js_config",  # ONNX export settings (kv cache dtypes)
    }
)

# Bias switches: a family reads those its transformers model has (`bias_keys`); a true value
# of another is refused (transformers would ignore it and drop the checkpoint's bias tensors).
BIAS_KEYS = ("attention_bias", "mlp_bias")

# hidden_act / hidden_activation values -> ModelConfig.hidden_act.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}

READ_KEYS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "max_position_embeddings",
    }
)


def parse_llama_like(
    raw: dict[str, Any],
    family: str,
    *,
    qkv_bias: bool = False,
    o_bias: bool = False,
    qk_norm: bool = False,
    bias_keys: frozenset[str] = frozenset(),
    extra_inert: frozenset[str] = frozenset(),
    activations: frozenset[str] = frozenset({"silu"}),
    **switches: Any,
) -> ModelConfig:
    """The common part of every family's parser; families pass their fixed switches.

    bias_keys: the `BIAS_KEYS` this family honours (its parser reads `attention_bias` itself;
    `mlp_bias` is read here when listed); a true value of any other is refused. activations:
    the `hidden_act` / `hidden_activation` values the family runs (`ACTIVATIONS`' keys).
    Sliding windows: `layer_windows` (the family's rule, `_layer_windows`).
    """
    unknown = set(raw) - INERT_KEYS - READ_KEYS - extra_inert
    if unknown:
        raise ConfigError(
            f"config.json of this {family} checkpoint has field(s) {sorted(unknown)} that this "
            "library does not know; they may change the numerics, so loading stops here"
        )
    act_key = "hidden_activation" if "hidden_activation" in raw else "hidden_act"
    act = raw.get(act_key, "silu")
    if not isinstance(act, str):
        raise bad_value(act_key, act, f"one of {sorted(activations)}")
    if act not in activations:
        raise ConfigError(
            f"hidden_act={act!r} is not supported for {family} (only {sorted(activations)})"
        )
    if read_bool(raw, "rope_interleaved", False, null_default=True):
        raise ConfigError(
            "rope_interleaved=true: interleaved RoPE (rotating pairs 2i, 2i+1) is not "
            "supported; this library rotates split halves, as transformers' Llama does"
        )
    for key in BIAS_KEYS:
        if read_bool(raw, key, False) and key not in bias_keys:
            raise ConfigError(
                f"{key}=true in this {family} config, but {family} has no such biases here (nor "
                "in transformers, which ignores the flag and drops any bias tensors); loading "
                "stops here"
            )
    heads = read_int(raw, "num_attention_heads")
    hidden = read_int(raw, "hidden_size")
    num_layers = read_int(raw, "num_hidden_layers")
    max_pos = read_int(raw, "max_position_embeddings", 4096)
    return ModelConfig(
        family=family,
        vocab_size=read_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=read_int(raw, "intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=read_int(raw, "num_key_value_heads", heads, null_default=True),
        head_dim=read_int(raw, "head_dim", hidden // heads, null_default=True),
        rms_norm_eps=read_float(raw, "rms_norm_eps", 1e-6),
        rope=parse_rope(raw),
        max_position_embeddings=max_pos,
        tie_word_embeddings=read_bool(raw, "tie_word_embeddings", False),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias="mlp_bias" in bias_keys and read_bool(raw, "mlp_bias", False),
        qk_norm=qk_norm,
        layer_windows=_layer_windows(raw, family, num_layers, max_pos),
        **switches,
        hidden_act=ACTIVATIONS[act],
    )


def _layer_windows(
    raw: dict[str, Any], family: str, num_layers: int, max_pos: int
) -> tuple[int, ...]:
    """Each layer's sliding window (0: global; () when every layer is global), as transformers
    reads the config:

    - mistral (and phi3): every layer slides when `sliding_window` is set (Mistral v0.1:
      4096), whatever `max_position_embeddings` says;
    - qwen2 / qwen3: only with `use_sliding_window`; then `layer_types` if given, else the
      layers from `max_window_layers` on;
    - gemma2 / gemma3_text: `layer_types`, else Gemma 2 alternates (sliding first) and Gemma
      3 makes every `sliding_window_pattern`-th layer (default 6) global;
    - llama: transformers' Llama has no sliding window; a window shorter than the context is
      refused (the checkpoint was probably trained with one).
    """
    window = raw.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window <= 0):  # fmt: skip
        raise ConfigError(f"sliding_window={window!r}: a window is a positive number of tokens")
    layer_types = raw.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types)
    ):
        raise bad_value("layer_types", layer_types, "a list of layer kinds (or null)")
    if family in ("gemma2", "gemma3_text") and layer_types is None:
        # transformers' defaults: Gemma 2 alternates, sliding first; Gemma 3 makes every
        # `sliding_window_pattern`-th layer global (6: five sliding, then one global).
        every = 2 if family == "gemma2" else read_int(raw, "sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % every else "full_attention"
                       for i in range(num_layers)]  # fmt: skip
    if layer_types is not None and len(layer_types) != num_layers:
        raise ConfigError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = set(layer_types or ()) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ConfigError(f"layer_types has unknown kind(s) {sorted(unknown)}")
    if family in ("gemma2", "gemma3_text"):
        if "sliding_attention" in layer_types and window is None:
            raise ConfigError(f"{family} config has sliding layers but no sliding_window")
        return tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types)
    if family in ("qwen2", "qwen3"):
        first = read_int(raw, "max_window_layers", num_layers, minimum=0)
        if not read_bool(raw, "use_sliding_window", False) or window is None:
            return ()
        if layer_types is None:
            layer_types = ["sliding_attention" if i >= first else "full_attention"
                           for i in range(num_layers)]  # fmt: skip
        return tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types)
    if family in ("mistral", "phi3"):
        if layer_types is not None and set(layer_types) != {"full_attention"}:
            raise ConfigError(f"{family} with per-layer layer_types is not supported")
        return () if window is None else (int(window),) * num_layers
    if window is not None and int(window) < max_pos or "sliding_attention" in (layer_types or ()):
        raise ConfigError(
            f"sliding_window={window} is active in this {family} config, but {family} "
            "(as transformers runs it) has no sliding window; loading stops here"
        )
    return ()
