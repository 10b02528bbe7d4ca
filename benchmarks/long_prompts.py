"""Where the time of a long-prompt grid goes on this machine: prefill, FullKV decode, and the
evicted cells of one `generate_grid` call sharing that prefill.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.long_prompts \\
        [--model gemma3-270m] [--length 4096] [--batch 4] [--new 128] [--runs 2]

Prompts are `--batch` copies of `--length` token ids (timing does not depend on the text);
EOS is banned so every call generates exactly `--new` tokens. Each figure is the median of
`--runs` warm calls (one compiling call first). Two calls are timed: FullKV alone, and a grid
of FullKV, SnapKV at prefill, DGE(k) and DGE-W(k) at the budget, with the grid's samples per
minute per cell (what `experiments.longbench` runs with those cells). Each call's time is split
by stage inside that one call, through the library's stage hook (every jitted step is blocked
on and timed: prefill, draft, the eviction steps, decode), so the parts add up to the call and
none is a difference of two noisy runs; "other" is the host work between stages.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import jax

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


class StageClock:
    """A stage hook that blocks on each jitted step and adds its wall time to its stage."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()

    def hook(self, stage: str, fn, *args, **kwargs):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        self.seconds[stage] += time.perf_counter() - start
        return out


def timed(call, runs: int) -> dict[str, float]:
    """Median seconds per stage, and in all ("total"; "other": host work between stages), of
    `runs` calls after one warm-up (compiling) call; `call(hook)` runs one."""
    call(None)
    per_run = []
    for _ in range(runs):
        clock = StageClock()
        start = time.perf_counter()
        call(clock.hook)
        total = time.perf_counter() - start
        per_run.append({**clock.seconds, "total": total,
                        "other": total - sum(clock.seconds.values())})
    stages = sorted({s for r in per_run for s in r})
    return {s: statistics.median(r.get(s, 0.0) for r in per_run) for s in stages}


def split(seconds: dict[str, float]) -> str:
    """'prefill 7.1 s, decode 18.0 s, ...': the stages, longest first, then other."""
    parts = sorted((v, s) for s, v in seconds.items() if s not in ("total", "other"))
    shown = [f"{s} {v:.1f} s" for v, s in reversed(parts) if v >= 0.05]
    return ", ".join([*shown, f"other {seconds['other']:.1f} s"])


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

    grid = cells(args.budget, args.k)
    fullkv = timed(lambda hook: dge_jax.generate(
        model, prompts, max_new_tokens=args.new, hook=hook, **fixed), args.runs)
    together = timed(lambda hook: generate_grid(
        model, prompts, grid, max_new_tokens=args.new, hook=hook, **fixed), args.runs)
    per_cell = args.batch * len(grid) * 60 / together["total"]
    print(f"{args.model}, {args.batch} x {args.length} tokens, {args.new} new tokens, "
          f"median of {args.runs}:")
    print(f"  FullKV: {fullkv['total']:.1f} s = {split(fullkv)} "
          f"({1e3 * fullkv['decode'] / (args.new - 1):.0f} ms per decode step of the batch)")
    print(f"  grid of {len(grid)} cells (FullKV, SnapKV, DGE({args.k}), DGE-W({args.k}) at "
          f"b{args.budget}): {together['total']:.1f} s = {split(together)}; "
          f"{per_cell:.1f} samples per minute per cell")


if __name__ == "__main__":
    main()
