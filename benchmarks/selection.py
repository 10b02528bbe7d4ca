"""The eviction step's parts at the shapes of a 4k-token SmolLM2 prompt: score, select, compact.

    python -m benchmarks.selection            # SmolLM2-135M geometry, 4,096-token prompt
    python -m benchmarks.selection --quick    # tiny shapes, a few seconds

Why: a grid evicts the same prompt dozens of times (one scoring per (scorer, timing), one
selection per budget, one compaction per cell), so these parts add up. Each is timed beside
what it replaced, on the same inputs, and the replacements are checked to give the same result:

- select: `selection.select_slots` (a bisection for each head's threshold score) against
  ranking every slot with two stable argsorts (the rule it implements: highest score first,
  ties to the later slot);
- compact: `compaction.compact` on a cache whose slots are in position order (every cache decoding
  builds: a stable partition) against the same entries with their slots shuffled (it falls
  back to sorting by position);
- SnapKV scoring (kvpress preset) of the window's queries plus two drafts, for scale.

Random keys and queries (the cost does not depend on the values); ms are medians of --runs
calls after a compiling one. Ratios come from the same run; the machine is noisy.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import machine
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime import compaction, selection
from dge_jax.runtime.cache import KVCache
from dge_jax.runtime.records import Observation

# (layers, kv heads, query heads, head dim, prompt tokens, slots, budget): SmolLM2-135M at a
# 4,096-token prompt (capacity = prompt + a 512-token answer bucket), kvpress's budget 256.
FULL = (30, 3, 9, 64, 4096, 4608, 256)
QUICK = (2, 2, 4, 16, 192, 256, 32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.selection", description=__doc__)
    p.add_argument("--runs", type=int, default=7, help="timed calls per figure (median)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    return p.parse_args(argv)


def sort_ranked_keep(scores: jax.Array, budget: int) -> jax.Array:
    """The keep mask by ranking every slot: two stable argsorts per head (the reference)."""
    candidate = scores > -jnp.inf
    reversed_scores = jnp.flip(jnp.where(candidate, scores, -jnp.inf), axis=-1)
    order = jnp.argsort(-reversed_scores, axis=-1, stable=True)
    rank = jnp.flip(jnp.argsort(order, axis=-1, stable=True), axis=-1)
    return (rank < budget) & candidate


def inputs(shape: tuple[int, ...]) -> tuple[KVCache, Observation]:
    """A prefill cache of `prompt` tokens plus 2 drafts, and the observation SnapKV reads."""
    nl, hkv, hq, hd, prompt, slots, _ = shape
    window = 64
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    k = jax.random.normal(keys[0], (nl, 1, hkv, slots, hd))
    written = prompt + 2
    pos = jnp.where(jnp.arange(slots) < written, jnp.arange(slots), -1).astype(jnp.int32)
    cache = KVCache.stacked(k=k, v=k * 0.5, pos=jnp.broadcast_to(pos, (nl, 1, hkv, slots)),
                            index=written)  # fmt: skip
    q_pos = jnp.arange(prompt - window, written, dtype=jnp.int32)[None]
    obs = Observation(
        q=jax.random.normal(keys[1], (nl, 1, hq, q_pos.shape[1], hd)),
        q_pos=q_pos,
        attn_sum=None,
        is_draft=jnp.arange(q_pos.shape[1]) >= window,
        prompt_end=jnp.asarray([prompt - 1], jnp.int32),
    )
    return cache, obs


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    shape = QUICK if args.quick else FULL
    nl, hkv, _, _, prompt, slots, budget = shape
    cache, obs = inputs(shape)
    rule = SnapKV.kvpress()
    score = jax.jit(rule.score)
    scores = score(cache, obs)
    select = jax.jit(selection.select_slots)
    by_sort = jax.jit(sort_ranked_keep, static_argnums=1)
    keep = select(scores, budget)
    if not np.array_equal(np.asarray(keep), np.asarray(by_sort(scores, budget))):
        raise AssertionError("select and the sort-based ranking keep different slots")
    masked = selection.apply_keep(cache, keep)
    capacity = budget + 64
    shuffle = np.random.default_rng(0).permutation(slots)
    shuffled = KVCache.stacked(masked.k[..., shuffle, :], masked.v[..., shuffle, :],
                               masked.pos[..., shuffle], masked.index)  # fmt: skip
    compact = jax.jit(compaction.compact, static_argnums=1)
    in_order, out_of_order = compact(masked, capacity), compact(shuffled, capacity)
    for a, b in zip(jax.tree.leaves(in_order), jax.tree.leaves(out_of_order), strict=True):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            raise AssertionError("compaction by partition and by sorting differ")
    figures = {
        "score_ms": machine.median_ms(score, cache, obs, runs=args.runs),
        "select_ms": machine.median_ms(select, scores, budget, runs=args.runs),
        "select_by_sort_ms": machine.median_ms(by_sort, scores, budget, runs=args.runs),
        "compact_ms": machine.median_ms(compact, masked, capacity, runs=args.runs),
        "compact_by_sort_ms": machine.median_ms(compact, shuffled, capacity, runs=args.runs),
    }
    print(f"# eviction parts: {nl} layers x {hkv} kv heads x {slots} slots ({prompt}-token "
          f"prompt + 2 drafts), budget {budget}, {jax.default_backend()}, median of "
          f"{args.runs}\n")  # fmt: skip
    print("| part | ms | replaced | ms | ratio |")
    print("| --- | ---: | --- | ---: | ---: |")
    print(f"| SnapKV scoring (window 64 + 2 drafts) | {figures['score_ms']:.1f} | – | – | – |")
    print(f"| select (bisection) | {figures['select_ms']:.1f} | two argsorts | "
          f"{figures['select_by_sort_ms']:.1f} | "
          f"{figures['select_by_sort_ms'] / figures['select_ms']:.1f} |")  # fmt: skip
    print(f"| compact (partition) | {figures['compact_ms']:.1f} | sort by position | "
          f"{figures['compact_by_sort_ms']:.1f} | "
          f"{figures['compact_by_sort_ms'] / figures['compact_ms']:.1f} |", flush=True)  # fmt: skip
    return figures


if __name__ == "__main__":
    main()
