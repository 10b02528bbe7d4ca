"""The shared llama-like decoder: parameters, forward pass, and the checkpoint key table.

Llama, Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3 differ only by switches in `ModelConfig`
(q/k/v bias, q/k norm, explicit head_dim, tied head; Gemma's scaled embeddings, (1 + w)
norms, norms after attention and the MLP, GeGLU, logit scale and soft caps; sliding-window
layers with their own RoPE), so one forward serves them all. Layer parameters are
stacked on a leading [L] axis and the layers run under `lax.scan` over each layer group of the
cache (`dge_jax.runtime.cache`): compile time stays flat as models get deeper.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.config import ModelConfig
from dge_jax.distribution.constraints import constrain_residual
from dge_jax.families import ForwardOutput
from dge_jax.kernels.attention import AttentionSpec, LayerCache, NewEntries, ScoreSpec
from dge_jax.kernels.layer_attention import cache_layer_attention
from dge_jax.runtime.cache import KVCache, LayerGroup, group_layers
from dge_jax.runtime.recorders import NOTHING, LayerView, Recording
from dge_jax.runtime.rope import apply_rope, inverse_frequencies, rope_tables
from dge_jax.runtime.window_cache import join_layers, make_room


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    """Per-layer weights stacked on a leading [L] axis; optional ones are None when absent."""

    attn_norm: jax.Array  # [L, D]
    wq: jax.Array  # [L, D, Hq*hd]
    wk: jax.Array  # [L, D, Hkv*hd]
    wv: jax.Array  # [L, D, Hkv*hd]
    wo: jax.Array  # [L, Hq*hd, D]
    mlp_norm: jax.Array  # [L, D]
    w_gate: jax.Array  # [L, D, F]
    w_up: jax.Array  # [L, D, F]
    w_down: jax.Array  # [L, F, D]
    bq: jax.Array | None = None  # [L, Hq*hd]
    bk: jax.Array | None = None  # [L, Hkv*hd]
    bv: jax.Array | None = None  # [L, Hkv*hd]
    bo: jax.Array | None = None  # [L, D]
    q_norm: jax.Array | None = None  # [L, hd]
    k_norm: jax.Array | None = None  # [L, hd]
    b_gate: jax.Array | None = None  # [L, F]
    b_up: jax.Array | None = None  # [L, F]
    b_down: jax.Array | None = None  # [L, D]
    post_attn_norm: jax.Array | None = None  # [L, D] Gemma: on attention's output
    post_mlp_norm: jax.Array | None = None  # [L, D] Gemma: on the MLP's output


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    """All weights of a llama-like model; `lm_head` is None when tied to `embed`."""

    embed: jax.Array  # [V, D]
    layers: LayerParams
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None = None  # [D, V]


@dataclasses.dataclass(frozen=True)
class Weight:
    """One parameter field: everything the library needs to know about it, in one row.

    name: the field ("layers.wq": stacked on a leading [L] axis); axes: its logical axes
    (`dge_jax.distribution.sharding` maps them onto a mesh); hf_key: the Hugging Face tensor
    name pattern (a captured group is the layer index); transform: "keep", or "transpose" for
    torch's [out, in] linear weights (we keep [in, out]); shape and present: from the config
    (a field may have two rows, one per checkpoint layout, present for different configs);
    init: "norm" (a norm's identity weight: 1, or 0 for Gemma's (1 + w)) or "normal"
    (random init for tests and benchmarks).
    """

    name: str
    axes: tuple[str, ...]
    hf_key: str
    transform: str
    shape: Callable[[ModelConfig], tuple[int, ...]]
    present: Callable[[ModelConfig], bool] = lambda cfg: True
    init: str = "normal"


def _dims(cfg: ModelConfig) -> tuple[int, int, int, int, int, int]:
    """(L, D, F, Hq·hd, Hkv·hd, hd)."""
    hd = cfg.head_dim
    return (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * hd,
            cfg.num_kv_heads * hd, hd)  # fmt: skip


_LAYER = r"model\.layers\.(\d+)\."
# fmt: off
WEIGHTS: tuple[Weight, ...] = (
    Weight("embed", ("vocab", "embed"), r"model\.embed_tokens\.weight", "keep",
           lambda c: (c.vocab_size, c.hidden_size)),
    Weight("final_norm", ("embed",), r"model\.norm\.weight", "keep",
           lambda c: (c.hidden_size,), init="norm"),
    Weight("lm_head", ("embed", "vocab"), r"lm_head\.weight", "transpose",
           lambda c: (c.hidden_size, c.vocab_size), lambda c: not c.tie_word_embeddings),
    Weight("layers.attn_norm", ("layers", "embed"), _LAYER + r"input_layernorm\.weight", "keep",
           lambda c: _dims(c)[:2], init="norm"),
    Weight("layers.mlp_norm", ("layers", "embed"),
           _LAYER + r"post_attention_layernorm\.weight", "keep", lambda c: _dims(c)[:2],
           lambda c: not c.sandwich_norms, init="norm"),
    # Gemma: the norm before the MLP has its own name, and post_attention_layernorm normalises
    # attention's output before the residual add.
    Weight("layers.mlp_norm", ("layers", "embed"),
           _LAYER + r"pre_feedforward_layernorm\.weight", "keep", lambda c: _dims(c)[:2],
           lambda c: c.sandwich_norms, init="norm"),
    Weight("layers.post_attn_norm", ("layers", "embed"),
           _LAYER + r"post_attention_layernorm\.weight", "keep", lambda c: _dims(c)[:2],
           lambda c: c.sandwich_norms, init="norm"),
    Weight("layers.post_mlp_norm", ("layers", "embed"),
           _LAYER + r"post_feedforward_layernorm\.weight", "keep", lambda c: _dims(c)[:2],
           lambda c: c.sandwich_norms, init="norm"),
    Weight("layers.wq", ("layers", "embed", "heads"), _LAYER + r"self_attn\.q_proj\.weight",
           "transpose", lambda c: (_dims(c)[0], _dims(c)[1], _dims(c)[3])),
    Weight("layers.wk", ("layers", "embed", "kv_heads"), _LAYER + r"self_attn\.k_proj\.weight",
           "transpose", lambda c: (_dims(c)[0], _dims(c)[1], _dims(c)[4])),
    Weight("layers.wv", ("layers", "embed", "kv_heads"), _LAYER + r"self_attn\.v_proj\.weight",
           "transpose", lambda c: (_dims(c)[0], _dims(c)[1], _dims(c)[4])),
    Weight("layers.wo", ("layers", "heads", "embed"), _LAYER + r"self_attn\.o_proj\.weight",
           "transpose", lambda c: (_dims(c)[0], _dims(c)[3], _dims(c)[1])),
    Weight("layers.bq", ("layers", "heads"), _LAYER + r"self_attn\.q_proj\.bias", "keep",
           lambda c: (_dims(c)[0], _dims(c)[3]), lambda c: c.qkv_bias),
    Weight("layers.bk", ("layers", "kv_heads"), _LAYER + r"self_attn\.k_proj\.bias", "keep",
           lambda c: (_dims(c)[0], _dims(c)[4]), lambda c: c.qkv_bias),
    Weight("layers.bv", ("layers", "kv_heads"), _LAYER + r"self_attn\.v_proj\.bias", "keep",
           lambda c: (_dims(c)[0], _dims(c)[4]), lambda c: c.qkv_bias),
    Weight("layers.bo", ("layers", "embed"), _LAYER + r"self_attn\.o_proj\.bias", "keep",
           lambda c: _dims(c)[:2], lambda c: c.o_bias),
    Weight("layers.q_norm", ("layers", "head_dim"), _LAYER + r"self_attn\.q_norm\.weight", "keep",
           lambda c: (_dims(c)[0], _dims(c)[5]), lambda c: c.qk_norm, init="norm"),
    Weight("layers.k_norm", ("layers", "head_dim"), _LAYER + r"self_attn\.k_norm\.weight", "keep",
           lambda c: (_dims(c)[0], _dims(c)[5]), lambda c: c.qk_norm, init="norm"),
    Weight("layers.w_gate", ("layers", "embed", "mlp"), _LAYER + r"mlp\.gate_proj\.weight",
           "transpose", lambda c: _dims(c)[:3]),
    Weight("layers.w_up", ("layers", "embed", "mlp"), _LAYER + r"mlp\.up_proj\.weight",
           "transpose", lambda c: _dims(c)[:3]),
    Weight("layers.w_down", ("layers", "mlp", "embed"), _LAYER + r"mlp\.down_proj\.weight",
           "transpose", lambda c: (_dims(c)[0], _dims(c)[2], _dims(c)[1])),
    Weight("layers.b_gate", ("layers", "mlp"), _LAYER + r"mlp\.gate_proj\.bias", "keep",
           lambda c: (_dims(c)[0], _dims(c)[2]), lambda c: c.mlp_bias),
    Weight("layers.b_up", ("layers", "mlp"), _LAYER + r"mlp\.up_proj\.bias", "keep",
           lambda c: (_dims(c)[0], _dims(c)[2]), lambda c: c.mlp_bias),
    Weight("layers.b_down", ("layers", "embed"), _LAYER + r"mlp\.down_proj\.bias", "keep",
           lambda c: _dims(c)[:2], lambda c: c.mlp_bias),
)
# fmt: on
# Derived views of the table: logical axes by field, and (per config) Hugging Face name ->
# (field, transform).
PARAM_AXES: dict[str, tuple[str, ...]] = {w.name: w.axes for w in WEIGHTS}


def hf_key_table(cfg: ModelConfig) -> tuple[tuple[str, str, str], ...]:
    """(Hugging Face name pattern, field, transform) of every row, less those a present row
    of `cfg` reads the same name with (Gemma's post_attention_layernorm is not Llama's MLP
    norm). Absent fields keep their rows, so a tensor of one (a bias the config has none
    of) is named as unexpected rather than unknown."""
    present = [w for w in WEIGHTS if w.present(cfg)]
    claimed = {w.hf_key for w in present}
    rows = [w for w in WEIGHTS if w in present or w.hf_key not in claimed]
    return tuple((w.hf_key, w.name, w.transform) for w in rows)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter field present for `cfg` ("layers.wq", "embed", ...)."""
    return {w.name: w.shape(cfg) for w in WEIGHTS if w.present(cfg)}


