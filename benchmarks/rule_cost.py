"""What each scoring rule costs: its prefill (with what it records) and its selection step.

    python -m benchmarks.rule_cost [--lengths 1024,4096] [--budget 256] [--repeats 3]

Embedded SmolLM2-135M, one prompt of random ids per length, eviction after prefill. Every
rule runs `dge_jax.generate` once to compile, then `--repeats` times warm; the stage hook
times the jitted prefill and the selection (`keep_masks`, which scores and selects), and the
best warm time is kept. Ratios are to SnapKV's (window 8) in the same run. What differs in
prefill is what the forward records: SnapKV/TOVA a query window, H2O per-slot attention
sums, ExpectedAttention the pre-RoPE query statistics, the query-free rules nothing. KVzip
alone runs extra forward passes (the reconstruct stage: the prompt repeated in chunks of
2,048 over the cache), timed as their sum per generate call and shown against the prefill.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import dge_jax
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import Timing
from dge_jax.rules.registry import make_rule

RULES = (
    ("snapkv", {"window": 8}),
    ("h2o", {"window": 8}),
    ("tova", {}),
    ("expectedattention", {}),
    ("keydiff", {}),
    ("lagkv", {}),
    ("criticalkv", {"window": 8}),
    ("chunkkv", {"window": 8}),
    ("criticalkv_expectedattention", {"use_vnorm": False}),
    ("kvzip", {}),
)


class StageTimes:
    """A generate hook summing each stage's wall time and calls in one generate call
    (blocking on every result); `best` keeps each stage's best sum over calls."""

    def __init__(self):
        self.best: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._now: dict[str, float] = {}

    def __call__(self, stage, fn, *args, **kwargs):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        self._now[stage] = self._now.get(stage, 0.0) + time.perf_counter() - start
        self.calls[stage] = self.calls.get(stage, 0) + 1
        return out

    def end_call(self) -> None:
        for stage, took in self._now.items():
            self.best[stage] = min(self.best.get(stage, float("inf")), took)
        self._now = {}


def measure(model, prompt: list[int], name: str, options: dict, budget: int, repeats: int):
    """Best warm prefill, reconstruct (0 without) and selection seconds of one rule, and
    its extra forward passes per generate call."""
    ev = Eviction(make_rule(name, **options), budget, Timing("prefill", 1))
    dge_jax.generate(model, [prompt], max_new_tokens=2, eviction=ev)  # compile
    timer = StageTimes()
    for _ in range(repeats):
        dge_jax.generate(model, [prompt], max_new_tokens=2, eviction=ev, hook=timer)
        timer.end_call()
    passes = timer.calls.get("reconstruct", 0) // repeats
    best = timer.best
    return best["prefill"], best.get("reconstruct", 0.0), passes, best["keep_masks"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    model = dge_jax.load()
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; embedded SmolLM2-135M, "
          f"budget {args.budget}, best of {args.repeats} warm runs")  # fmt: skip
    print("\n| rule | prompt tokens | prefill ms | × SnapKV | extra passes | their ms | × prefill "
          "| selection ms | × SnapKV |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for length in (int(x) for x in args.lengths.split(",")):
        prompt = rng.integers(100, model.config.vocab_size - 100, length).tolist()
        base = None
        for name, options in RULES:
            prefill, extra, passes, select = measure(
                model, prompt, name, options, args.budget, args.repeats
            )
            base = base or (prefill, select)
            print(
                f"| {name} | {length} | {prefill * 1e3:.0f} | {prefill / base[0]:.2f} | "
                f"{passes} | {extra * 1e3:.0f} | {extra / prefill:.2f} | "
                f"{select * 1e3:.1f} | {select / base[1]:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
