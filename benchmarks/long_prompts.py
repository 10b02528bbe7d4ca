"""Where the time of a long-prompt grid goes on this machine: prefill, FullKV decode, and the
evicted cells of one `generate_grid` call sharing that prefill.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.long_prompts \\
        [--model gemma3-270m] [--length 4096] [--batch 4] [--new 128] [--runs 2]

Prompts are `--batch` copies of `--length` token ids (timing does not depend on the text);
EOS is banned so every call generates exactly `--new` tokens. Each figure is the median of
`--runs` warm calls (one compiling call first). Prints seconds of: prefill (a 1-token FullKV
`generate`), FullKV decode (`--new` tokens less that), and a grid of FullKV, SnapKV at prefill,
DGE(4) and DGE-W(4) at budget 128, with the grid's samples per minute per cell (what
`experiments.longbench` runs with those cells).
"""

from __future__ import annotations

import argparse
import statistics
import time

import dge_jax
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import Timing
from dge_jax.generation import generate_grid
from dge_jax.rules.snapkv import SnapKV


def cells(budget: int, k: int) -> list[Eviction | None]:
    """The grid the runner's default comparison runs: FullKV, SnapKV, DGE(k), DGE-W(k)."""
    snap = SnapKV(window=8)
    return [None, Eviction(snap, budget, Timing("prefill", 1)), Eviction(snap, budget,
            Timing("dge", k)), Eviction(snap, budget, Timing("dge_w", k))]  # fmt: skip


def median_seconds(call, runs: int) -> float:
    """The median wall time of `runs` calls after one warm-up (compiling) call."""
    call()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--batch", type=int, default=4, help="prompts per call")
    parser.add_argument("--new", type=int, default=128, help="answer tokens (RULER: 128)")
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--runs", type=int, default=2, help="warm repeats (median)")
    args = parser.parse_args()
    model = dge_jax.load(args.model)
    prompt = [1000 + i % 5000 for i in range(args.length)]
    prompts = [prompt] * args.batch
    fixed = {"min_new_tokens": args.new}

    def full(n: int):
        return lambda: dge_jax.generate(model, prompts, max_new_tokens=n, min_new_tokens=n)

    grid = cells(args.budget, args.k)
    prefill = median_seconds(full(1), args.runs)
    fullkv = median_seconds(full(args.new), args.runs)
    together = median_seconds(
        lambda: generate_grid(model, prompts, grid, max_new_tokens=args.new, **fixed), args.runs
    )
    per_cell = args.batch * len(grid) * 60 / together
    print(f"{args.model}, {args.batch} x {args.length} tokens, {args.new} new tokens, "
          f"median of {args.runs}:")
    print(f"  prefill {prefill:.1f} s; FullKV decode {fullkv - prefill:.1f} s "
          f"({1e3 * (fullkv - prefill) / (args.new - 1):.0f} ms per step of the batch)")
    print(f"  grid of {len(grid)} cells (FullKV, SnapKV, DGE({args.k}), DGE-W({args.k}) at "
          f"b{args.budget}): {together:.1f} s = prefill + {together - prefill:.1f} s; "
          f"{per_cell:.1f} samples per minute per cell")


if __name__ == "__main__":
    main()
