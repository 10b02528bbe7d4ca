"""KeyDiff (arXiv 2504.15364): keep the keys least like the rest.

Query-free (from the keys alone, over each row's prompt entries): DGE and DGE-W select
exactly what prefill eviction selects, the draft entries kept on top as for every rule.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from dge_jax.rules.base import ScoringRule, finish
from dge_jax.rules.ops import prompt_entries
from dge_jax.rules.registry import register
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.records import Observation


@register
@dataclasses.dataclass(frozen=True)
class KeyDiff(ScoringRule):
    """KeyDiff (arXiv 2504.15364; kvpress ``KeyDiffPress``): keep the keys least like the rest.

    score = -cos(k_s, anchor), anchor = the mean of the head's unit-normalised prompt keys
    (post-RoPE, as the cache holds them). No entry is protected. kvpress's one-shot form; the
    paper's block-wise iteration is kvpress's ``BlockPress`` wrapper, not ported.
    """

    name: ClassVar[str] = "keydiff"

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: minus each key's cosine similarity to the anchor."""
        prompt = prompt_entries(cache, obs)
        k = cache.k.astype(jnp.float32)  # [L, B, Hkv, S, D]
        norm = jnp.linalg.norm(k, axis=-1, keepdims=True)
        unit = k / jnp.maximum(norm, 1e-12)  # torch F.normalize's eps
        count = jnp.maximum(jnp.sum(prompt, axis=-1, keepdims=True), 1)[..., None]
        anchor = jnp.sum(jnp.where(prompt[..., None], unit, 0.0), axis=-2, keepdims=True) / count
        # torch cosine_similarity: x.y / max(|x| |y|, eps), eps 1e-8.
        anchor_norm = jnp.linalg.norm(anchor, axis=-1)
        cos = jnp.sum(k * anchor, axis=-1) / jnp.maximum(norm[..., 0] * anchor_norm, 1e-8)
        return finish(-cos, cache.valid())
