"""Work accounting: FLOPs of a prefill, bytes of a decode step (the parameters it reads)."""

from __future__ import annotations

import jax

from dge_jax.config import ModelConfig

MIB = 2**20


def linear_params(cfg: ModelConfig) -> int:
    """Weights of one token's linear layers (q, k, v, o, gate, up, down) over all layers."""
    d, hd = cfg.hidden_size, cfg.head_dim
    attn = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + cfg.num_heads * hd * d
    return cfg.num_layers * (attn + 3 * d * cfg.intermediate_size)


def prefill_flops(cfg: ModelConfig, tokens: int, rows: int = 1) -> float:
    """Model FLOPs of prefilling `rows` prompts of `tokens` tokens: linear layers (2 per
    weight per token), causal attention (q·k and p·v over the t + 1 visible keys of query t),
    and the LM head on the last token, which is all a prefill computes logits for."""
    linear = 2 * linear_params(cfg) * tokens
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    head = 2 * cfg.hidden_size * cfg.vocab_size
    return rows * (linear + attention + head)


def tree_bytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))
