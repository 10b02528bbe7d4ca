"""One DGE cell's memory: each step compiled, and the full caches the grid holds around it.

    python -m benchmarks.cell_memory --config benchmarks/configs/llama3_1_8b.json \\
        --seq 32768 --batch 1 4 --platform tpu --topology v5e:2x4 [--json OUT]

Issue 29, "One live full cache": draft and rewind should donate, and `generate_grid` should
hold no full cache that no cell still needs. Three figures, per step of one DGE-SnapKV cell
(budget 1024, dge(2), as `generate_grid` runs it):

1. **compiled** (`compile_steps`): the library's own jitted steps, chained as the grid
   chains them (prefill_prompt -> start_state -> draft_tokens -> rewind_state ->
   select_for_budgets, what keep_masks calls -> apply_keep, compact -> decode_loop), each
   lowered with the previous step's outputs as ShapeDtypeStructs laid out by
   `dge_jax.runtime.sharding` on a (data 1, model N) mesh of the platform's devices (CPU: one
   device; TPU: the named topology, deviceless, `jax[tpu]`), and compiled:
   ``memory_analysis()`` per device, argument / output / alias (donated inputs whose buffers
   the outputs reuse) / temporary bytes. Decode's layer grouping is the one a host of that
   platform runs (TPU: "scan").
2. **held** (`trace_grid`): `generate_grid` itself, on CPU on a tiny random Llama (2 layers,
   4 query / 2 kv heads), through its stage hook: before and after every step, the cache
   arrays alive (`jax.live_arrays()` after a garbage collection: what the grid's references
   keep; donated buffers are deleted and drop out), each named by the steps whose outputs held
   its buffer (``prefill>draft>rewind``: one buffer, updated in place). Full caches (prefill's
   capacity) and compacted ones are counted in caches (k and v of every layer = 1). This is
   what the code holds, not what it is assumed to hold; sizes do not change it.
3. **cell** (`cell_rows`): per step, what the grid holds as the step starts (2: full and
   compacted caches, its arguments among them, at their compiled sizes from 1), plus the
   parameters, plus the step's outputs - aliased + temporaries (1). Small arrays (keep masks,
   observed queries, token buffers) are left out.

Run it at two commits (a copy of this file at the older one) to compare. What is measured:
compiled memory and the buffers alive in a real run; not measured: run time on a chip.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dge_jax.checkpoints.hf import parse_config
from dge_jax.eviction import evict, observation, selection
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import dge
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime import decoding, sharding
from dge_jax.runtime.prompts import DEFAULT_CHUNK, bucket_length
from dge_jax.runtime.sampling import Greedy

GIB = 2**30
GREEDY = Greedy()
# trace hook stage -> compiled step
STEP_OF = {"prefill": "prefill", "draft": "draft", "rewind": "rewind", "keep_masks": "select",
           "apply_eviction": "compact", "decode": "decode"}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 1. compiled
# ---------------------------------------------------------------------------------------------


def _struct(mesh, x, source=None):
    """A ShapeDtypeStruct of x with the sharding of `source` (same shape), else replicated."""
    same = source is not None and getattr(source, "sharding", None) is not None
    same = same and tuple(source.shape) == tuple(x.shape)
    sh = source.sharding if same else NamedSharding(mesh, P())
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)


def _like(mesh, abstract, source):
    """`abstract` with the shardings of `source`'s leaves at the same paths (else replicated)."""
    known = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(source)}
    return jax.tree_util.tree_map_with_path(
        lambda p, x: _struct(mesh, x, known.get(jax.tree_util.keystr(p))), abstract
    )


def per_device(tree) -> int:
    """Bytes one device holds of an abstract pytree."""
    return int(sum(np.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))  # fmt: skip


@dataclasses.dataclass
class Step:
    """One compiled step: memory per device, its abstract outputs, compile seconds."""

    name: str
    memory: dict
    outputs: object
    seconds: float


