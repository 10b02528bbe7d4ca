"""Decode-step cost on the default device: the layer loop (scan vs unrolled) and the score
layout.

    python -m benchmarks.decode_step            # SmolLM2-135M, the shapes of the cpu suite
    python -m benchmarks.decode_step --quick    # random tiny model, ~30 s smoke run
    python -m benchmarks.decode_step --llama8b  # random Llama-3.1-8B geometry in bf16 (a GPU)

Why: XLA:CPU copies each layer's slice of a stacked [L, ...] array (weights and cache)
before a dot reads it, so a `lax.scan` over one group of all layers moves the weights and the
cache several times per step; `decoding.decode_loop(layer_loop="unrolled")` regroups them into
one-layer groups once per call instead. And with a handful of query rows per kv head, the
keys-major score layout of `cached_attention` runs its batched matmul faster. Both are speed
choices only (tests/test_generation.py, tests/test_attention.py check they compute the same).

Per shape (batch B, cache slots S): ms per decode step for each loop, measured as the time
of an N-step decode minus a 2-step one, divided by N - 2 (compile and the per-call split
excluded), median of --runs; and one layer's attention in each score layout. Ratios come
from the same run; the machine is noisy, so read them, not the absolute times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks import machine
from dge_jax.kernels.attention import AttentionSpec, LayerCache, cached_attention
from dge_jax.runtime import decoding as gen
from dge_jax.runtime.cache import KVCache, init_cache
from dge_jax.text.sampling import Greedy

SHAPES = ((1, 320), (4, 4160), (27, 640))  # compacted batch 1, full 4k batch 4, a 27-cell grid
QUICK_SHAPES = ((1, 64), (4, 256))
LLAMA8B_SHAPES = ((1, 8224), (8, 8224))  # an 8k prompt's full cache, batch 1 and 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_step", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct", help="name or checkpoint folder")
    p.add_argument("--steps", type=int, default=18, help="decode steps per timed call")
    p.add_argument("--runs", type=int, default=3, help="timed runs (median reported)")
    p.add_argument("--quick", action="store_true", help="tiny random model, small shapes")
    p.add_argument("--llama8b", action="store_true", help="random weights of Llama-3.1-8B's "
                   "geometry (hidden 4096, MLP 14336, 32 layers, 32 / 8 heads x 128; vocabulary "
                   "1024) in bf16, at batch 1 and 8 over 8,224 slots (an accelerator's shapes)")
    return p.parse_args(argv)


def load_model(args: argparse.Namespace):
    """(forward, config, params): the named model, or a tiny random llama for --quick."""
    if not (args.quick or args.llama8b):
        import dge_jax

        m = dge_jax.load(args.model)
        return m.forward, m.config, m.params
    from dge_jax.config import ModelConfig, RopeConfig
    from dge_jax.families import get_family

    shape = (dict(vocab_size=1024, hidden_size=4096, intermediate_size=14336, num_layers=32,
                  num_heads=32, num_kv_heads=8, head_dim=128) if args.llama8b else
             dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                  num_heads=6, num_kv_heads=2, head_dim=32))  # fmt: skip
    cfg = ModelConfig(family="llama", rope=RopeConfig(theta=5e5 if args.llama8b else 1e4),
                      max_position_embeddings=131072 if args.llama8b else 4096, **shape)
    family = get_family("llama")
    dtype = jnp.bfloat16 if args.llama8b else jnp.float32
    return family.forward, cfg, family.init_params(cfg, jax.random.PRNGKey(0), dtype)


def full_cache(cfg, batch: int, slots: int, dtype=jnp.float32) -> KVCache:
    """A cache whose first slots - 32 slots hold tokens 0, 1, ... (the rest left for decode)."""
    cache = init_cache(cfg.num_layers, batch, cfg.num_kv_heads, slots, cfg.head_dim, dtype)
    written = slots - 32
    pos = jnp.where(jnp.arange(slots) < written, jnp.arange(slots), -1).astype(jnp.int32)
    k = jax.random.normal(jax.random.PRNGKey(1), cache.k.shape, cache.k.dtype)
    return KVCache.stacked(k=k, v=k * 0.5, pos=jnp.broadcast_to(pos, cache.pos.shape),
                           index=written)  # fmt: skip


def step_ms(fwd, cfg, params, cache: KVCache, loop: str, args) -> tuple[float, float]:
    """(ms per decode step, seconds of the first call, compile included) for one loop."""
    b = cache.batch_size
    written = int(cache.index[0])

    def start(n):
        state = gen.start_state(cache, jnp.ones((b,), jnp.int32), jnp.full((b,), written), n,
                                (), jax.random.PRNGKey(0), buffer=32)  # fmt: skip
        return jax.block_until_ready(jax.tree.map(jnp.copy, state))  # decode donates it

    def run(state):
        out = gen.decode_loop(fwd, cfg, params, state, gen.StepSpec(Greedy(), ()), layer_loop=loop)
        return out.tokens.block_until_ready()

    t0 = time.perf_counter()
    run(start(2))
    first = time.perf_counter() - t0
    per_step = []
    for _ in range(args.runs):
        short, long = start(2), start(args.steps)
        t0 = time.perf_counter()
        run(short)
        t1 = time.perf_counter()
        run(long)
        t2 = time.perf_counter()
        per_step.append(((t2 - t1) - (t1 - t0)) / (args.steps - 2))
    return 1e3 * statistics.median(per_step), first


def attention_ms(cfg, cache: KVCache, keys_major: bool, runs: int) -> float:
    """ms of one layer's decode attention (one query per row) in the given score layout."""
    b = cache.batch_size
    q = jax.random.normal(jax.random.PRNGKey(2), (b, 1, cfg.num_heads, cfg.head_dim))
    qpos = jnp.full((b, 1), int(cache.index[0]), jnp.int32)
    spec = AttentionSpec(keys_major=keys_major)
    f = jax.jit(lambda q, k, v, p: cached_attention(q, qpos, LayerCache.one(k, v, p), spec)[0])
    layer = (cache.k[0], cache.v[0], cache.pos[0])
    return machine.median_ms(f, q, *layer, runs=max(runs, 5))


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    fwd, cfg, params = load_model(args)
    rows = []
    name = "tiny random llama" if args.quick else "random Llama-3.1-8B geometry, bf16" if \
        args.llama8b else args.model
    print(f"# decode step: {name}, "
          f"{jax.default_backend()}, {args.steps}-step calls, median of {args.runs}\n")  # fmt: skip
    print(
        "| batch | slots | scan ms/step | unrolled ms/step | scan / unrolled | compile s "
        "(scan, unrolled) | attention ms rows-major | keys-major | rows / keys |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for b, s in QUICK_SHAPES if args.quick else LLAMA8B_SHAPES if args.llama8b else SHAPES:
        cache = full_cache(cfg, b, s, params.embed.dtype)
        scan, scan_first = step_ms(fwd, cfg, params, cache, "scan", args)
        unrolled, unrolled_first = step_ms(fwd, cfg, params, cache, "unrolled", args)
        rows_major = attention_ms(cfg, cache, False, args.runs)
        keys_major = attention_ms(cfg, cache, True, args.runs)
        row = dict(batch=b, slots=s, scan_ms=scan, unrolled_ms=unrolled,
                   first_call_s=(scan_first, unrolled_first), rows_major_ms=rows_major,
                   keys_major_ms=keys_major)  # fmt: skip
        rows.append(row)
        print(f"| {b} | {s} | {scan:.1f} | {unrolled:.1f} | {scan / unrolled:.2f} | "
              f"{scan_first:.1f}, {unrolled_first:.1f} | {rows_major:.2f} | {keys_major:.2f} | "
              f"{rows_major / keys_major:.2f} |", flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
