"""Strict reading of Hugging Face `config.json` files into `ModelConfig`.

Keys fall in three groups: read (they set a `ModelConfig` field), checked (they must hold a
value this library implements, e.g. `hidden_act == "silu"`, `rope_interleaved == false`, or a
bias flag only where the family has that bias), and inert (bookkeeping such as `architectures`
or `use_cache`, and what transformers, nanotron and transformers.js write besides). Any other
key is an error: an unknown key may change the numerics, and a silent wrong answer is worse
than a clear refusal.
"""

from __future__ import annotations

import math
from typing import Any

from dge_jax.config import ConfigError, ModelConfig, RopeConfig

INERT_KEYS = frozenset(
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


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw or raw[key] is None:
        raise ConfigError(f"config.json has no {key!r}, which the model needs")
    return raw[key]


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """RopeConfig from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or {})
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        if "rope_theta" in raw:
            params.setdefault("rope_theta", raw["rope_theta"])
    kind = params.pop("rope_type", params.pop("type", "default")) or "default"
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if kind == "default":
        expected: set[str] = set()
    elif kind == "linear":
        expected = {"factor"}
    elif kind == "llama3":
        expected = {
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        }
    elif kind == "longrope":
        return _parse_longrope(raw, params, theta)
    else:
        raise ConfigError(
            f"rope type {kind!r} (config rope_parameters/rope_scaling) is not supported; "
            "supported: default, linear, llama3, longrope"
        )
    unknown = set(params) - expected
    if unknown:
        raise ConfigError(f"unknown rope parameter(s) {sorted(unknown)} for rope type {kind!r}")
    missing = expected - set(params)
    if missing:
        raise ConfigError(f"rope type {kind!r} needs {sorted(missing)} in rope_parameters")
    fields = {
        k: (int(v) if k == "original_max_position_embeddings" else float(v))
        for k, v in params.items()
    }
    return RopeConfig(theta=theta, kind=kind, **fields)


def _parse_longrope(raw: dict[str, Any], params: dict[str, Any], theta: float) -> RopeConfig:
    """LongRoPE as transformers' `_compute_longrope_parameters` reads it: both factor lists;
    `original_max_position_embeddings` from the rope parameters, else the config's top level;
    `factor` default max_position_embeddings / original; `attention_factor` default
    sqrt(1 + log(factor) / log(original)) (1 when factor <= 1)."""
    known = {"short_factor", "long_factor", "factor", "attention_factor",
             "original_max_position_embeddings"}  # fmt: skip
    unknown = set(params) - known
    if unknown:
        raise ConfigError(f"unknown rope parameter(s) {sorted(unknown)} for rope type 'longrope'")
    missing = {"short_factor", "long_factor"} - set(params)
    if missing:
        raise ConfigError(f"rope type 'longrope' needs {sorted(missing)} in rope_parameters")
    original = params.get("original_max_position_embeddings")
    if original is None:
        original = raw.get("original_max_position_embeddings")
    if original is None:
        raise ConfigError("rope type 'longrope' needs original_max_position_embeddings")
    original = int(original)
    factor = params.get("factor")
    if factor is None:
        factor = int(_require(raw, "max_position_embeddings")) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = {}
    for name in ("short_factor", "long_factor"):
        value = params[name]
        if not isinstance(value, list | tuple) or not all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in value
        ):
            raise ConfigError(f"longrope {name} must be a list of numbers, got {value!r}")
        factors[name] = tuple(float(x) for x in value)
    return RopeConfig(
        theta=theta,
        kind="longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        attention_factor=float(attention),
        **factors,
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
    act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
    if act not in activations:
        raise ConfigError(
            f"hidden_act={act!r} is not supported for {family} (only {sorted(activations)})"
        )
    if raw.get("rope_interleaved"):
        raise ConfigError(
            "rope_interleaved=true: interleaved RoPE (rotating pairs 2i, 2i+1) is not "
            "supported; this library rotates split halves, as transformers' Llama does"
        )
    for key in BIAS_KEYS:
        if raw.get(key) and key not in bias_keys:
            raise ConfigError(
                f"{key}=true in this {family} config, but {family} has no such biases here (nor "
                "in transformers, which ignores the flag and drops any bias tensors); loading "
                "stops here"
            )
    heads = int(_require(raw, "num_attention_heads"))
    hidden = int(_require(raw, "hidden_size"))
    head_dim = raw.get("head_dim") or hidden // heads
    max_pos = int(raw.get("max_position_embeddings", 4096))
    num_layers = int(_require(raw, "num_hidden_layers"))
    return ModelConfig(
        family=family,
        vocab_size=int(_require(raw, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(raw, "intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(raw),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias="mlp_bias" in bias_keys and bool(raw.get("mlp_bias", False)),
        qk_norm=qk_norm,
        layer_windows=_layer_windows(raw, family, num_layers),
        **switches,
        hidden_act=ACTIVATIONS[act],
    )


def _layer_windows(raw: dict[str, Any], family: str, num_layers: int) -> tuple[int, ...]:
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
    if family in ("gemma2", "gemma3_text") and layer_types is None:
        # transformers' defaults: Gemma 2 alternates, sliding first; Gemma 3 makes every
        # `sliding_window_pattern`-th layer global (6: five sliding, then one global).
        every = 2 if family == "gemma2" else int(raw.get("sliding_window_pattern", 6))
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
        if not raw.get("use_sliding_window") or window is None:
            return ()
        if layer_types is None:
            first = int(raw.get("max_window_layers", num_layers))
            layer_types = ["sliding_attention" if i >= first else "full_attention"
                           for i in range(num_layers)]  # fmt: skip
        return tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types)
    if family in ("mistral", "phi3"):
        if layer_types is not None and set(layer_types) != {"full_attention"}:
            raise ConfigError(f"{family} with per-layer layer_types is not supported")
        return () if window is None else (int(window),) * num_layers
    max_pos = int(raw.get("max_position_embeddings", 4096))
    if window is not None and int(window) < max_pos or "sliding_attention" in (layer_types or ()):
        raise ConfigError(
            f"sliding_window={window} is active in this {family} config, but {family} "
            "(as transformers runs it) has no sliding window; loading stops here"
        )
    return ()