def _compile(name: str, fn, *args, **kwargs) -> Step:
    start = time.perf_counter()
    lowered = fn.lower(*args, **kwargs)
    compiled = lowered.compile()
    mem = compiled.memory_analysis()
    outputs = jax.tree.map(
        lambda info, sh: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sh),
        lowered.out_info, compiled.output_shardings,
    )  # fmt: skip
    memory = {k: int(getattr(mem, f"{k}_size_in_bytes"))
              for k in ("argument", "output", "alias", "temp")}  # fmt: skip
    return Step(name, memory, outputs, time.perf_counter() - start)


def abstract_params(family, cfg, mesh, dtype=jnp.bfloat16):
    """The parameters as ShapeDtypeStructs laid out by the library's sharding rules."""
    shapes = jax.eval_shape(lambda: family.init_params(cfg, jax.random.PRNGKey(0), dtype))
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    names = [sharding.field_name(path) for path, _ in leaves]
    shardings = sharding.param_shardings(cfg, names, mesh)
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[n])
               for n, (_, x) in zip(names, leaves, strict=True)]  # fmt: skip
    return jax.tree_util.tree_unflatten(tree, structs)


def compile_steps(args, platform, family, cfg, eos, mesh, batch: int, log) -> tuple[dict, dict]:
    """Every step of the cell compiled in the grid's order (module docstring); returns the
    steps by name and the sizes (bytes per device) the cell sum needs."""
    ev = Eviction(SnapKV(), budget=args.budget, timing=dge(args.k))
    needs, k, seq = ev.rule.needs, ev.timing.draft_steps, args.seq
    params = abstract_params(family, cfg, mesh)
    spec = sharding.rows_spec(cfg, batch, 2, mesh.shape)
    rows = NamedSharding(mesh, sharding.rows_spec(cfg, batch, 1, mesh.shape))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=NamedSharding(mesh, spec))
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
    buffer = bucket_length(args.max_new_tokens, args.chunk)
    room = min(buffer, evict.round_up_slots(max(k, 1)))  # stages.cache_room of one DGE cell
    statics = (family.forward, cfg, params)
    steps = {}

    def run(name, fn, *a, **kw):
        log(f"  compiling {name} (batch {batch})")
        steps[name] = _compile(name, fn, *a, **kw)
        return steps[name].outputs

    pre = run("prefill", decoding.prefill_prompt, *statics, tokens, lengths,
              capacity=seq + room, chunk=args.chunk, recording=needs.recording)  # fmt: skip
    first = jax.ShapeDtypeStruct((batch,), jnp.int32)
    make = functools.partial(decoding.start_state, max_new_tokens=args.max_new_tokens,
                             eos_ids=eos, buffer=buffer)  # fmt: skip
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    start = jax.eval_shape(make, pre.cache, first, lengths, key=key)
    start = _like(mesh, start, dataclasses.replace(start, cache=pre.cache))
    state, record = run("draft", decoding.draft_tokens, *statics, start, sampler=GREEDY,
                        eos_ids=eos, num_steps=k, recording=needs.recording.steps)  # fmt: skip
    steps_arr = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=NamedSharding(mesh, P()))
    state, record = run("rewind", decoding.rewind_state, state, record, lengths, steps_arr,
                        eos_ids=eos)  # fmt: skip
    cut = jax.eval_shape(lambda o, d: observation.for_rule(ev.rule, o, d), pre.obs, record)
    obs, drafts = _like(mesh, cut, (pre.obs, record))
    scalars = _like(mesh, ((jax.ShapeDtypeStruct((), jnp.int32),),
                           jax.ShapeDtypeStruct((), jnp.bool_),
                           jax.ShapeDtypeStruct((), jnp.float32)), None)  # fmt: skip
    sel = evict.SelectionSpec(rule=ev.rule, head_budget=ev.head_budget, alpha=ev.alpha,
                              ties=ev.ties, slide=ev.timing.slide)  # fmt: skip
    (keep,) = run("select", evict.select_for_budgets, state.cache, obs, drafts, *scalars,
                  spec=sel)  # fmt: skip
    masked = _like(mesh, jax.eval_shape(selection.apply_keep, state.cache, keep), state.cache)
    kept = min(args.budget, seq + k)
    capacity = evict.capacity_for(np.full((1,), kept), evict.round_up_slots(args.max_new_tokens))
    small = run("compact", evict.compact, masked, capacity=capacity)
    loop = {"layer_loop": "scan"} if platform == "tpu" else {}
    run("decode", decoding.decode_loop, *statics, dataclasses.replace(state, cache=small),
        sampler=GREEDY, eos_ids=eos, **loop)  # fmt: skip
    sizes = {"params": per_device(params), "full_cache": per_device(pre.cache),
             "compacted_cache": per_device(small), "capacity": seq + room,
             "compacted_capacity": capacity}  # fmt: skip
    return steps, sizes


