"""Quantized caches against the plain one on CPU, end to end and per stage, and their bytes.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.kv_quant_speed [--length 2048] \
        [--caches int8,int4]

One grid per run, the same for both caches: FullKV, SnapKV at prefill and DGE-SnapKV (k = 4),
budget `--budget`, compacted; `--batch` prompts of `--length` random tokens, exactly
`--new_tokens` answer tokens each (EOS banned until then, so both caches decode as many
steps). Each cache compiles once, then `--runs` grids alternate between them (plain, then
each of `--caches`, again), so drift on a shared machine falls on all; prints the medians of
the grid's wall time and of each stage's (the hook's), each quantized / plain ratio, and
prefill's cache bytes. Tokens are not compared here (a quantized cache may change them:
RESULTS.md has the quality figures).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import jax
import numpy as np

import dge_jax
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import dge, prefill
from dge_jax.rules.snapkv import SnapKV

PLAIN = "none"


def run_grid(model, prompts, cells, new: int, kv_quant: str):
    """One grid: (wall seconds, stage -> summed seconds, prefill cache bytes)."""
    stages: dict[str, float] = collections.defaultdict(float)
    nbytes = []

    def hook(stage, fn, *args, **kwargs):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        stages[stage] += time.perf_counter() - start
        if stage == "prefill":
            nbytes.append(out.cache.nbytes())
        return out

    start = time.perf_counter()
    dge_jax.generate_grid(model, prompts, cells, max_new_tokens=new, min_new_tokens=new,
                          hook=hook, kv_quant=kv_quant)  # fmt: skip
    return time.perf_counter() - start, dict(stages), nbytes[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--caches", default="int8",
                        help="comma-separated kv_quant values timed against the plain cache")
    args = parser.parse_args()
    quants = (PLAIN, *(q for q in args.caches.split(",") if q and q != PLAIN))
    model = dge_jax.load(args.model)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, args.length).tolist() for _ in range(args.batch)]
    cells = [None, Eviction(SnapKV(), budget=args.budget, timing=prefill()),
             Eviction(SnapKV(), budget=args.budget, timing=dge(4))]  # fmt: skip
    print(f"{args.model} ({model.params.embed.dtype}), {args.batch} prompts of {args.length} "
          f"tokens, {args.new_tokens} new tokens, cells FullKV / SnapKV / DGE-SnapKV k=4 at "
          f"budget {args.budget}; medians of {args.runs} warm grids per cache, alternating")
    for quant in quants:  # compile
        run_grid(model, prompts, cells, args.new_tokens, quant)
    runs: dict[str, list] = {q: [] for q in quants}
    for _ in range(args.runs):
        for quant in quants:
            runs[quant].append(run_grid(model, prompts, cells, args.new_tokens, quant))
    stages = sorted({s for r in runs[PLAIN] for s in r[1]})
    print("\n| cache | grid (s) | " + " | ".join(f"{s} (s)" for s in stages)
          + " | prefill cache (MiB) |")  # fmt: skip
    print("|---|---:|" + "---:|" * len(stages) + "---:|")
    med = {}
    for quant in quants:
        wall = statistics.median(r[0] for r in runs[quant])
        per = [statistics.median(r[1].get(s, 0.0) for r in runs[quant]) for s in stages]
        med[quant] = (wall, per)
        cols = " | ".join(f"{x:.3f}" for x in per)
        print(f"| {quant} | {wall:.3f} | {cols} | {runs[quant][0][2] / 2**20:.1f} |")
    w0, p0 = med[PLAIN]
    for quant in quants[1:]:
        w1, p1 = med[quant]
        ratios = " | ".join(f"{b / a:.2f}" if a else "-" for a, b in zip(p0, p1, strict=True))
        print(f"| {quant} / {PLAIN} | {w1 / w0:.2f} | {ratios} | "
              f"{runs[quant][0][2] / runs[PLAIN][0][2]:.2f} |")


if __name__ == "__main__":
    main()
