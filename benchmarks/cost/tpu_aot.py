"""Compile every generation stage for a TPU topology without a TPU, and account for it.

    python -m benchmarks.cost.tpu_aot --topology v5e:2x4 \\
        --config benchmarks/configs/llama3_1_8b.json --seq 32768 --batch 1 [--json] \\
        [--max_batch] [--mesh data=1,model=8] [--cells dge,lookahead,decode] [--lookahead 8]

Errors (a topology that is not CHIP:AxB[xC] or that libtpu cannot lay out, a --config that is
missing or that this library does not run, a --mesh that does not fit the topology's devices,
libtpu not installed) are checked before anything compiles and end in one stderr line,
``error: <what>; <the fix>``, exit status 2 for a mistake in the command and 1 for the
environment, as `python -m dge_jax` does; ``--verbose`` shows the traceback instead.

Needs ``jax[tpu]`` (libtpu) installed; no TPU. ``jax.experimental.topologies`` gives the
abstract devices of the named topology, the library's own sharding rules lay a (data, model)
mesh and the bf16 parameters over them, and each stage of one DGE-SnapKV cell (budget 1024,
DGE(2), as `generate_grid` runs it: `benchmarks.cost.tpu_stages`) is lowered and compiled by XLA:TPU
for that chip. Per stage it prints:

- **compiles**, or the compiler's error (out of HBM is a compile error on TPU);
  ``hbm_bytes_per_device`` is the HBM XLA:TPU lets one program use on one device (its own
  figure, read from its refusal of a 1 TiB program: 15.75 GiB of a v5e's 16, 31.25 of a
  v6e's 32), and what "fits" below is measured against;
- **peak bytes per device**: ``memory_analysis()``'s arguments + outputs - aliased (donated)
  + temporaries, and each of those;
- **FLOPs and HBM bytes**, with every loop body counted once per trip
  (`benchmarks.cost.hlo_cost`: its docstring says how and where the count stops being exact);
  a Pallas kernel counts the FLOPs and bytes it declares (its ``pl.CostEstimate``: the
  flash kernels declare one layer's keys and values read once per query tile, dense over
  every slot, so skipped tiles are not taken off) in ``hbm_bytes_declared``, what the
  ratios and roofline use; ``hbm_bytes`` counts each kernel's operands and results instead,
  which for a kernel reading one layer of the stacked cache in place is the whole stack;
  XLA's own ``cost_analysis()`` figures (each loop body once) are in the JSON beside them;
- **ideal HBM bytes**: prefill one read of the weights + the prompt's keys and values
  written; draft and decode the weights + the valid keys and values read once per step;
  rewind its positions rewritten; select the keys and positions read, the mask written;
  compact the positions and kept entries read, the compacted cache written. The embedding
  table is not counted as read (a lookup reads B rows of it) unless it is also the LM head;
- **roofline time** on one device, max(FLOPs / peak FLOP/s, HBM bytes / HBM bandwidth), for
  the counted figures and for the ideal ones (`CHIPS`: Google's published per-chip figures,
  shared by the devices of a chip: v4 topologies give two devices a chip);
- **Pallas kernel**: whether the program holds a ``tpu_custom_call`` (a Pallas/Mosaic kernel);
- **a causal model of prefill's kernel**: the flash kernel declares dense work (every key
  tile for every query tile); ``kernel_causal_fraction`` is the share of those tile pairs a
  causal prompt needs (`tpu_stages.causal_tile_fraction`, what the kernel's skip tables leave
  it), and ``hbm_bytes_causal`` / ``roofline_causal_s`` scale the kernels' declared bytes
  (their q and output included: a slight undercount) and FLOPs by it. Modelled, not counted;
- **where the bytes go** (``hbm_by_source`` in the JSON, the largest first; the table prints
  prefill's): the counted HBM bytes by the JAX primitive and result type that moved them
  (`hlo_cost.source_of`), loops times their trips, kernels at what they declare;
- **kv collectives**: every all-gather / all-to-all / collective-permute / all-reduce /
  reduce-scatter whose operand or result has a cache's slots next to the head dimension
  ([..., S, D], or S·D flattened, S any cache capacity of the stage or the prefill key block)
  in the cache's dtype: keys or values moving between devices. Empty is what we want.

**The memory of the whole DGE cell.** What `generate_grid` holds is read, not assumed: a real
grid of one DGE-SnapKV cell runs on a tiny Llama on CPU with a stage hook that lists the
caches alive before each step (`cell_memory.trace_grid`, `jax.live_arrays`; donated buffers
are deleted and drop out). Today the draft and rewind donate prefill's cache and update it in
place, the cell's plan drops it once evicted, and decode runs over the compacted cache alone:
one full cache until compaction, then none. The bytes alive on a device while stage s runs
are counted as: the parameters + the caches held as s starts (full and compacted, at this
cell's compiled sizes; s's arguments among them) + s's outputs - its aliased (donated) bytes +
its temporaries. Small arrays (keep masks, observed queries, the first token, ``apply_keep``'s
new positions) are left out. The FullKV decode (``decode_full``) is another cell and not in
this sum. ``kept_argument_bytes`` (arguments - aliased) is what a stage reads without
consuming it; ``full_caches_alive_during_decode`` counts the full-size caches held while the
compacted cache decodes.

**What each timing costs.** ``--cells`` (default all three) compiles beside the
DGE cell, for the same topology, config, seq and batch, a **lookahead cell** (LAQ,
`timing.lookahead`: L = ``--lookahead`` tokens on a copy compressed at LAQ's 512 entries,
window 32, then the selection from the full cache at ``--budget``; stages ``first_select``,
``first_compact``, ``lookahead``, ``select``, ``compact``, ``decode``) and a **decode cell**
(timing "decode", ``DecodeCompression(budget, interval=k)``: ``decode_compressed``, k steps
on the full cache, then a compression every k steps in a loop cache of
``DecodeCompression.capacity`` slots), each stage by stage (`tpu_stages.LookaheadCell`,
`tpu_stages.DecodeCell`; one prefill program, compiled once for the cells that share it).
Each cell's live bytes are counted as the DGE cell's, from its own traced grid
(`cell_memory.tiny_cell`): a held cache weighs the compiled size of the stage that made it.
The DGE cell keeps its keys (``cell``, ``stages``); the others are under ``timings``, and
``comparison`` holds one row per cell: one-token forward steps on the full cache and on a
compressed one (from the timing: `tpu_stages.Cell.forward_steps`), the full caches alive
while the peak stage runs (traced as it ends, its arguments still held), the peak, the peak
over the parameters in full caches (XLA's temporaries count there, such as a loop's own copy
of a cache it cannot update in place, which the trace cannot see) and whether it fits; with
``--max_batch``, its largest batch and the peak there. All three by default, side by side:
the DGE cell's figures and keys are unchanged (its table prints first, as before), and the
two cells add about two minutes at 32k on two cores;
``--cells dge`` compiles the DGE cell alone.

**--max_batch**: the largest batch (a multiple of the mesh's row multiple,
`sharding.row_multiple`, or of 8 times it for an int4 cache) at which (a) every stage
compiles and its own peak fits the HBM (``every_stage``), and (b) the DGE cell's live bytes,
counted as above, fit (``dge_cell``), and (c) each cell's live bytes fit (``cells``, the
comparison's largest batch). Found by doubling, then bisection, each probe a full compile of
every stage of that cell; memory grows with the batch (over the batches probed), so the
search is exact for the compiled programs. The report printed is the one at the
``dge_cell`` batch (or the ``every_stage`` one when none fits), for every cell.

Why int4 in 8 rows a device (`batch_step`): inside the layer loop, where each block write
covers 4 rows (R / G) of the stacked key scales and zeros, XLA:TPU lays those leaves out with
the batch as the tiled second-minor dimension. With 72 rows every use has that layout; with
70, some are laid out with the 1,026 scale rows tiled instead, and the copies between the two,
with the rematerialisation they force, cost more than the 2 rows save (Llama-8B at 32k on a
v5e: prefill needs 17.17 GiB of temporaries at 70 rows, 14.61 at 72; read in the buffer
assignments, benchmarks/RESULTS.md, "An int4 cache"). Between multiples of 8 memory is not
monotone in the batch, which the bisection needs.

What is measured: what XLA:TPU compiled (memory per device, the program's ops); what is
counted: FLOPs and bytes from the compiled program, projected to a time with the chip's peak
figures. What is not measured: time on a chip. Run times, overlap of compute and memory, the
interconnect and the decode loop's early exit are out of reach without one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import sys
from collections.abc import Callable

from benchmarks.cost import hlo_cost, tpu_stages
from dge_jax.cli import ENVIRONMENT, USAGE, Parser, one_line
from dge_jax.distribution import sharding
from dge_jax.runtime import platform
from dge_jax.runtime.quantized import check_kv_quant, parse_kv_quant

GIB = 2**30
SOURCES = 12  # sources of HBM bytes reported per stage


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU chip (or one device's share of it): peak bf16 FLOP/s, HBM bandwidth (bytes/s),
    HBM bytes."""

    peak_flops: float
    hbm_bandwidth: float
    hbm_bytes: int