# ---------------------------------------------------------------------------------------------
# 2. held: the caches generate_grid keeps alive, from a real run
# ---------------------------------------------------------------------------------------------

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
        self.cfg, self.names, self.events = cfg, {}, []
        self.full = self.rows = None  # prefill's capacity and batch

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
            key = (kind, name, ptr in arg_ptrs)
            seen[key] = seen.get(key, 0.0) + part
        self.events.append({"stage": stage, "when": when, "caches": [
            {"kind": k, "from": n, "argument": a, "caches": round(c, 3)}
            for (k, n, a), c in sorted(seen.items())]})  # fmt: skip

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
        self.snapshot(stage, "after", args)
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
    print(
        f"\n{title}: caches alive (k and v of every layer = 1 cache; * = an argument of the step)"
    )
    for e in events:
        parts = [f"{c['kind']} {c['caches']:g} [{c['from']}]{'*' if c['argument'] else ''}"
                 for c in e["caches"]]  # fmt: skip
        full = sum(c["caches"] for c in e["caches"] if c["kind"] == "full")
        print(
            f"  {e['stage']:>14} {e['when']:<6}  full caches {full:4.2f}: {'; '.join(parts) or '-'}"
        )


# ---------------------------------------------------------------------------------------------
# 3. the cell's live bytes
# ---------------------------------------------------------------------------------------------


def cell_rows(steps: dict, sizes: dict, events: list[dict]) -> list[dict]:
    """Per step, from the trace taken just before it: the caches the grid holds (its
    arguments among them) at their compiled sizes, the parameters, and the step's outputs -
    aliased + temporaries (module docstring)."""
    rows = []
    for e in events:
        name = STEP_OF.get(e["stage"])
        if e["when"] != "before" or name not in steps or name in {r["step"] for r in rows}:
            continue
        m = steps[name].memory
        held = {kind: sum(c["caches"] for c in e["caches"] if c["kind"] == kind)
                for kind in ("full", "compacted")}  # fmt: skip
        args = sum(c["caches"] for c in e["caches"] if c["kind"] == "full" and c["argument"])
        live = (sizes["params"] + held["full"] * sizes["full_cache"]
                + held["compacted"] * sizes["compacted_cache"]
                + m["output"] - m["alias"] + m["temp"])  # fmt: skip
        peak = m["argument"] + m["output"] - m["alias"] + m["temp"]
        rows.append({"step": name, **{f"{k}_bytes": v for k, v in m.items()},
                     "step_peak_bytes": peak, "full_caches_held": held["full"],
                     "full_caches_argument": args, "compacted_held": held["compacted"],
                     "cell_live_bytes": int(live)})  # fmt: skip
    return rows


