"""The shared llama-like decoder: parameters, forward pass, and the checkpoint key table.

Llama, Mistral, Qwen2 and Qwen3 differ only by switches in `ModelConfig` (q/k/v bias, q/k
norm, explicit head_dim, tied head), so one forward serves them all. Layer parameters are
stacked on a leading [L] axis and the layers run under `lax.scan`: compile time stays flat as
models get deeper.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.attention import cached_attention, written_slot_attention
from dge_jax.cache import KVCache
from dge_jax.config import ModelConfig
from dge_jax.families import ForwardOutput, split_layer_params
from dge_jax.rope import apply_rope, inverse_frequencies, rope_tables


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    """All weights of a llama-like model; `lm_head` is None when tied to `embed`."""

    embed: jax.Array  # [V, D]
    layers: LayerParams
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None = None  # [D, V]


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter field present for `cfg` ("layers.wq", "embed", ...)."""
    d, f, hd, nl = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes = {
        "embed": (cfg.vocab_size, d),
        "final_norm": (d,),
        "layers.attn_norm": (nl, d),
        "layers.wq": (nl, d, q),
        "layers.wk": (nl, d, kv),
        "layers.wv": (nl, d, kv),
        "layers.wo": (nl, q, d),
        "layers.mlp_norm": (nl, d),
        "layers.w_gate": (nl, d, f),
        "layers.w_up": (nl, d, f),
        "layers.w_down": (nl, f, d),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    if cfg.qkv_bias:
        shapes |= {"layers.bq": (nl, q), "layers.bk": (nl, kv), "layers.bv": (nl, kv)}
    if cfg.o_bias:
        shapes["layers.bo"] = (nl, d)
    if cfg.qk_norm:
        shapes |= {"layers.q_norm": (nl, hd), "layers.k_norm": (nl, hd)}
    if cfg.mlp_bias:
        shapes |= {"layers.b_gate": (nl, f), "layers.b_up": (nl, f), "layers.b_down": (nl, d)}
    return shapes


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
    """Random parameters for tests and benchmarks (norm weights 1, others N(0, scale²))."""
    flat = {}
    for i, (name, shape) in enumerate(sorted(param_shapes(cfg).items())):
        if name.endswith("norm"):
            flat[name] = jnp.ones(shape, dtype)
        else:
            noise = jax.random.normal(jax.random.fold_in(key, i), shape)
            flat[name] = (scale * noise).astype(dtype)
    return params_from_flat(flat)


# Hugging Face tensor name -> (our field, layer index group or None, transform).
# Linear weights are stored [out, in] by torch; we keep [in, out], so they are transposed.
_TRANSPOSE = "transpose"
_KEEP = "keep"
HF_KEY_TABLE: tuple[tuple[str, str, str], ...] = (
    (r"model\.embed_tokens\.weight", "embed", _KEEP),
    (r"model\.norm\.weight", "final_norm", _KEEP),
    (r"lm_head\.weight", "lm_head", _TRANSPOSE),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.attn_norm", _KEEP),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.mlp_norm", _KEEP),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "layers.wq", _TRANSPOSE),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "layers.wk", _TRANSPOSE),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", "layers.wv", _TRANSPOSE),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "layers.wo", _TRANSPOSE),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias", "layers.bq", _KEEP),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias", "layers.bk", _KEEP),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.bias", "layers.bv", _KEEP),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.bias", "layers.bo", _KEEP),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", "layers.q_norm", _KEEP),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", "layers.k_norm", _KEEP),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "layers.w_gate", _TRANSPOSE),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "layers.w_up", _TRANSPOSE),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "layers.w_down", _TRANSPOSE),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.bias", "layers.b_gate", _KEEP),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.bias", "layers.b_up", _KEEP),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.bias", "layers.b_down", _KEEP),
)


