"""What each timing costs, cell by cell: forward steps on the full cache and on a compressed
one, the most cache bytes alive at once, and time per sample, on this machine.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.timing_costs \\
        [--model smollm2-135m-instruct] [--length 2048] [--batch 4] [--new 32] \\
        [--budget 128] [--k 4] [--lookahead 8] [--runs 2] [--cells NAME,...] [--json OUT]

Each cell runs alone (`generate_grid` with that one cell, so nothing is shared with another
cell), on `--batch` copies of a `--length`-token prompt with EOS banned (every row
generates `--new` tokens). A stage hook counts what ran: the prompt's forward, the one-token
steps over the full cache (draft, and decode before the first compression) and over a
compressed one (the lookahead's copy, and decode after eviction), and reads the cache
arrays alive before and after each step (`jax.live_arrays` after a garbage collection: what
the grid still holds). Time per sample is the median of `--runs` warm calls over the batch.
Cells: FullKV; SnapKV at prefill; DGE, DGE-W and DGE-D at k; LAQ's lookahead of `--lookahead`
tokens (first stage at LAQ's 512 entries, window 32); `decode` at interval k (kvpress's
DecodingPress); adaptive DGE (`dge(8a)`: entropy rule, k_max 8).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import jax

import dge_jax
from dge_jax.eviction.decode_spec import DecodeCompression
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import Adaptive, Timing
from dge_jax.generation import generate_grid
from dge_jax.rules.snapkv import SnapKV


def cells(budget: int, k: int, lookahead: int) -> dict[str, Eviction | None]:
    """The timings compared, by name (module docstring)."""
    snap = SnapKV(window=8)

    def at(timing: Timing, **options) -> Eviction:
        return Eviction(snap, budget, timing, **options)

    return {
        "full": None,
        "prefill": at(Timing("prefill", 1)),
        f"dge({k})": at(Timing("dge", k)),
        f"dge_w({k})": at(Timing("dge_w", k)),
        f"dge_d({k})": at(Timing("dge_d", k)),
        f"lookahead({lookahead})": at(Timing("lookahead", lookahead)),
        f"decode(i{k})": at(Timing("decode", 1), decode=DecodeCompression(budget, k)),
        "dge(8a)": at(Timing("dge", 8, adaptive=Adaptive("entropy", 1.0))),
    }


def steps(ev: Eviction | None, new: int, k_used: int | None) -> tuple[int, int]:
    """(one-token forward steps over the full cache, over a compressed one) for one row that
    generates `new` tokens (the first comes from the prompt's forward). k_used: the k a row
    of an adaptive cell kept (its result's `k`): the draft still computes k_max - 1 steps,
    and the row decodes from its k."""
    if ev is None:
        return new - 1, 0
    t = ev.timing
    if t.kind == "decode":
        full = min(ev.decode.interval, new - 1)
        return full, new - 1 - full
    if t.kind == "lookahead":
        return 0, t.k + new - 1
    kept = (k_used or t.k) - 1 if t.draft_steps else 0
    return t.draft_steps, new - 1 - kept


def live_cache_bytes(cfg) -> int:
    """Bytes of the key / value arrays alive ([L, B, Hkv, S, D]: every cache layout's)."""
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays()
               if x.ndim == 5 and x.shape[2] == cfg.num_kv_heads and x.shape[4] == cfg.head_dim
               and not x.is_deleted())  # fmt: skip


class Peak:
    """A stage hook: the stages run, and the most cache bytes alive around any of them."""

    def __init__(self, cfg):
        self.cfg, self.stages, self.peak = cfg, [], 0

    def __call__(self, stage, fn, *args, **kwargs):
        self.stages.append(stage)
        self.peak = max(self.peak, live_cache_bytes(self.cfg))
        out = fn(*args, **kwargs)
        jax.block_until_ready(out)
        self.peak = max(self.peak, live_cache_bytes(self.cfg))
        return out


def measure(model, prompts, name: str, ev, new: int, runs: int) -> dict:
    """One cell's figures (module docstring)."""
    def call(hook=None):
        return generate_grid(model, prompts, [ev], max_new_tokens=new, min_new_tokens=new,
                             hook=hook)[0]  # fmt: skip

    peak = Peak(model.config)
    result = call(peak)  # compiles, and traces the stages and bytes
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    k_used = None if result.k is None else max(result.k)
    full, compressed = steps(ev, new, k_used)
    return {"cell": name, "stages": list(dict.fromkeys(peak.stages)), "steps_full": full,
            "steps_compressed": compressed, "peak_cache_bytes": peak.peak,
            "seconds_per_sample": statistics.median(times) / len(prompts)}  # fmt: skip


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new", type=int, default=32, help="answer tokens")
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--lookahead", type=int, default=8, help="LAQ's L")
    parser.add_argument("--runs", type=int, default=2, help="warm repeats (median)")
    parser.add_argument("--cells", default=None, help="only these cells, by their names "
                        "in the table (default: all)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    model = dge_jax.load(args.model)
    vocab = model.config.vocab_size  # ids that are no special token on any model here
    prompts = [[min(1000, vocab // 2) + i % (vocab // 2) for i in range(args.length)]] * args.batch
    grid = cells(args.budget, args.k, args.lookahead)
    names = list(grid) if args.cells is None else args.cells.split(",")
    unknown = [n for n in names if n not in grid]
    if unknown:
        parser.error(f"--cells: unknown {unknown}; the cells are {', '.join(grid)}")
    rows = [measure(model, prompts, name, grid[name], args.new, args.runs) for name in names]
    base = next((r for r in rows if r["cell"] == "prefill"), rows[0])["seconds_per_sample"]
    print(f"{args.model}, {args.batch} x {args.length} tokens, {args.new} new, budget "
          f"{args.budget}, median of {args.runs}; times relative to {rows[0]['cell']} unless "
          "prefill ran:")
    print("| cell | steps on the full cache | steps on a compressed cache | peak cache MiB | "
          "s / sample | vs prefill |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cell']} | {r['steps_full']} | {r['steps_compressed']} | "
              f"{r['peak_cache_bytes'] / 2**20:.1f} | {r['seconds_per_sample']:.2f} | "
              f"{r['seconds_per_sample'] / base:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