def print_cell(platform: str, batch: int, steps: dict, sizes: dict, rows: list[dict]) -> None:
    g = lambda x: f"{x / GIB:7.3f}"  # noqa: E731
    print(
        f"\n{platform}, batch {batch}: per device, GiB; full cache {g(sizes['full_cache'])} "
        f"({sizes['capacity']} slots), compacted {g(sizes['compacted_cache'])} "
        f"({sizes['compacted_capacity']}), parameters {g(sizes['params'])}"
    )
    print(
        "  step      argument   output    alias     temp   step peak | full caches held "
        "(argument) | cell live  compile s"
    )
    for r in rows:
        print(
            f"  {r['step']:<8} {g(r['argument_bytes'])}  {g(r['output_bytes'])}  "
            f"{g(r['alias_bytes'])}  {g(r['temp_bytes'])}  {g(r['step_peak_bytes'])}   | "
            f"{r['full_caches_held']:4.2f} ({r['full_caches_argument']:g}) "
            f"+{r['compacted_held']:g} compacted | {g(r['cell_live_bytes'])}  "
            f"{steps[r['step']].seconds:6.1f}"
        )
    if rows:
        top = max(rows, key=lambda r: r["cell_live_bytes"])
        print(f"  the cell's peak: {g(top['cell_live_bytes'])} GiB at {top['step']}")


def grid_cells(budget: int):
    """A grid with every kind of cell: FullKV, prefill, dge(2), dge_w(2), and decode-time."""
    from dge_jax.eviction.decode_spec import DecodeCompression
    from dge_jax.eviction.timing import Timing, dge_w

    decode = Eviction(SnapKV(), budget=budget, timing=Timing("decode", 1),
                      decode=DecodeCompression(budget=budget, interval=4))  # fmt: skip
    return [None, Eviction(SnapKV(), budget=budget, timing=Timing("prefill", 1)),
            Eviction(SnapKV(), budget=budget, timing=dge(2)),
            Eviction(SnapKV(), budget=budget, timing=dge_w(2)), decode]  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cell_memory",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--config", default="benchmarks/configs/llama3_1_8b.json")
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--platform", choices=("cpu", "tpu"), nargs="+", default=["tpu"])
    p.add_argument("--topology", default="v5e:2x4")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK)
    p.add_argument("--trace_only", action="store_true", help="skip the compiled figures")
    p.add_argument("--no_grid", action="store_true", help="trace the one cell only")
    p.add_argument("--json", default=None, help="write every figure to this file")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    log = functools.partial(print, flush=True)
    out = {"args": vars(args), "trace": {}, "cells": []}
    # the tiny cell's budget: what 1024 is of 32k, a sixth of its 400-token prompt
    cell = [Eviction(SnapKV(), budget=64, timing=dge(args.k))]
    grid = ("a grid: FullKV, prefill, dge(2), dge_w(2), decode-time", grid_cells(64))
    for title, cells in (("one DGE-SnapKV cell", cell),) + (() if args.no_grid else (grid,)):
        out["trace"][title] = trace_grid(cells)
        print_trace(title, out["trace"][title])
    if not args.trace_only:
        raw = json.loads(pathlib.Path(args.config).read_text())
        family, cfg = parse_config(raw)
        eos = raw.get("eos_token_id")
        eos = () if eos is None else tuple(sorted({eos} if isinstance(eos, int) else set(eos)))
        for platform in args.platform:
            if platform == "tpu":
                from jax.experimental import topologies

                os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
                devices = topologies.get_topology_desc(
                    platform="tpu", topology_name=args.topology).devices  # fmt: skip
            else:
                devices = jax.devices("cpu")[:1]
            mesh = sharding.make_mesh(1, len(devices), devices=devices)
            for batch in args.batch:
                with jax.set_mesh(mesh):
                    steps, sizes = compile_steps(args, platform, family, cfg, eos, mesh, batch, log)
                rows = cell_rows(steps, sizes, out["trace"]["one DGE-SnapKV cell"])
                name = f"{platform} {args.topology}" if platform == "tpu" else platform
                print_cell(name, batch, steps, sizes, rows)
                out["cells"].append({"platform": name, "batch": batch, "sizes": sizes,
                                     "rows": rows})  # fmt: skip
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