# Per-chip figures from Google's Cloud TPU documentation, "System architecture" tables:
# v5e: https://cloud.google.com/tpu/docs/v5e  (197 TFLOPs bf16; HBM2 16 GB, 819 GBps)
# v6e: https://cloud.google.com/tpu/docs/v6e  (918 TFLOPs bf16; HBM 32 GB, 1600 GBps)
# v5p: https://cloud.google.com/tpu/docs/v5p  (459 TFLOPs bf16; HBM2e 95 GB, 2765 GBps)
# v4:  https://cloud.google.com/tpu/docs/v4   (275 TFLOPs bf16; HBM2 32 GiB, 1200 GBps)
# v5p's two TensorCores are one device (megacore); v4's topology descriptions give one device
# per TensorCore, two a chip (`device_of` shares the chip). HBM sizes are taken as GiB.
CHIPS = {
    "v5e": Chip(197e12, 819e9, 16 * GIB),
    "v6e": Chip(918e12, 1600e9, 32 * GIB),
    "v5p": Chip(459e12, 2765e9, 95 * GIB),
    "v4": Chip(275e12, 1200e9, 32 * GIB),
}
CELL = tuple(tpu_stages.Cell.HOOKS)  # one DGE cell's stages
CELLS = tuple(tpu_stages.TIMINGS)  # the cells --cells may name: dge, lookahead, decode


class NoLibtpu(ImportError):
    """libtpu (jax's TPU support) is not installed: deviceless compilation needs it."""


