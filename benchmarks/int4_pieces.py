"""An int4 layer read whole or in pieces on this machine: what `Backend.int4_pieces` decides.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.int4_pieces [--slots 2304]

One layer of int4 keys ([batch, kv heads, slots, head dim], SmolLM2-135M's widths by
default), read by the two XLA paths that take a piece count: the rules' window attention
(`rules.ops.window_attention_sum`, 11 observed queries) and compaction's gather of kept
slots (`quantized.read_slots`, `--kept` per head). Each is compiled once per piece count,
then the counts alternate for `--runs` timed calls; prints the medians and the ratio to one
piece. On TPU the pieces are what fits a larger batch (benchmarks/RESULTS.md, "An int4
cache"); this says what they cost where memory is no object.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.rules.ops import window_attention_sum
from dge_jax.runtime.quantized import KVQuant, quantize_int4_entries, read_slots


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=3)
    p.add_argument("--q_heads", type=int, default=9)
    p.add_argument("--slots", type=int, default=2304)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--kept", type=int, default=300)
    p.add_argument("--pieces", default="1,8")
    p.add_argument("--runs", type=int, default=15)
    args = p.parse_args(argv)
    b, h, s, d, w = args.batch, args.kv_heads, args.slots, args.head_dim, 11
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((b, h, s, d)), jnp.float32)
    keys = quantize_int4_entries(x, s - 200, KVQuant("int4"), True)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, h, s))
    q = jnp.asarray(rng.standard_normal((b, args.q_heads, w, d)), jnp.float32)
    q_pos = jnp.broadcast_to(jnp.arange(s - 210, s - 210 + w, dtype=jnp.int32), (b, w))
    weight = jnp.ones((b, w), jnp.float32)
    slots = jnp.asarray(rng.integers(0, s, (b, h, args.kept)), jnp.int32)
    counts = [int(c) for c in args.pieces.split(",")]
    paths = {
        "window attention (selection)": lambda n: jax.jit(
            lambda k: window_attention_sum(k, pos, q, q_pos, weight, n)),
        "gather of kept slots (compaction)": lambda n: jax.jit(lambda k: read_slots(k, slots, n)),
    }
    print(f"one int4 layer [{b}, {h}, {s}, {d}] on {jax.devices()[0].platform}; medians of "
          f"{args.runs} calls per piece count, alternating")
    print("| path | " + " | ".join(f"{n} piece(s) (ms)" for n in counts) + " | "
          + " | ".join(f"{n} / {counts[0]}" for n in counts[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(counts) - 1))
    for name, make in paths.items():
        fns = {n: make(n) for n in counts}
        for fn in fns.values():
            fn(keys).block_until_ready()
        times: dict[int, list[float]] = {n: [] for n in counts}
        for _ in range(args.runs):
            for n, fn in fns.items():
                start = time.perf_counter()
                fn(keys).block_until_ready()
                times[n].append(time.perf_counter() - start)
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        print(f"| {name} | " + " | ".join(f"{med[n]:.2f}" for n in counts) + " | "
              + " | ".join(f"{med[n] / med[counts[0]]:.2f}" for n in counts[1:]) + " |")


if __name__ == "__main__":
    main()
