"""What each scoring rule costs: its prefill (with what it records) and its selection step.

    python -m benchmarks.rule_cost [--lengths 1024,4096] [--budget 256] [--repeats 3]

Embedded SmolLM2-135M, one prompt of random ids per length, eviction after prefill. Every
rule runs `dge_jax.generate` once to compile, then `--repeats` times warm; the stage hook
times the jitted prefill and the selection (`keep_masks`, which scores and selects), and the
best warm time is kept. Ratios are to SnapKV's (window 8) in the same run. No rule runs an
extra forward pass (KVzip, which would, is not ported); what differs in prefill is what the
forward records: SnapKV/TOVA a query window, H2O per-slot attention sums, ExpectedAttention
the pre-RoPE query statistics, the query-free rules nothing.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import dge_jax
from dge_jax.eviction import Eviction
from dge_jax.registry import make_policy
from dge_jax.timing import Timing

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
)


class BestStageTimes:
    """A generate hook keeping each stage's best wall time (blocking on every result)."""

    def __init__(self):
        self.best: dict[str, float] = {}

    def __call__(self, stage, fn, *args, **kwargs):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        took = time.perf_counter() - start
        self.best[stage] = min(self.best.get(stage, float("inf")), took)
        return out


def measure(model, prompt: list[int], name: str, options: dict, budget: int, repeats: int):
    """Best warm prefill and selection seconds of one rule."""
    ev = Eviction(make_policy(name, **options), budget, Timing("prefill", 1))
    dge_jax.generate(model, [prompt], max_new_tokens=2, eviction=ev)  # compile
    timer = BestStageTimes()
    for _ in range(repeats):
        dge_jax.generate(model, [prompt], max_new_tokens=2, eviction=ev, hook=timer)
    return timer.best["prefill"], timer.best["keep_masks"]


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
    print("\n| rule | prompt tokens | prefill ms | × SnapKV | selection ms | × SnapKV |")
    print("|---|---:|---:|---:|---:|---:|")
    for length in (int(x) for x in args.lengths.split(",")):
        prompt = rng.integers(100, model.config.vocab_size - 100, length).tolist()
        base = None
        for name, options in RULES:
            prefill, select = measure(model, prompt, name, options, args.budget, args.repeats)
            base = base or (prefill, select)
            print(
                f"| {name} | {length} | {prefill * 1e3:.0f} | {prefill / base[0]:.2f} | "
                f"{select * 1e3:.1f} | {select / base[1]:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