def chip_of(topology: str) -> Chip:
    """The chip of a topology name CHIP:AxB[xC]; ValueError for any other name."""
    kind, _, dims = topology.partition(":")
    if kind.lower() not in CHIPS or not re.fullmatch(r"[1-9]\d*(x[1-9]\d*)*", dims):
        raise ValueError(f"--topology {topology!r} is not a TPU topology: write CHIP:AxB[xC] "
                         f"with CHIP one of {', '.join(sorted(CHIPS))}, e.g. v5e:2x4")  # fmt: skip
    return CHIPS[kind.lower()]


@functools.cache
def device_of(topology: str) -> Chip:
    """One device's share of its chip (v4's topologies give a device per TensorCore, two a
    chip), with the HBM the compiler lets one program use (`usable_hbm`)."""
    chip, devices = chip_of(topology), topology_devices(topology)
    chips = math.prod(int(d) for d in topology.partition(":")[2].split("x"))
    share = chips / len(devices)
    usable = usable_hbm(devices[0])
    return Chip(chip.peak_flops * share, chip.hbm_bandwidth * share,
                usable or int(chip.hbm_bytes * share))  # fmt: skip


def usable_hbm(device) -> int | None:
    """The HBM a program may use on `device`, as XLA:TPU's compiler counts it (below the chip's:
    the runtime keeps some), read from its refusal of a 1 TiB program; None if not said."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    one = NamedSharding(jax.sharding.Mesh(np.array([device]), ("x",)), P())
    try:
        jax.jit(lambda: jnp.zeros((2**40,), jnp.int8), out_shardings=one).lower().compile()
    except Exception as e:
        found = re.search(r"available HBM \(([\d.]+)([KMGT])\)", str(e))
        if found:
            return int(float(found.group(1)) * 2 ** (10 * "KMGT".index(found.group(2)) + 10))
    return None


def topology_devices(topology: str):
    """The abstract devices of a named TPU topology (needs libtpu, not a TPU): `NoLibtpu`
    without libtpu, ValueError for a name libtpu cannot lay out."""
    import jax
    from jax.experimental import topologies

    chip_of(topology)  # the name's form, before libtpu is asked
    # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) when it loads; compiling opens
    # no chip, so a second process (a test beside a benchmark) may load it too.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    except Exception as e:
        if isinstance(e, ImportError) or "TPU support not installed" in str(e):
            raise NoLibtpu(
                f"deviceless TPU compilation needs libtpu, which is not installed "
                f'({one_line(e).split(";")[0][:120]}); install it with pip install -e ".[tpu-aot]" '
                f"(setup.cfg's tpu-aot extra) or pip install \"jax[tpu]=={jax.__version__}\""
            ) from e
        raise ValueError(
            f"--topology {topology!r}: libtpu cannot lay out this topology ({one_line(e)[:200]}); "
            "give a slice shape the chip comes in, e.g. v5e:2x4, v6e:2x4, v5p:2x2x1, v4:2x2x1"
        ) from e


def moves_kv(coll: hlo_cost.Collective, slots: tuple[int, ...], head_dim: int, dtype: str) -> bool:
    """Whether a collective's operand or result looks like keys or values: a cache's slots
    next to the head dimension ([..., S, D], size-1 dims dropped), or S·D flattened."""
    for array in coll.operands + coll.results:
        if array.dtype != dtype:
            continue
        dims = [d for d in array.dims if d != 1]
        pairs = zip(dims, dims[1:], strict=False)
        if any(s in slots and d == head_dim for s, d in pairs):
            return True
        if any(d == s * head_dim for d in dims for s in slots):
            return True
    return False


def _seconds(flops: float, nbytes: float, chip: Chip) -> float:
    return max(flops / chip.peak_flops, nbytes / chip.hbm_bandwidth)


def stage_report(run: tpu_stages.StageRun, chip: Chip, head_dim: int) -> dict:
    """One stage's figures (module docstring); numbers are per device, None when not compiled."""
    out = {"name": run.name, "compiles": run.compiled is not None, "error": run.error,
           "compile_s": round(run.compile_s, 1)}  # fmt: skip
    if run.note:
        out["note"] = run.note
    if run.compiled is None:
        keys = ("peak_bytes_per_device", "flops", "hbm_bytes", "ideal_hbm_bytes",
                "pallas_kernel", "kv_collectives")  # fmt: skip
        return out | dict.fromkeys(keys)
    mem = run.compiled.memory_analysis()
    arg, res = mem.argument_size_in_bytes, mem.output_size_in_bytes
    alias, temp = mem.alias_size_in_bytes, mem.temp_size_in_bytes
    counted = hlo_cost.analyze(run.compiled.as_text(), run.unknown_trips)
    cost = counted.cost
    xla = run.compiled.cost_analysis() or {}
    f = run.kernel_fraction
    causal_bytes = cost.hbm_bytes_declared - (1 - f) * cost.kernel_declared_bytes
    kv = [
        f"{c.opcode} {a.dtype}{list(a.dims)} ({c.op_name})"
        for c in counted.collectives
        if any(moves_kv(c, run.slots, head_dim, dtype) for dtype in ("bf16", "s8"))
        for a in c.results[:1]
    ]
    return out | {
        "peak_bytes_per_device": arg + res - alias + temp,
        "argument_bytes": arg, "output_bytes": res, "temp_bytes": temp, "alias_bytes": alias,
        "kept_argument_bytes": arg - alias,
        "flops": cost.flops, "transcendentals": cost.transcendentals,
        "hbm_bytes": cost.hbm_bytes, "ideal_hbm_bytes": run.ideal_hbm_bytes,
        "kernel_boundary_bytes": cost.kernel_boundary_bytes,
        "kernel_declared_bytes": cost.kernel_declared_bytes,
        "hbm_bytes_declared": cost.hbm_bytes_declared,
        "ideal_flops": run.ideal_flops,
        "hbm_over_ideal": (cost.hbm_bytes_declared / run.ideal_hbm_bytes
                           if run.ideal_hbm_bytes else None),
        "roofline_s": _seconds(cost.flops, cost.hbm_bytes_declared, chip),
        # the kernels' declared work scaled to what a causal prompt needs (prefill's flash
        # kernel: `tpu_stages.causal_tile_fraction`; 1 elsewhere): a model, said as such
        "kernel_causal_fraction": f,
        "hbm_bytes_causal": causal_bytes,
        "roofline_causal_s": _seconds(cost.flops - (1 - f) * cost.kernel_declared_flops,
                                      causal_bytes, chip),  # fmt: skip
        "ideal_s": _seconds(run.ideal_flops, run.ideal_hbm_bytes, chip),
        "pallas_kernel": counted.pallas,
        "hbm_by_source": [{"source": k, "bytes": v} for k, v in counted.top_sources(SOURCES)],
        "kv_collectives": kv,
        "collectives": len(counted.collectives),
        "collective_bytes": cost.collective_bytes,  # per device, loops times their trips
        "loops": [dataclasses.asdict(loop) for loop in counted.loops],
        "xla_cost_analysis": {"flops": xla.get("flops"),
                              "bytes_accessed": xla.get("bytes accessed")},
    }  # fmt: skip


