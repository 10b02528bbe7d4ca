"""Speed of the public pipeline at one commit: run it at two commits in one session and
compare (a change of shape must not cost speed).

    python -m benchmarks.shape_speed --out after.json        # here
    (cd OLD_CHECKOUT && python -m benchmarks.shape_speed --out before.json)
    python -m benchmarks.shape_speed --compare before.json after.json

On the embedded SmolLM2-135M-Instruct, batch 1, a 4k-token synthetic prompt (scenario (a)
of `benchmarks.run` at 4k), 64 new tokens (EOS banned), warm calls, median of --runs:

- prefill tok/s: `decoding.prefill_prompt` alone (chunk 512, SnapKV's window recorded);
- decode tok/s: FullKV `generate` of 64 tokens minus one of 2, per extra token;
- dge(2) e2e s: `generate` with SnapKV (kvpress preset) at budget 256 under dge(2);
- the 27-cell grid (SnapKV, PyramidKV, StreamingLLM x prefill, dge(2), dge_w(2) x budgets
  128/256/512) in one `generate_grid` call: cold s (compilation included), warm s, and
  XLA compilations and compile seconds of the cold call (`jax.monitoring`).

Each commit runs its own copy of this script (the steps it times moved into
`dge_jax.runtime.decoding` and were renamed: `prefill_prompt` was `dge_jax.decoding.prefill`), so
both time the same public calls. `--memory` adds, through the grid's stage hook (this commit
only), the bytes of its 27 evicted caches against one capacity for all layers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

import dge_jax
from dge_jax.checkpoints.tokenizer import prompt_renderer
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import Timing
from dge_jax.rules.pyramidkv import PyramidKV
from dge_jax.rules.snapkv import SnapKV
from dge_jax.rules.streamingllm import StreamingLLM
from dge_jax.runtime import decoding
from experiments import protocol
from experiments.suites import synthetic

TOKENS, NEW, BUDGET = 4096, 64, 256
GRID_BUDGETS = (128, 256, 512)

_compile = {"count": 0, "seconds": 0.0}


def _on_duration(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compile["count"] += 1
        _compile["seconds"] += duration


def _median_s(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _grid_inputs(model) -> tuple[list[int], list[Eviction]]:
    """The 4k-token prompt's ids and the grid's 27 cells."""
    tok = model.tokenizer
    length = TOKENS - 96  # room for the chat template, the answer prefix and NEW tokens
    row = synthetic.make_suite(tok, ["passkey"], 1, length, seed=0)["passkey"][0]
    text = protocol.prepare_sample(row, "passkey", tok, length, prompt_renderer(tok)).text
    ids = tok.encode(text)[: TOKENS - NEW]
    rules = (
        SnapKV.kvpress(),
        PyramidKV(window=64, kernel=5, pooling="avg"),
        StreamingLLM(sinks=4),
    )
    timings = (Timing("prefill", 1), Timing("dge", 2), Timing("dge_w", 2))
    return ids, [Eviction(p, b, t) for p in rules for t in timings for b in GRID_BUDGETS]


def measure(runs: int) -> dict:
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    model = dge_jax.load("smollm2-135m-instruct")
    ids, cells = _grid_inputs(model)
    snap = SnapKV.kvpress()

    tokens = jnp.asarray([[0] * (TOKENS - len(ids)) + ids], jnp.int32)
    lengths = jnp.asarray([len(ids)], jnp.int32)

    def prefill():
        out = decoding.prefill_prompt(
            model.forward, model.config, model.params, tokens, lengths,
            decoding.PrefillSpec(TOKENS + 512, chunk=512, recording=snap.needs.recording),
        )  # fmt: skip
        jax.block_until_ready(out.logits)

    def gen(n, eviction=None):
        return dge_jax.generate(model, [ids], max_new_tokens=n, min_new_tokens=n, eviction=eviction)

    dge2 = Eviction(snap, BUDGET, Timing("dge", 2))
    for warm in (prefill, lambda: gen(NEW), lambda: gen(2), lambda: gen(NEW, dge2)):
        warm()
    prefill_s = _median_s(prefill, runs)
    full_64, full_2 = _median_s(lambda: gen(NEW), runs), _median_s(lambda: gen(2), runs)
    dge_s = _median_s(lambda: gen(NEW, dge2), runs)

    def grid():
        return dge_jax.generate_grid(model, [ids], cells, max_new_tokens=NEW, min_new_tokens=NEW)

    before = dict(_compile)
    t0 = time.perf_counter()
    grid()
    cold = time.perf_counter() - t0
    compiles = _compile["count"] - before["count"]
    compile_s = _compile["seconds"] - before["seconds"]
    warm = _median_s(grid, runs)
    return {
        "prompt_tokens": len(ids),
        "prefill_tok_s": len(ids) / prefill_s,
        "decode_tok_s": (NEW - 2) / (full_64 - full_2),
        "dge2_e2e_s": dge_s,
        "grid_cells": len(cells),
        "grid_cold_s": cold,
        "grid_warm_s": warm,
        "grid_compilations": compiles,
        "grid_compile_s": compile_s,
    }


def grid_memory() -> dict:
    """Bytes of the 27 evicted caches of the grid, and what one capacity for all layers (the
    largest) would hold, through `generate_grid`'s stage hook (this commit's API)."""
    model = dge_jax.load("smollm2-135m-instruct")
    ids, cells = _grid_inputs(model)
    evicted = []

    def hook(stage, fn, *args, **kwargs):
        out = fn(*args, **kwargs)
        if stage == "apply_eviction":
            caps = out.capacities
            evicted.append((out.nbytes(), out.nbytes() * len(caps) * max(caps) // sum(caps)))
        return out

    dge_jax.generate_grid(model, [ids], cells, max_new_tokens=NEW, min_new_tokens=NEW, hook=hook)
    mib = 2**20
    return {
        "evicted_cache_mib": sum(b for b, _ in evicted) / mib,
        "one_capacity_mib": sum(o for _, o in evicted) / mib,
    }


def compare(before: dict, after: dict) -> None:
    print("| figure | before | after | after / before |")
    print("| --- | ---: | ---: | ---: |")
    for key, old in before.items():
        new = after[key]
        ratio = new / old if old else float("nan")
        print(f"| {key} | {old:.4g} | {new:.4g} | {ratio:.3f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the figures here (JSON)")
    parser.add_argument("--runs", type=int, default=3, help="warm repeats (median)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument(
        "--memory",
        action="store_true",
        help="only the grid's evicted cache bytes (needs generate_grid's hook)",
    )
    args = parser.parse_args(argv)
    if args.memory:
        print(json.dumps(grid_memory(), indent=1))
        return
    if args.compare:
        before, after = (json.load(open(p)) for p in args.compare)
        compare(before, after)
        return
    figures = measure(args.runs)
    print(json.dumps(figures, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f)


if __name__ == "__main__":
    main()