def params_from_flat(flat: dict[str, jax.Array]) -> Params:
    """Builds `Params` from {"layers.wq": array, "embed": array, ...}."""
    layer_fields = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith("layers.")}
    return Params(
        embed=flat["embed"],
        layers=LayerParams(**layer_fields),
        final_norm=flat["final_norm"],
        lm_head=flat.get("lm_head"),
    )


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
    """Random parameters for tests and benchmarks (norms the identity, others N(0, scale²))."""
    flat = {}
    inits = {w.name: w.init for w in WEIGHTS}
    for i, (name, shape) in enumerate(sorted(param_shapes(cfg).items())):
        if inits[name] == "norm":
            flat[name] = (jnp.zeros if cfg.norm_offset else jnp.ones)(shape, dtype)
        else:
            noise = jax.random.normal(jax.random.fold_in(key, i), shape)
            flat[name] = (scale * noise).astype(dtype)
    return params_from_flat(flat)


def key_map(cfg: ModelConfig):
    """A `KeyMap` for llama-like checkpoints of this config (see `dge_jax.checkpoints.hf`)."""
    from dge_jax.checkpoints.hf import KeyMap

    return KeyMap(
        rules=tuple((re.compile(p), f, t) for p, f, t in hf_key_table(cfg)),
        shapes=param_shapes(cfg),
        build=params_from_flat,
    )