@functools.cache
def held_caches(timing: str, k: int, ahead: int) -> dict[str, dict[str, dict]]:
    """Per stage of one cell, the caches `generate_grid` holds as the stage starts ("held")
    and as it ends, its arguments still referenced ("alive"), as {(full or compacted, the
    stage that made it): caches}: read from a real run of the grid (a tiny Llama on CPU,
    `cell_memory.trace_grid` of `cell_memory.tiny_cell`), not assumed. Sizes do not change
    what is held."""
    from benchmarks import cell_memory

    steps = list(tpu_stages.TIMINGS[timing].HOOKS.items())
    events = cell_memory.trace_grid([cell_memory.tiny_cell(timing, k, ahead)])
    events = [e for e in events if e["stage"] != "end"]
    ran = [e["stage"] for e in events if e["when"] == "before"]
    if ran != [hook for _, hook in steps]:
        raise RuntimeError(f"generate_grid ran {ran} for a {timing} cell, but tpu_stages "
                           f"compiles {steps}: make them agree")  # fmt: skip
    out = {name: {"held": {}, "alive": {}} for name, _ in steps}
    for e in events:
        name, counts = steps[e["call"]][0], {}
        for c in e["caches"]:
            if c["origin"] < 0:
                raise RuntimeError(f"a cache alive at {e['stage']} that no step made: {c}")
            key = (c["kind"], steps[c["origin"]][0])
            counts[key] = counts.get(key, 0.0) + c["caches"]
        if e["when"] == "before":
            out[name]["held"] = counts
        alive = out[name]["alive"]
        for key, n in counts.items():
            alive[key] = max(alive.get(key, 0.0), n)
    return out


def _count(caches: dict, kind: str) -> float:
    return sum(n for (k, _), n in caches.items() if k == kind)


def _weigh(cell: tpu_stages.Cell, caches: dict) -> float:
    """Per-device bytes of held caches (k and v), each at its maker's compiled slots."""
    made, slot = cell.made(), cell.sizes.kv_slot
    return sum(sum(n * slot * made[maker] for (k, maker), n in caches.items() if k == kind)
               for kind in ("full", "compacted"))  # fmt: skip


def cell_report(cell: tpu_stages.Cell, stages: list[dict]) -> dict:
    """The cell's live bytes per stage (module docstring): the parameters, the caches the
    grid holds as the stage starts (`held_caches`, at this cell's compiled sizes), and the
    stage's outputs - aliased + temporaries."""
    by_name = {s["name"]: s for s in stages}
    params = tpu_stages.per_device_bytes(cell.params)
    full = cell.sizes.kv_slot * cell.capacity  # one full cache (k and v), per device
    setup = cell.setup
    trace = held_caches(setup.timing, setup.k, setup.lookahead)
    live, held, alive = {}, {}, {}
    for name in cell.HOOKS:
        s = by_name[name]
        if not s["compiles"]:
            break
        caches = trace[name]
        held[name] = (_count(caches["held"], "full"), _count(caches["held"], "compacted"))
        alive[name] = _count(caches["alive"], "full")
        live[name] = (params + _weigh(cell, caches["held"]) + s["output_bytes"]
                      - s["alias_bytes"] + s["temp_bytes"])  # fmt: skip
        s["cell_live_bytes_per_device"] = live[name]
        s["cell_caches_held"] = {"full": held[name][0], "compacted": held[name][1]}
        s["cell_caches_alive"] = {"full": alive[name],
                                  "compacted": _count(caches["alive"], "compacted")}  # fmt: skip
    complete = len(live) == len(cell.HOOKS)
    peak_stage = max(live, key=live.get) if live else None
    last = list(cell.HOOKS)[-1]  # the cell's decode
    failed = next((n for n in cell.HOOKS if not by_name[n]["compiles"]), None)
    on_full, on_compressed = cell.forward_steps
    return {
        "stages": list(cell.HOOKS),
        "complete": complete,
        "peak_bytes_per_device": live[peak_stage] if complete else None,
        "peak_stage": peak_stage,
        "full_caches_alive_during_decode": held[last][0] if complete else None,
        "full_caches_held_at_most": max(n for n, _ in held.values()) if held else None,
        "full_cache_bytes_per_device": full,
        "capacity": cell.capacity, "compacted_capacity": cell.compact_capacity,
        "budget": setup.budget, "k": setup.k,
        "max_new_tokens": setup.max_new_tokens,
        "timing": setup.timing, "label": cell.label,
        "forward_steps": {"full": on_full, "compressed": on_compressed},
        "full_caches_alive_at_peak": alive[peak_stage] if complete else None,
        # the peak over the parameters, in full caches: XLA's temporaries (a loop's copy of
        # a cache it cannot update in place) count too, which the trace cannot see
        "peak_in_full_caches": (live[peak_stage] - params) / full if complete else None,
        "failed_stage": failed,
    } | _timing_fields(cell)  # fmt: skip


