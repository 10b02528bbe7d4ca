"""The caches `generate_grid` holds around each step, read from a real run.

    python -m benchmarks.cell_memory [--no_grid] [--json OUT]

What it checks, "one live full cache" (docs/design.md): draft and rewind donate, and
`generate_grid` holds no full cache that no cell still needs. This runs `generate_grid` itself,
on CPU on a tiny random Llama (2 layers, 4 query / 2 kv heads), through its stage hook: before
and after every jitted step, the cache arrays alive (`jax.live_arrays()` after a garbage
collection: what the grid's references keep; donated buffers are deleted and drop out), each
named by the steps whose outputs held its buffer (``prefill>draft>rewind``: one buffer, updated
in place). Full caches (prefill's capacity) and compacted ones are counted in caches (k and v
of every layer = 1). Each entry also says its slots per head and the step call that first made
its buffer (``origin``, an index into the event's ``call``s: two calls of one stage, such as
the lookahead's compaction and the cell's own, are told apart). It traces one DGE-SnapKV cell,
then a grid with every kind of cell (FullKV, prefill, dge(2), dge_w(2), lookahead(4),
decode-time).

This is what the code holds, not what it is assumed to hold; sizes do not change it. At a
real model's size, `python -m benchmarks.cost.tpu_aot` compiles the cell's steps for a TPU
topology and adds these held caches, at their compiled sizes, to each step's own memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib

import jax
import numpy as np

from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import dge
from dge_jax.rules.snapkv import SnapKV

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=4096)  # fmt: skip


def _cache_arrays(cfg):
    """The live k / v arrays of caches ([Lg, B, Hkv, S, D] in the cache dtype)."""
    gc.collect()
    return [x for x in jax.live_arrays()
            if x.ndim == 5 and x.shape[2] == cfg.num_kv_heads and x.shape[4] == cfg.head_dim
            and not x.is_deleted()]  # fmt: skip


class Tracer:
    """The hook: snapshots of the live caches before and after each step (module docstring)."""

    def __init__(self, cfg):
        self.cfg, self.names, self.origins, self.events = cfg, {}, {}, []
        self.full = self.rows = None  # prefill's capacity and batch
        self.calls = 0  # step calls so far: the index of the next one

    def snapshot(self, stage: str, when: str, args) -> None:
        arg_ptrs = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(args)
                    if isinstance(x, jax.Array) and not x.is_deleted()}  # fmt: skip
        seen = {}
        for x in _cache_arrays(self.cfg):
            ptr = x.unsafe_buffer_pointer()
            kind = "full" if x.shape[3] == self.full else "compacted"
            # one cache = k and v of every layer and row: [Lg, B', ...] is Lg/L * B'/B / 2 of it
            part = x.shape[0] / self.cfg.num_layers * x.shape[1] / self.rows / 2
            name = self.names.get(ptr, "?")
            key = (kind, name, ptr in arg_ptrs, self.origins.get(ptr, -1), x.shape[3])
            seen[key] = seen.get(key, 0.0) + part
        self.events.append({"stage": stage, "when": when, "call": self.calls, "caches": [
            {"kind": k, "from": n, "argument": a, "origin": o, "slots": s, "caches": round(c, 3)}
            for (k, n, a, o, s), c in sorted(seen.items())]})  # fmt: skip

    def hook(self, stage, fn, *args, **kwargs):
        self.snapshot(stage, "before", args)
        before = {x.unsafe_buffer_pointer(): x for x in jax.tree.leaves(args)
                  if isinstance(x, jax.Array) and not x.is_deleted()}  # fmt: skip
        out = jax.block_until_ready(fn(*args, **kwargs))
        if stage == "prefill":
            self.full, self.rows = out.cache.capacity, out.cache.batch_size
        for x in jax.tree.leaves(out):
            if not isinstance(x, jax.Array):
                continue
            ptr = x.unsafe_buffer_pointer()
            donated = ptr in before and before[ptr].is_deleted()
            old = self.names.get(ptr) if donated or (ptr in before and before[ptr] is x) else None
            self.names[ptr] = (
                stage if old is None else (old if old.endswith(stage) else f"{old}>{stage}")
            )
            if old is None:
                self.origins[ptr] = self.calls
        self.snapshot(stage, "after", args)
        self.calls += 1
        return out


def trace_grid(cells, new_tokens: int = 8, prompt_len: int = 400) -> list[dict]:
    """generate_grid of `cells` on the tiny Llama, one row, traced (`Tracer`)."""
    from dge_jax.config import ModelConfig
    from dge_jax.families import get_family
    from dge_jax.generation import generate_grid
    from dge_jax.model import Model
    from models.llama_like import init_params

    cfg = ModelConfig(family="llama", **TINY)
    model = Model(get_family("llama"), cfg, init_params(cfg, jax.random.PRNGKey(0)), None)
    prompt = np.random.default_rng(0).integers(0, TINY["vocab_size"], prompt_len).tolist()
    tracer = Tracer(cfg)
    generate_grid(model, [prompt], cells, max_new_tokens=new_tokens, hook=tracer.hook)
    tracer.snapshot("end", "after", ())
    return tracer.events


def print_trace(title: str, events: list[dict]) -> None:
    print(f"\n{title}: caches alive (k and v of every layer = 1 cache; * = an argument of the "
          "step; #n: made by step call n, the first being 0)")  # fmt: skip
    for e in events:
        parts = [f"{c['kind']} {c['caches']:g} [{c['from']} #{c['origin']}]"
                 f"{'*' if c['argument'] else ''}" for c in e["caches"]]  # fmt: skip
        full = sum(c["caches"] for c in e["caches"] if c["kind"] == "full")
        print(
            f"  {e['stage']:>14} {e['when']:<6}  full caches {full:4.2f}: {'; '.join(parts) or '-'}"
        )


# the tiny cell's budget: what 1024 is of 32k, a sixth of its 400-token prompt
TINY_BUDGET = 64


def tiny_cell(kind: str, k: int = 2, ahead: int = 8) -> Eviction:
    """The tiny trace's SnapKV cell of each timing `benchmarks.cost.tpu_aot` compiles: "dge" (k),
    "lookahead" (`ahead` tokens, its first stage at half the budget and window 32, as
    LAQ's 512 is of 1024) or "decode" (interval k)."""
    from dge_jax.eviction.decode_spec import DecodeCompression
    from dge_jax.eviction.timing import Timing, lookahead

    if kind == "lookahead":
        return Eviction(SnapKV(), TINY_BUDGET, lookahead(ahead, TINY_BUDGET // 2, 32))
    if kind == "decode":
        return Eviction(SnapKV(), TINY_BUDGET, Timing("decode", 1),
                        decode=DecodeCompression(budget=TINY_BUDGET, interval=k))  # fmt: skip
    return Eviction(SnapKV(), budget=TINY_BUDGET, timing=dge(k))


def grid_cells(budget: int):
    """A grid with every kind of cell: FullKV, prefill, dge(2), dge_w(2), lookahead(4) and
    decode-time."""
    from dge_jax.eviction.decode_spec import DecodeCompression
    from dge_jax.eviction.timing import Timing, dge_w, lookahead

    decode = Eviction(SnapKV(), budget=budget, timing=Timing("decode", 1),
                      decode=DecodeCompression(budget=budget, interval=4))  # fmt: skip
    return [None, Eviction(SnapKV(), budget=budget, timing=Timing("prefill", 1)),
            Eviction(SnapKV(), budget=budget, timing=dge(2)),
            Eviction(SnapKV(), budget=budget, timing=dge_w(2)),
            Eviction(SnapKV(), budget=budget, timing=lookahead(4, budget // 2, 32)),
            decode]  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cell_memory",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--no_grid", action="store_true", help="trace the one cell only")
    p.add_argument("--json", default=None, help="write the traces to this file")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = {"args": vars(args), "trace": {}}
    cell = [tiny_cell("dge", args.k)]
    grid = ("a grid: FullKV, prefill, dge(2), dge_w(2), lookahead(4), decode-time",
            grid_cells(TINY_BUDGET))  # fmt: skip
    for title, cells in (("one DGE-SnapKV cell", cell),) + (() if args.no_grid else (grid,)):
        out["trace"][title] = trace_grid(cells)
        print_trace(title, out["trace"][title])
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
