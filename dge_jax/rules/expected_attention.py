"""ExpectedAttention (arXiv 2510.00636; kvpress ``ExpectedAttentionPress``): keep the entries
that future queries are expected to attend to.

The queries still to come are modelled as a Gaussian: the mean and covariance of the
pre-RoPE prompt queries after the sinks (`records.QueryStats`, summed by the forward
when a rule asks), rotated by RoPE averaged over the next ``n_future_positions`` positions.
For attention exp(q·k/√d), the expectation under that Gaussian is
exp(μ·k/√d + ½ kᵀΣk/d); softmaxed over the prompt's keys, averaged over the GQA group and
scaled by ‖v‖. Under DGE the drafted queries join the statistics (rotated back to pre-RoPE),
and the future starts after the drafts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from dge_jax.rules.base import Needs, ScoringRule, check_fields, finish, require_obs
from dge_jax.rules.ops import group_heads
from dge_jax.rules.registry import register
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.quantized import dequantize
from dge_jax.runtime.records import Observation
from dge_jax.runtime.rope import rotate


def average_rotation(start: jax.Array, count: int, inv_freq: jax.Array) -> tuple[jax.Array, ...]:
    """cos, sin [B, D]: RoPE's rotation averaged over positions start .. start + count - 1.

    The mean of rotation matrices R(p) = cos(pθ)·I + sin(pθ)·P (P = rotate_half) is
    mean(cos)·I + mean(sin)·P, so it applies like RoPE itself (`rope.rotate`).
    """
    positions = start[:, None].astype(jnp.float32) + jnp.arange(count, dtype=jnp.float32)
    angles = positions[..., None] * inv_freq  # [B, count, D / 2]
    cos, sin = jnp.mean(jnp.cos(angles), axis=1), jnp.mean(jnp.sin(angles), axis=1)
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


@register
@dataclasses.dataclass(frozen=True)
class ExpectedAttention(ScoringRule):
    """Expected attention of future queries, kvpress's defaults: 512 future positions, 4
    sinks (+inf), covariance and value-norm terms on, epsilon 0 (added before the ‖v‖ scale).
    """

    n_future_positions: int = 512
    sinks: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    name: ClassVar[str] = "expectedattention"

    def __post_init__(self) -> None:
        check_fields(
            self, ints={"n_future_positions": 1, "sinks": 0}, bools=("use_covariance", "use_vnorm")
        )
        if isinstance(self.epsilon, bool) or not isinstance(self.epsilon, int | float):
            raise TypeError(f"ExpectedAttention.epsilon must be a number, got {self.epsilon!r}")

    @property
    def needs(self) -> Needs:
        """Query statistics from after the sinks (the sinks' queries are outliers); the
        sinks are always kept."""
        return Needs(query_stats_from=self.sinks, protected=self.sinks)

    def score(self, cache: KVCache, obs: Observation) -> jax.Array:
        """[L, B, Hkv, S] f32: expected attention (× ‖v‖) of each prompt entry after the
        sinks; sinks +inf."""
        require_obs(obs, "q_stats", "prompt_end")
        mean, cov = obs.q_stats.mean_and_covariance()  # [L, B, Hq, D], [L, B, Hq, D, D]
        # The future starts after the cache's last entry: the prompt's end, or the drafts'.
        start = jnp.max(cache.pos, axis=(0, 2, 3)) + 1  # [B]
        cos, sin = average_rotation(start, self.n_future_positions, obs.q_stats.inv_freq)
        cos, sin = cos[None, :, None], sin[None, :, None]  # against [L, B, Hq, D]
        mean = rotate(mean, cos, sin)
        # R Σ Rᵀ: rotate every row of Σ (Σ Rᵀ), then every column (R (Σ Rᵀ)).
        cov = rotate(cov, cos[..., None, :], sin[..., None, :])
        cov = jnp.swapaxes(
            rotate(jnp.swapaxes(cov, -1, -2), cos[..., None, :], sin[..., None, :]), -1, -2
        )
        prompt = (cache.pos >= 0) & (cache.pos <= obs.prompt_end[None, :, None, None])
        candidate = prompt & (cache.pos >= self.sinks)

        def layer(args: tuple[jax.Array, ...]) -> jax.Array:
            k, v, mu, sigma, include = args  # k, v [B, Hkv, S, D]; mu [B, Hq, D]; sigma
            # [B, Hq, D, D]; include [B, Hkv, S]
            k, v = dequantize(k), dequantize(v)  # one layer at a time
            hkv, d = k.shape[1], k.shape[-1]
            kf = k.astype(jnp.float32)
            mu = group_heads(mu, hkv, axis=1)  # [B, Hkv, G, D]
            logits = jnp.einsum("bhgd,bhsd->bhgs", mu, kf) / math.sqrt(d)
            if self.use_covariance:
                sigma = group_heads(sigma, hkv, axis=1)  # [B, Hkv, G, D, D]
                quad = jnp.einsum("bhsd,bhgde,bhse->bhgs", kf, sigma, kf)
                logits = logits + quad / d / 2
            logits = jnp.where(include[:, :, None], logits, -jnp.inf)
            probs = jax.nn.softmax(logits, axis=-1, where=include[:, :, None])
            scores = jnp.mean(jnp.where(include[:, :, None], probs, 0.0), axis=2)  # [B, Hkv, S]
            if self.use_vnorm:
                v_norm = jnp.linalg.norm(v.astype(jnp.float32), axis=-1)
                scores = (scores + self.epsilon) * v_norm
            return scores

        scores = jax.lax.map(layer, (cache.stored_k, cache.stored_v, mean, cov, candidate))
        protected = prompt & (cache.pos < self.sinks)
        return finish(scores, cache.valid(), protected)