def _timing_fields(cell: tpu_stages.Cell) -> dict:
    """What the lookahead and decode cells add: the copy's size, the loop cache's (as the
    compiled program returns it)."""
    if isinstance(cell, tpu_stages.LookaheadCell):
        return {"lookahead": cell.ahead, "first_stage": {
            "budget": cell.first.budget, "window": cell.first.rule.needs.window},
            "lookahead_capacity": cell.copy_capacity}  # fmt: skip
    if isinstance(cell, tpu_stages.DecodeCell):
        run = cell.runs["decode_compressed"]
        loop = None if run.compiled is None else run.outputs[0].cache.capacity
        return {"interval": cell.ev.decode.interval, "loop_capacity": loop}
    return {}


def cell_part(setup: tpu_stages.Setup, topology: str, log=None, shared=None) -> dict:
    """One cell (`setup.timing`'s) compiled: its stages' figures and its live bytes; shared:
    `tpu_stages.compile_cell`'s compiled prefills."""
    device = device_of(topology)
    cell = tpu_stages.compile_cell(setup, log, shared)
    stages = [stage_report(r, device, setup.cfg.head_dim) for r in cell.runs.values()]
    return {"cell": cell_report(cell, stages), "stages": stages,
            "params_bytes_per_device": tpu_stages.per_device_bytes(cell.params)}  # fmt: skip


def comparison(cell: dict, hbm: int) -> dict:
    """One row of the cells' comparison (module docstring); largest_batch: --max_batch's."""
    return {"cell": cell["label"], "timing": cell["timing"],
            "steps_full": cell["forward_steps"]["full"],
            "steps_compressed": cell["forward_steps"]["compressed"],
            "full_caches_alive_at_peak": cell["full_caches_alive_at_peak"],
            "peak_bytes_per_device": cell["peak_bytes_per_device"],
            "peak_stage": cell["peak_stage"], "peak_in_full_caches": cell["peak_in_full_caches"],
            "failed_stage": cell["failed_stage"], "fits": cell_fits(cell, hbm),
            "largest_batch": None, "largest_batch_peak_bytes": None}  # fmt: skip


def assemble(setup: tpu_stages.Setup, topology: str, parts: dict[str, dict]) -> dict:
    """The whole report (one JSON object) of cells compiled for `setup` at one batch."""
    device = device_of(topology)
    rep = {
        "topology": topology, "seq": setup.seq, "batch": setup.batch,
        "hbm_bytes_per_device": device.hbm_bytes,
        "chip": dataclasses.asdict(chip_of(topology)),
        "device": dataclasses.asdict(device),
        "mesh": dict(setup.mesh.shape),
        "params_bytes_per_device": next(iter(parts.values()))["params_bytes_per_device"],
        "layer_loop": setup.decode_layer_loop,
        "prefill_chunk": setup.prefill_chunk, "attention": setup.backend.attention,
        "kv_quant": setup.kv_quant,
    }  # fmt: skip
    if "dge" in parts:
        rep |= {"cell": parts["dge"]["cell"], "stages": parts["dge"]["stages"]}
    rep["timings"] = {kind: {"cell": p["cell"], "stages": p["stages"]}
                      for kind, p in parts.items() if kind != "dge"}  # fmt: skip
    rep["comparison"] = [comparison(p["cell"], device.hbm_bytes) for p in parts.values()]
    return rep


def report(setup: tpu_stages.Setup, topology: str, log=None, cells=("dge",)) -> dict:
    """Compiles each of `cells` for `setup` and returns the whole report (one JSON object)."""
    shared: dict = {}
    parts = {}
    for kind in cells:
        if log:
            log(f"-- {kind} cell")
        parts[kind] = cell_part(dataclasses.replace(setup, timing=kind), topology, log, shared)
    return assemble(setup, topology, parts)


def every_stage_fits(stages: list[dict], hbm: int) -> bool:
    """Every stage compiles and its own peak fits the device's usable HBM."""
    return all(s["compiles"] and s["peak_bytes_per_device"] <= hbm for s in stages)


def cell_fits(cell: dict, hbm: int) -> bool:
    """Every stage of the cell compiles and the cell's live bytes fit the usable HBM."""
    return cell["complete"] and cell["peak_bytes_per_device"] <= hbm