# A multimodal checkpoint (Gemma 3's Gemma3ForConditionalGeneration) holds the text model
# under another prefix (transformers 5: model.language_model.*, 4: language_model.model.*)
# beside a vision tower and projector, which the text model does not run.
_TEXT_PREFIX = r"(?:model\.language_model\.|language_model\.model\.)"
_NOT_TEXT = (r"(?:model\.)?vision_tower\..*", r"(?:model\.)?multi_modal_projector\..*")


def multimodal_key_map(cfg: ModelConfig):
    """`key_map` for the text model inside a multimodal checkpoint; vision weights skipped."""
    from dge_jax.checkpoints.hf import KeyMap

    def text(pattern: str) -> str:
        if pattern.startswith(r"model\."):
            return _TEXT_PREFIX + pattern[len(r"model\.") :]
        return r"(?:language_model\.)?" + pattern  # lm_head

    rules = [(re.compile(text(p)), f, t) for p, f, t in hf_key_table(cfg)]
    rules += [(re.compile(p), "", "skip") for p in _NOT_TEXT]
    return KeyMap(rules=tuple(rules), shapes=param_shapes(cfg), build=params_from_flat)


def out_projection(cfg: ModelConfig, params: Params) -> jax.Array:
    """[L, Hq, hd, D]: each query head's rows of the attention output projection W_o (what
    CriticalKV multiplies the values by)."""
    wo = params.layers.wo  # [L, Hq*hd, D]
    return wo.reshape(wo.shape[0], cfg.num_heads, cfg.head_dim, wo.shape[-1])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: bool = False) -> jax.Array:
    """RMSNorm in f32, result cast back to x's dtype before the weight (as Hugging Face's
    Llama). offset (Gemma): times (1 + weight) in f32, cast after (as Gemma's RMSNorm)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def _norm(cfg: ModelConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_offset)


def _linear(x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
    y = x @ w
    return y if b is None else y + b


def mlp(h: jax.Array, lp: LayerParams, act: str = "silu") -> jax.Array:
    """The gated MLP of one layer: down(act(gate(h)) * up(h)), h [..., D] -> [..., D]; act
    "silu" (SwiGLU) or "gelu_tanh" (GeGLU: GELU's tanh approximation, Gemma's)."""
    gate = _linear(h, lp.w_gate, lp.b_gate)
    gate = jax.nn.silu(gate) if act == "silu" else jax.nn.gelu(gate, approximate=True)
    return _linear(gate * _linear(h, lp.w_up, lp.b_up), lp.w_down, lp.b_down)


def forward(
    cfg: ModelConfig,
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    *,
    layers: tuple[LayerParams, ...] | None = None,
    recording: Recording = NOTHING,
    logits: str = "last",
    key_block: int = 0,
    attention: str = "auto",
) -> ForwardOutput:
    """Runs T new tokens through the model, writing each layer's K/V at slots
    [index_i, index_i + T) of its cache layer.

    tokens, positions: [B, T] int32 (position -1 marks a padding token: it is written with
    pos -1, so no query ever sees it). logits: "last" -> [B, V], "all" -> [B, T, V], "none".
    recording: what every layer records (`dge_jax.runtime.recorders`): each recorder's value
    comes back stacked over the layers in `ForwardOutput.recorded`. key_block > 0 attends
    over the written slots [0, index + T) only, in blocks of that many keys
    (`written_slot_attention`: what a prefill chunk wants); 0 reads the whole capacity.
    attention: the prefill chunk's implementation (`dge_jax.runtime.platform.ATTENTION`).

    The layers run group by group over the cache's layer groups, each under `lax.scan`;
    ``layers``: the layer weights grouped like the cache (`cache.group_layers`, made once
    outside a decode loop), None = grouped here.
    """
    b, t = tokens.shape
    if layers is None:
        layers = group_layers(params.layers, cache.group_sizes)
    # One RoPE table per distinct RoPE of the model's layers (Gemma 3: local and global).
    ropes = tuple(dict.fromkeys(cfg.rope_of_layers))
    tables = [rope_tables(positions, inverse_frequencies(r, cfg.head_dim)) for r in ropes]
    # stacked once here, [R, B, T, hd] each, so a layer only indexes its table
    tables = tuple(jnp.stack(t) for t in zip(*tables, strict=True))
    new_pos = jnp.broadcast_to(positions[:, None, :], (b, cfg.num_kv_heads, t)).astype(jnp.int32)
    spec = AttentionSpec(key_block=key_block, record_attn=recording.reads_probs_sum,
                         attention=attention, scores=ScoreSpec(cfg.attn_scale, cfg.attn_softcap))
    call = _Call(cfg, positions, new_pos, tables, recording, spec)
    # Per layer, scanned beside its weights: its sliding window (0: global) and RoPE table.
    windows = np.asarray([cfg.window(i) for i in range(cfg.num_layers)], np.int32)
    rope_ids = np.asarray([ropes.index(r) for r in cfg.rope_of_layers], np.int32)

    def scanned_layer(carry, scanned):
        # The group's cache rides in the carry and only the T new slots of layer `i` are
        # written, instead of returning every layer as a fresh stacked output, which made each
        # decode step copy the whole cache.
        x, buffers = carry
        lp, i, slot, window, rope_id = scanned
        x, buffers, recorded = _layer(call, x, lp, buffers, i, slot, window, rope_id)
        return (x, buffers), recorded

    x = params.embed[tokens]
    if cfg.embed_scale:  # Gemma: times sqrt(hidden), rounded to the weights' dtype first
        x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
    # Under a mesh: the looked-up rows whole, then split for the layers (a local slice), so
    # the partitioner sums the vocab-split table's lookups instead of gathering the table.
    x = constrain_residual(cfg, constrain_residual(cfg, x, split=False))
    groups, recorded = [], []
    first = 0
    for lp, group in zip(layers, cache.groups, strict=True):
        ids = jnp.arange(group.num_layers, dtype=jnp.int32)
        span = slice(first, first + group.num_layers)
        first += group.num_layers
        if windows[span].min() > 0:  # sliding layers: their window, not the prompt
            group = make_room(group, int(windows[span].max()), t)
        (x, (k, v, pos)), rec = jax.lax.scan(
            scanned_layer, (x, (group.k, group.v, group.pos)),
            (lp, ids, group.index, jnp.asarray(windows[span]), jnp.asarray(rope_ids[span])),
        )  # fmt: skip
        groups.append(LayerGroup(k=k, v=v, pos=pos, index=group.index + t))
        recorded.append(rec)
    # Each recorder's value per group, [Lg, ...]: join the groups (per-slot values of groups
    # with fewer slots padded with zeros, as `KVCache.padded_pos` pads positions).
    recorded = jax.tree.map(join_layers, *recorded)
    out = None
    if logits != "none":
        x = x[:, -1] if logits == "last" else x
        x = _norm(cfg, x, params.final_norm)
        if params.lm_head is None:  # tied: contract with embed [V, D] as stored, no transpose
            out = jnp.einsum("...d,vd->...v", x, params.embed, preferred_element_type=jnp.float32)
        else:
            out = jnp.dot(x, params.lm_head, preferred_element_type=jnp.float32)
        if cfg.final_softcap:  # Gemma 2: logits -> cap * tanh(logits / cap)
            out = jnp.tanh(out / cfg.final_softcap) * cfg.final_softcap
    return ForwardOutput(out, KVCache(tuple(groups)), recorded)


class _Call(NamedTuple):
    """What every layer of one forward call shares: the config, the new tokens' positions
    [B, T] (and per kv head [B, Hkv, T]), their RoPE tables (cos, sin [R, B, T, hd]: one per
    distinct RoPE of the layers), what to record, and the attention's static settings (the
    prefill key block, 0 for decode and draft steps; whether the recording reads attention
    sums; the implementation; the model's logit scale and soft cap: `AttentionSpec`)."""

    cfg: ModelConfig
    positions: jax.Array
    new_pos: jax.Array
    rope_tables: tuple[jax.Array, jax.Array]
    recording: Recording
    spec: AttentionSpec

    def rope(self, rope_id: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos, sin [B, T, hd] of the layer whose RoPE is table `rope_id` (traced)."""
        cos, sin = self.rope_tables
        if cos.shape[0] == 1:
            return cos[0], sin[0]
        return cos[rope_id], sin[rope_id]


def _layer(call: _Call, x, lp, buffers, i, slot, window, rope_id):
    """Layer i of a group on x [B, T, D]: writes slots [slot, slot + T) of layer i of the
    group's buffers (k, v [Lg, B, Hkv, S, D], pos [Lg, B, Hkv, S]; in place under jit);
    window: its sliding window (0: global), rope_id: its RoPE table.
    Returns (x, buffers, the recording's values for this layer)."""
    cfg, positions = call.cfg, call.positions
    b, t = positions.shape
    hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # The residual stream's tokens stay split over the model axis between blocks under a
    # mesh (sequence parallelism; a no-op otherwise and for decode steps).
    x = constrain_residual(cfg, x)
    h = constrain_residual(cfg, _norm(cfg, x, lp.attn_norm), split=False)
    q = _linear(h, lp.wq, lp.bq).reshape(b, t, hq, hd)
    k = _linear(h, lp.wk, lp.bk).reshape(b, t, hkv, hd)
    v = _linear(h, lp.wv, lp.bv).reshape(b, t, hkv, hd)
    if cfg.qk_norm:
        q = _norm(cfg, q, lp.q_norm)
        k = _norm(cfg, k, lp.k_norm)
    cos, sin = call.rope(rope_id)
    rotated = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)

    new = NewEntries(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), call.new_pos)
    layer = LayerCache(*buffers, i, slot, window if cfg.layer_windows else None)
    attn, probs_sum, layer = cache_layer_attention(rotated, positions, new, layer, call.spec)
    buffers = (layer.k, layer.v, layer.pos)
    recorded = call.recording.layer(LayerView(x, q, rotated, positions, probs_sum))
    out = _linear(attn.reshape(b, t, hq * hd), lp.wo, lp.bo)
    if cfg.sandwich_norms:  # Gemma: attention's and the MLP's outputs are normalised too
        x = constrain_residual(cfg, x + _norm(cfg, out, lp.post_attn_norm))
        h = constrain_residual(cfg, _norm(cfg, x, lp.mlp_norm), split=False)
        mlp_out = _norm(cfg, mlp(h, lp, cfg.hidden_act), lp.post_mlp_norm)
    else:
        x = constrain_residual(cfg, x + out)
        h = constrain_residual(cfg, _norm(cfg, x, lp.mlp_norm), split=False)
        mlp_out = mlp(h, lp, cfg.hidden_act)
    return constrain_residual(cfg, x + mlp_out), buffers, recorded


def check_shapes(cfg: ModelConfig, params: Params) -> None:
    """Raises if a parameter's shape disagrees with the config (a mis-converted checkpoint)."""
    flat = {"embed": params.embed, "final_norm": params.final_norm, "lm_head": params.lm_head}
    flat |= {
        f"layers.{f.name}": getattr(params.layers, f.name) for f in dataclasses.fields(LayerParams)
    }
    for name, shape in param_shapes(cfg).items():
        got = None if flat.get(name) is None else tuple(np.shape(flat[name]))
        if got != shape:
            raise ValueError(f"parameter {name} has shape {got}, config expects {shape}")
