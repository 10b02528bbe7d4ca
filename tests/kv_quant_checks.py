"""Checks the quantized-cache tests share (int8 and int4 alike): the Pallas kernels against
the XLA path on one layer's cache, and the caches prefill returns while `generate` runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.generation import generate
from dge_jax.kernels.attention import AttentionSpec, LayerCache, NewEntries
from dge_jax.kernels.layer_attention import cache_layer_attention


def assert_pallas_is_xla(q, new: NewEntries, layer: LayerCache, key_block: int,
                         record_attn: bool, rtol: float = 0.0) -> None:  # fmt: skip
    """attention="pallas" (interpret mode on CPU) gives "xla"'s output and probs sums within
    1e-5 (and rtol: outputs of a few units, summed in another order) and writes the very same
    cache, for one step of `new` entries over `layer`."""

    def run(attention):
        spec = AttentionSpec(key_block=key_block, record_attn=record_attn, attention=attention)
        return jax.jit(cache_layer_attention, static_argnums=4)(
            q, new.pos[:, 0], new, layer, spec
        )

    (got, got_sums, got_cache), (want, want_sums, want_cache) = run("pallas"), run("xla")
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-5)
    if record_attn:
        np.testing.assert_allclose(got_sums, want_sums, atol=1e-5)
    for x, y in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_array_equal(x, y)


def prefill_caches(model, prompts, **kwargs) -> list:
    """The caches prefill returned while ``generate(model, prompts, **kwargs)`` ran, copied
    (decode donates its buffers)."""
    caches = []

    def hook(stage, fn, *args, **kw):
        out = fn(*args, **kw)
        if stage == "prefill":
            caches.append(jax.tree.map(jnp.copy, out.cache))
        return out

    generate(model, prompts, hook=hook, **kwargs)
    return caches