def largest(fits: Callable[[int], bool], step: int, start: int = 1, limit: int = 4096) -> int:
    """The largest multiple of `step` (>= start·step, <= limit) for which `fits` holds, 0 if
    none: doubling, then bisection (`fits` must be monotone: true up to some batch)."""
    lo, hi, m = 0, None, max(start, 1)
    if m > 1 and not fits(m * step):  # the start is already too big: search below it
        return largest(fits, step, 1, (m - 1) * step)
    while m * step <= limit:
        if not fits(m * step):
            hi = m
            break
        lo, m = m, m * 2
    if hi is None:  # everything up to the limit fit so far: bisect below the limit
        hi = limit // step + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step


INT4_ROWS = 8  # rows per device an int4 cache's batch is searched in (module docstring)


def batch_step(setup: tpu_stages.Setup) -> int:
    """The batches `max_batch` probes are multiples of this: the mesh's row multiple (rows
    split over it), times INT4_ROWS rows per device for an int4 cache (module docstring)."""
    step = sharding.row_multiple(setup.cfg, setup.mesh.shape)
    return step * INT4_ROWS if parse_kv_quant(setup.kv_quant).kind == "int4" else step


def max_batch(setup: tpu_stages.Setup, topology: str, log, limit: int, cells=("dge",)) -> dict:
    """The report at the largest batch that fits (module docstring), with the search's probes;
    each probe compiles one cell at one batch (prefills shared where the program is one)."""
    parts: dict[tuple[str, int], dict] = {}
    shared: dict = {}

    def part(kind: str, batch: int) -> dict:
        if (kind, batch) not in parts:
            log(f"-- {kind} cell, batch {batch}")
            at = dataclasses.replace(setup, batch=batch, timing=kind)
            parts[kind, batch] = cell_part(at, topology, log, shared)
        return parts[kind, batch]

    hbm, step = device_of(topology).hbm_bytes, batch_step(setup)
    found = {kind: largest(lambda b, kind=kind: cell_fits(part(kind, b)["cell"], hbm), step,
                           limit=limit) for kind in cells}  # fmt: skip
    out, batch = {}, found[cells[0]] or step
    if "dge" in cells:
        stages = largest(lambda b: every_stage_fits(part("dge", b)["stages"], hbm), step,
                         start=max(found["dge"] // step, 1), limit=limit)  # fmt: skip
        batch = found["dge"] or stages or step
        out = {"dge_cell": found["dge"], "every_stage": stages,
               "probes": _dge_probes(parts, hbm)}  # fmt: skip
    best = assemble(dataclasses.replace(setup, batch=batch), topology,
                    {kind: part(kind, batch) for kind in cells})  # fmt: skip
    for row in best["comparison"]:
        most = found[row["timing"]]
        row["largest_batch"] = most
        row["largest_batch_peak_bytes"] = (parts[row["timing"], most]["cell"]
                                           ["peak_bytes_per_device"] if most else None)  # fmt: skip
    probes = {kind: _cell_probes(parts, hbm, kind) for kind in cells}
    return best | {"max_batch": out | {"cells": found, "cell_probes": probes}}


def _cell_probes(parts: dict, hbm: int, kind: str) -> list[dict]:
    """One cell's probes: the batch, whether the cell fits, its peak, the stages that failed."""
    return [{"batch": b, "fits": cell_fits(p["cell"], hbm),
             "peak_bytes": p["cell"]["peak_bytes_per_device"],
             "failed": [s["name"] for s in p["stages"] if not s["compiles"]]}
            for (k, b), p in sorted(parts.items()) if k == kind]  # fmt: skip


def _dge_probes(parts: dict, hbm: int) -> list[dict]:
    """The DGE cell's probes, as the search reported them before the other cells came."""
    return [
        {"batch": b, "every_stage": every_stage_fits(p["stages"], hbm),
         "dge_cell": cell_fits(p["cell"], hbm),
         "dge_cell_peak_bytes": p["cell"]["peak_bytes_per_device"],
         "largest_stage_peak_bytes": max((s["peak_bytes_per_device"] or 0) for s in p["stages"]),
         "failed": [s["name"] for s in p["stages"] if not s["compiles"]]}
        for (kind, b), p in sorted(parts.items()) if kind == "dge"
    ]  # fmt: skip


def _gib(x) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def print_table(rep: dict) -> None:
    """The report as tables (per device): the DGE cell's stages, then each other cell's, then
    the cells side by side."""
    print(f"{rep['topology']}, mesh {rep['mesh']}, seq {rep['seq']}, batch {rep['batch']}; "
          f"usable HBM {_gib(rep['hbm_bytes_per_device'])} GiB per device, parameters "
          f"{_gib(rep['params_bytes_per_device'])} GiB per device")  # fmt: skip
    if "cell" in rep:
        print_stages(rep["stages"])
        print_prefill(rep["stages"])
        cell = rep["cell"]
        print(f"DGE cell (budget {cell['budget']}, k {cell['k']}): live peak "
              f"{_gib(cell['peak_bytes_per_device'])} GiB per device at {cell['peak_stage']}; "
              f"{cell['full_caches_alive_during_decode']} full caches of "
              f"{_gib(cell['full_cache_bytes_per_device'])} GiB alive during decode")  # fmt: skip
    for part in rep["timings"].values():
        print()
        print(_title(part["cell"]))
        print_stages(part["stages"], held=True)
    print_comparison(rep)
    if "max_batch" in rep and "dge_cell" in rep["max_batch"]:
        found = rep["max_batch"]
        print(f"max batch: DGE cell {found['dge_cell']}, every stage alone {found['every_stage']}")


def _title(cell: dict) -> str:
    """A lookahead or decode cell's table's first line."""
    head = (f"{cell['label']} cell, budget {cell['budget']}: live peak "
            f"{_gib(cell['peak_bytes_per_device'])} GiB per device at {cell['peak_stage']}")
    if cell["timing"] == "lookahead":
        first = cell["first_stage"]
        return (f"{head}; LAQ's first stage at {first['budget']} entries, window "
                f"{first['window']}, on a copy of {cell['lookahead_capacity']} slots; "
                f"compacted to {cell['compacted_capacity']}")  # fmt: skip
    loop = "-" if cell["loop_capacity"] is None else cell["loop_capacity"]
    return f"{head}; every {cell['interval']} steps back to the budget, loop cache slots {loop}"


def print_stages(stages: list[dict], held: bool = False) -> None:
    """One cell's stages, a line each; held: with the cell's live bytes and caches."""
    head = ("stage", "ok", "peak GiB", "arg/out/tmp/alias GiB", "TFLOP", "HBM GB",
            "(kernel operands) GB", "ideal GB", "x ideal", "roofline ms", "ideal ms", "pallas",
            "kv collectives")  # fmt: skip
    print(" | ".join(head + (("cell live GiB", "caches held / alive (full, compacted)")
                             if held else ())))  # fmt: skip
    for s in stages:
        if not s["compiles"]:
            print(f"{s['name']} | no | {s['error']}")
            continue
        parts = "/".join(_gib(s[k]) for k in ("argument_bytes", "output_bytes", "temp_bytes",
                                               "alias_bytes"))  # fmt: skip
        ratio = "-" if s["hbm_over_ideal"] is None else f"{s['hbm_over_ideal']:.1f}"
        row = [
            s["name"], "yes", _gib(s["peak_bytes_per_device"]), parts, f"{s['flops'] / 1e12:.3f}",
            f"{s['hbm_bytes_declared'] / 1e9:.2f}", f"{s['hbm_bytes'] / 1e9:.2f}",
            f"{s['ideal_hbm_bytes'] / 1e9:.2f}", ratio,
            f"{s['roofline_s'] * 1e3:.1f}", f"{s['ideal_s'] * 1e3:.1f}",
            "yes" if s["pallas_kernel"] else "no", "; ".join(s["kv_collectives"]) or "none",
        ]  # fmt: skip
        if held and "cell_caches_held" in s:
            h, a = s["cell_caches_held"], s["cell_caches_alive"]
            row += [_gib(s["cell_live_bytes_per_device"]),
                    f"{h['full']:g}, {h['compacted']:g} / {a['full']:g}, {a['compacted']:g}"]
        print(" | ".join(row))


def print_prefill(stages: list[dict]) -> None:
    """Where prefill's bytes go, and its causal model."""
    for s in stages:
        if s["name"] == "prefill" and s["compiles"]:
            print("prefill's HBM bytes by source: " + "; ".join(
                f"{e['source']} {e['bytes'] / 1e9:.2f} GB" for e in s["hbm_by_source"][:8]))
            print(f"prefill with the flash kernel's work scaled to a causal prompt's "
                  f"({s['kernel_causal_fraction']:.2f} of the tiles it declares; a model): "
                  f"HBM {s['hbm_bytes_causal'] / 1e9:.2f} GB, roofline "
                  f"{s['roofline_causal_s'] * 1e3:.1f} ms")  # fmt: skip


def print_comparison(rep: dict) -> None:
    """The cells side by side (per device; one-token forward steps after prefill)."""
    print()
    print("cell | forward steps on the full cache | on a compressed cache | full caches alive "
          "at peak (traced) | peak GiB per device (stage) | peak - parameters, in full caches "
          "| fits | largest batch (its peak GiB)")  # fmt: skip
    for row in rep["comparison"]:
        print(" | ".join([
            row["cell"], f"prefill + {row['steps_full']}", str(row["steps_compressed"]),
            _num(row["full_caches_alive_at_peak"], "g"), _peak(row),
            _num(row["peak_in_full_caches"], ".2f"), "yes" if row["fits"] else "no",
            "-" if row["largest_batch"] is None else
            f"{row['largest_batch']} ({_gib(row['largest_batch_peak_bytes'])})",
        ]))  # fmt: skip


def _num(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _peak(row: dict) -> str:
    if row["failed_stage"]:
        return f"- ({row['failed_stage']} does not compile)"
    return f"{_gib(row['peak_bytes_per_device'])} ({row['peak_stage']})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; a usage error is one line, `error: <what>; see ... --help` (exit 2)."""
    p = Parser(prog="python -m benchmarks.cost.tpu_aot", description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", required=True, help="a TPU topology, e.g. v5e:2x4, v6e:2x4")
    p.add_argument("--config", required=True, help="a Hugging Face config.json")
    p.add_argument("--seq", type=int, required=True, help="prompt length (tokens)")
    p.add_argument("--batch", type=int, default=1, help="rows (default 1)")
    p.add_argument("--mesh", default=None,
                   help="data=D,model=M over the topology's devices (default: model = all)")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=1024, help="SnapKV budget per kv head")
    p.add_argument("--k", type=int, default=2,
                   help="DGE's k (k - 1 draft steps) and the decode cell's interval, >= 2")
    p.add_argument("--lookahead", type=int, default=8, help="the lookahead cell's L (LAQ)")
    p.add_argument("--cells", default=",".join(CELLS),
                   help=f"the cells compiled, a comma list of {', '.join(CELLS)} (default all)")
    p.add_argument("--chunk", type=int, default=None,
                   help="prefill chunk (default: the TPU backend's, as generate picks it)")
    p.add_argument("--attention", choices=platform.ATTENTION, default="auto",
                   help="prefill attention (auto: the TPU's, the Pallas flash kernel)")
    p.add_argument("--kv_quant", type=check_kv_quant, default="none",
                   help="the cache's storage: none (bf16), int8 (bf16 scale per token) or "
                   "int4[-g<G>][-r<R>] (KIVI's, bf16 scales and zeros)")
    p.add_argument("--layer_loop", choices=("scan", "unrolled"), default=None,
                   help="decode_loop's layer grouping (default: the TPU backend's, scan)")
    p.add_argument("--max_batch", action="store_true", help="search the largest batch")
    p.add_argument("--max_batch_limit", type=int, default=1024)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verbose", action="store_true",
                   help="on an error, show its traceback instead of the one-line message")
    args = p.parse_args(argv)
    for flag in ("seq", "batch", "max_new_tokens", "budget", "max_batch_limit", "lookahead"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    cells = tuple(args.cells.split(","))
    if not set(cells) <= set(CELLS) or len(set(cells)) != len(cells):
        p.error(f"--cells takes distinct names among {', '.join(CELLS)}, got {args.cells!r}")
    args.cells = cells
    if args.chunk is not None and args.chunk < 1:
        p.error(f"--chunk must be >= 1, got {args.chunk}")
    if args.k < 2:
        p.error("--k must be >= 2 (a DGE cell drafts k - 1 tokens)")
    if args.chunk and args.seq % min(args.chunk, args.seq):
        p.error(f"--seq must be a multiple of --chunk ({args.chunk}), as prompts are padded")
    return args


def load_config(path: str) -> tuple:
    """`tpu_stages.load_config` of --config, its faults as one-line ValueErrors naming it."""
    file = pathlib.Path(path)
    example = "benchmarks/configs/llama3_1_8b.json"
    if file.is_dir():
        inside = file / "config.json"
        raise ValueError(f"--config {path} is a folder; pass a config.json file, e.g. "
                         f"{inside if inside.is_file() else example}")  # fmt: skip
    if not file.is_file():
        raise ValueError(f"--config {path}: no such file; pass a Hugging Face config.json, e.g. "
                         f"{example}")  # fmt: skip
    try:
        loaded = tpu_stages.load_config(file)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--config {path} is not a JSON file ({one_line(e)}); pass a Hugging "
                         f"Face config.json, e.g. {example}") from e  # fmt: skip
    except (ValueError, TypeError) as e:  # ConfigError: a config this library does not run
        raise ValueError(f"--config {path}: {one_line(e)}") from e
    return loaded


def mesh_of(spec: str | None, topology: str, devices) -> sharding.Mesh:
    """--mesh over the topology's devices (default: model over all of them); a mesh that does
    not fit them is a ValueError naming the device count."""
    n = len(devices)
    try:
        return sharding.parse_mesh(spec or f"data=1,model={n}", devices=devices)
    except sharding.MeshError as e:
        raise ValueError(f"--mesh {spec}: {e}; {topology} has {n} devices: give data=D,model=M "
                         f"with D x M dividing {n}") from e  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    """Checks the topology, the config and the mesh (cheap first), then compiles and prints."""
    chip_of(args.topology)
    family, cfg, eos = load_config(args.config)
    devices = topology_devices(args.topology)
    mesh = mesh_of(args.mesh, args.topology, devices)
    setup = tpu_stages.Setup(
        family, cfg, eos, mesh, batch=args.batch, seq=args.seq,
        max_new_tokens=args.max_new_tokens, budget=args.budget, k=args.k, chunk=args.chunk,
        attention=args.attention, layer_loop=args.layer_loop, lookahead=args.lookahead,
        kv_quant=args.kv_quant,
    )  # fmt: skip

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.max_batch:
        rep = max_batch(setup, args.topology, log, args.max_batch_limit, args.cells)
    else:
        rep = report(setup, args.topology, log, args.cells)
    if args.json:
        print(json.dumps(rep))
    else:
        print_table(rep)
    return rep


def main(argv: list[str] | None = None) -> dict:
    """Entry point: the report (printed, and returned). Every mistake in the command or fault
    of the environment ends in one stderr line, `error: <what>; <the fix>`, and SystemExit
    with status 2 (usage) or 1 (environment; a bug says so); --verbose re-raises instead."""
    args = parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        if args.verbose:
            raise
        print("error: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as e:
        if args.verbose:
            raise
        if isinstance(e, ValueError | TypeError):
            status, message = USAGE, one_line(e)
        elif isinstance(e, OSError | MemoryError | ImportError):
            status, message = ENVIRONMENT, one_line(e)
        else:
            status = ENVIRONMENT
            message = (f"unexpected {type(e).__name__}: {one_line(e)}; rerun with --verbose for "
                       "the traceback and report it")  # fmt: skip
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(status) from None


if __name__ == "__main__":
    main()
