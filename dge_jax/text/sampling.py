"""Next-token strategies: small frozen dataclasses called as `strategy(logits, key)`, passed
to jit as static."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Greedy:
    """Argmax decoding (the LongBench protocol)."""

    def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        """logits: [B, V] f32 -> tokens [B] int32."""
        del key
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Temperature sampling, optionally restricted to the top-k tokens and/or top-p mass."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # 1.0 = no nucleus cut

    def __post_init__(self):
        if not self.temperature > 0:  # NaN too
            raise ValueError(
                f"temperature must be > 0 (got {self.temperature}); use Greedy() for greedy "
                "decoding"
            )
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1 (got {self.top_k}, {self.top_p})")

    def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        """logits: [B, V] f32, key: a PRNG key -> tokens [B] int32."""
        logits = logits / self.temperature
        if self.top_k:
            kth = jax.lax.top_k(logits, self.top_k)[0][:, -1:]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        if self.top_p < 1.0:
            order = jnp.argsort(-logits, axis=-1)
            sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
            probs = jax.nn.softmax(sorted_logits, axis=-1)
            # Keep a token while the mass strictly before it is < top_p (the top one always).
            mass_before = jnp.cumsum(probs, axis=-1) - probs
            sorted_logits = jnp.where(mass_before < self.top_p, sorted_logits, -jnp.inf)
            logits = (
                jnp.full_like(logits, -jnp.inf)
                .at[jnp.arange(logits.shape[0])[:, None], order]
                .set(sorted_logits)
            )
        return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def check_sampler(sampler: object) -> None:
    """A clear error for a sampler that is not one: a name, a class, or something that cannot
    be called on (logits, key) or passed to jit as a static argument (unhashable)."""
    use = (
        "Greedy() or Sampling(temperature=..., top_k=..., top_p=...) from dge_jax.text.sampling"
    )
    if isinstance(sampler, str):
        raise TypeError(f"sampler must be a sampler object, not the string {sampler!r}: use {use}")
    if isinstance(sampler, type):
        raise TypeError(f"sampler must be an instance, not the class {sampler.__name__}: use {use}")
    if not callable(sampler):
        raise TypeError(
            f"sampler must be callable as sampler(logits, key), got {sampler!r}: use {use}"
        )
    try:
        hash(sampler)
    except TypeError:
        raise TypeError(
            f"sampler {sampler!r} is unhashable; jit takes it as a static argument: use {use}, "
            "or a frozen dataclass with __call__(logits, key)"
        ) from None