def key_map(cfg: ModelConfig):
    """A `KeyMap` for llama-like checkpoints of this config (see `dge_jax.checkpoint`)."""
    from dge_jax.checkpoint import KeyMap

    return KeyMap(
        rules=tuple((re.compile(p), f, t) for p, f, t in HF_KEY_TABLE),
        shapes=param_shapes(cfg),
        build=params_from_flat,
    )


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in f32, result cast back to x's dtype before the weight (as Hugging Face)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def _linear(x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
    y = x @ w
    return y if b is None else y + b


def mlp(h: jax.Array, lp: LayerParams) -> jax.Array:
    """The gated SiLU MLP of one layer: down(silu(gate(h)) * up(h)), h [..., D] -> [..., D]."""
    gate = jax.nn.silu(_linear(h, lp.w_gate, lp.b_gate))
    return _linear(gate * _linear(h, lp.w_up, lp.b_up), lp.w_down, lp.b_down)


def forward(
    cfg: ModelConfig,
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    *,
    obs_window: int = 0,
    record_attn: bool = False,
    logits: str = "last",
    key_block: int = 0,
) -> ForwardOutput:
    """Runs T new tokens through the model, writing their K/V at slots [index, index + T)
    (layer i at [index[i], index[i] + T) when the cache has per-layer next slots).

    tokens, positions: [B, T] int32 (position -1 marks a padding token: it is written with
    pos -1, so no query ever sees it). logits: "last" -> [B, V], "all" -> [B, T, V], "none".
    obs_window > 0 also returns the last min(obs_window, T) queries per layer; record_attn
    returns per-slot attention sums of these T queries (see `ForwardOutput`). key_block > 0
    attends over the written slots [0, index + T) only, in blocks of that many keys
    (`written_slot_attention`: what a prefill chunk wants); 0 reads the whole capacity.

    The layers run under `lax.scan` over a stacked cache. Given a cache in per-layer form
    (`dge_jax.cache.split_layers`), they run as an unrolled loop over separate buffers
    instead (pass `families.split_layer_params(params)` too, made once outside any loop),
    and the cache comes back in that form.
    """
    b, t = tokens.shape
    hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = rope_tables(positions, inverse_frequencies(cfg.rope, hd))
    if record_attn and cache.ragged:
        raise ValueError(
            f"record_attn needs one capacity for all layers (per-slot sums are stacked), got "
            f"{cache.capacities}"
        )

    def slot_of(i):
        """Layer i's next slot: index [L] after compaction to per-layer capacities, else []."""
        return cache.index[i] if cache.index.ndim == 1 else cache.index

    new_pos = jnp.broadcast_to(positions[:, None, :], (b, hkv, t)).astype(jnp.int32)
    w = min(obs_window, t)

    def layer(x, lp, k_all, v_all, pos_all, i, slot):
        """Layer i of x [B, T, D]; writes slots [slot, slot + T) of k_all[i] (in place under
        jit), v_all[i] and pos_all[i]. i = None: k_all, v_all, pos_all are this layer's own
        [B, Hkv, S, ...] buffers."""
        h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
        q = _linear(h, lp.wq, lp.bq).reshape(b, t, hq, hd)
        k = _linear(h, lp.wk, lp.bk).reshape(b, t, hkv, hd)
        v = _linear(h, lp.wv, lp.bv).reshape(b, t, hkv, hd)
        if cfg.qk_norm:
            q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)

        def write(buf, new):
            """buf with new [B, Hkv, T(, D)] at slots [slot, slot + T) of this layer."""
            start = (0, 0, slot) + (0,) * (new.ndim - 3)
            if i is None:
                return jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), start)
            return jax.lax.dynamic_update_slice(buf, new[None].astype(buf.dtype), (i, *start))

        def this_layer(*bufs):
            """This layer's [B, Hkv, S, ...] views of the given buffers."""
            return bufs if i is None else tuple(buf[i] for buf in bufs)

        k_new, v_new = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        if key_block:  # a prefill chunk: attends over the written cache, its own keys included
            k_all, v_all = write(k_all, k_new), write(v_all, v_new)
            pos_all = write(pos_all, new_pos)
            k_l, v_l, pos_l = this_layer(k_all, v_all, pos_all)
            attn, probs_sum = written_slot_attention(
                q, k_l, v_l, pos_l, positions, slot + t, block=key_block,
                return_probs_sum=record_attn,
            )  # fmt: skip
        else:
            # Decode and draft steps read the cache first, with this step's entries passed
            # beside it, then write them. The written values take a zero computed from the
            # attention output, so the write must run after attention's reads: XLA:CPU then
            # updates each buffer in place. Without that order it copied every cache buffer
            # of the loop 2-4 times per decode step (2.2x slower at batch 1 and 4,608 slots;
            # tests/test_generation.py checks the compiled loop for such copies). The zero
            # is exact: min(|a|, 1) * 0 is 0 for every finite or infinite a.
            k_l, v_l, pos_l = this_layer(k_all, v_all, pos_all)
            attn, probs_sum = cached_attention(
                q, k_l, v_l, pos_l, positions, return_probs_sum=record_attn,
                new=(k_new, v_new, new_pos), new_slot=slot,
            )  # fmt: skip
            after = jnp.minimum(jnp.abs(attn.reshape(-1)[0]), 1).astype(k_new.dtype) * 0
            k_all, v_all = write(k_all, k_new + after), write(v_all, v_new + after)
            pos_all = write(pos_all, new_pos)
        x = x + _linear(attn.reshape(b, t, hq * hd), lp.wo, lp.bo)
        x = x + mlp(rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps), lp)
        q_win = q[:, t - w :].transpose(0, 2, 1, 3) if w else None  # [B, Hq, W, D]
        return x, k_all, v_all, pos_all, q_win, probs_sum

    x = params.embed[tokens]
    if not isinstance(cache.k, tuple):

        def scanned_layer(carry, scanned):
            # The cache rides in the carry and only the T new slots of layer `i` are written,
            # instead of returning every layer as a fresh stacked output, which made each
            # decode step copy the whole cache.
            x, k_all, v_all, pos_all = carry
            lp, i = scanned
            x, k_all, v_all, pos_all, q_win, probs_sum = layer(
                x, lp, k_all, v_all, pos_all, i, slot_of(i)
            )
            return (x, k_all, v_all, pos_all), (q_win, probs_sum)

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, k_all, v_all, pos_all), (q_window, probs_sum) = jax.lax.scan(
            scanned_layer, (x, cache.k, cache.v, cache.pos), (params.layers, layer_ids)
        )
        new_cache = KVCache(k=k_all, v=v_all, pos=pos_all, index=cache.index + t)
    else:
        layers = split_layer_params(params).layers
        ks, vs, ps, wins, sums = [], [], [], [], []
        for i, (lp, k_l, v_l, pos_l) in enumerate(
            zip(layers, cache.k, cache.v, cache.pos, strict=True)
        ):
            x, k_l, v_l, pos_l, q_win, probs_sum = layer(x, lp, k_l, v_l, pos_l, None, slot_of(i))
            ks.append(k_l)
            vs.append(v_l)
            ps.append(pos_l)
            wins.append(q_win)
            sums.append(probs_sum)
        new_cache = KVCache(k=tuple(ks), v=tuple(vs), pos=tuple(ps), index=cache.index + t)
        q_window = jnp.stack(wins) if w else None
        probs_sum = jnp.stack(sums) if record_attn else None
    out = None
    if logits != "none":
        x = x[:, -1] if logits == "last" else x
        x = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
        if params.lm_head is None:  # tied: contract with embed [V, D] as stored, no transpose
            out = jnp.einsum("...d,vd->...v", x, params.embed, preferred_element_type=jnp.float32)
        else:
            out = jnp.dot(x, params.lm_head, preferred_element_type=jnp.float32)
    return ForwardOutput(out, new_cache, q_window, probs_sum)


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
