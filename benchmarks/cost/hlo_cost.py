"""FLOPs and HBM bytes of a compiled XLA program, with every loop body counted once per trip.

XLA's ``cost_analysis()`` walks each computation once, so the body of a ``while`` loop (a
``lax.scan`` over layers or prefill chunks, a ``fori_loop``, the decode loop) counts as if it
ran one time. This module reads the compiled, partitioned program (``compiled.as_text()``: the
HLO of ONE device after SPMD partitioning and TPU layout assignment) and counts it again:

- **Loops.** Each ``while`` instruction's trip count is found by running its condition and
  body on the scalar integers of its loop state (the counter, its bound, its step), starting
  from the values the loop is entered with, resolved through copies, converts and fusions.
  A count that depends on a value known only at run time (the decode loop runs until every
  row is done; prefill's attention loop reads as many key blocks as have been written) is
  *unknown*: the caller gives a figure for such loops (``unknown_trips``), or they count once.
  Nested loops multiply. Every loop is reported with its count and where the count came from
  (``static`` or ``assumed``).
- **FLOPs.** ``dot``: 2 x output elements x contracted size; ``convolution`` (how TPU XLA
  writes most matmuls): 2 x output batch x output features x input features x the kernel
  taps that land on real input elements, counted per output position (TPU XLA writes a
  batched matmul as a convolution whose batch is a spatial dimension under a dilated window:
  one real tap per position, though the window has B); elementwise ops 1 per output element,
  reductions 1 per input element (XLA's own convention); transcendental ops are counted apart
  (``transcendentals``), as XLA does. Fusion bodies are walked for their FLOPs. On a loop-free
  program the count matches ``cost_analysis()``'s ``flops`` to 1% (tests/test_tpu_aot.py).
- **HBM bytes.** Counted at the boundary of every op that runs as one kernel (a fusion, or an
  op left unfused): the bytes of its operands and results that live in HBM. TPU layouts name a
  memory space: ``S(1)`` is on-chip VMEM, other ``S(n)`` are scalar/semaphore memories; an
  array with no ``S(n)`` (or ``S(0)``) is in HBM. A fusion parameter used only through
  ``dynamic-slice`` / ``slice`` / ``gather`` reads only those slices (a layer's weights out of
  the [L, ...] stack); a fusion whose root is a ``dynamic-update-slice`` of a parameter
  updates it in place and moves only the update; a nested fusion's result is read whole by
  the op that uses it. Asynchronous copies count their source when
  they start and their destination when they finish. Parameters, constants, tuples,
  ``get-tuple-element`` and ``bitcast`` move nothing.

Limits, said plainly: this is an *accounting of the program*, not a simulation of the chip.
Bytes are what the ops read and write at their boundaries, not what the memory system moves
(caches, re-reads inside a kernel, DMA granularity and padding to tiles are not modelled; tile
padding is visible in the layouts but sizes here are logical). A Pallas kernel
(``tpu_custom_call``) counts its operands and results in ``hbm_bytes`` (each read or written
once: a lower bound, as a kernel may read a block more than once), and the FLOPs,
transcendentals and bytes its author declared (``pl.CostEstimate``, carried in the custom
call's backend config) in ``flops``, ``transcendentals`` and ``kernel_declared_bytes``
(against ``kernel_boundary_bytes``, its operands and results), since its body is Mosaic code,
not HLO. ``conditional`` counts its most expensive branch. Loops whose trip count is unknown
count ``unknown_trips`` times (or once, reported as such). Collectives count their operands and
results as HBM traffic; the time on the interconnect is not estimated.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

from benchmarks.cost.hlo_text import (
    Array,
    Computation,
    Instr,
    Scalars,
    constant_value,
    invariant_scalars,
    parse_module,
    trip_count,
)

TRANSCENDENTAL = {
    "exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "sqrt",
    "rsqrt", "cbrt", "power", "sine", "cosine", "tan", "atan2", "erf",
}  # fmt: skip
ELEMENTWISE = TRANSCENDENTAL | {
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "compare",
    "select", "clamp", "and", "or", "xor", "not", "convert", "remainder", "floor", "ceil",
    "round-nearest-even", "round-nearest-afz", "sign", "is-finite", "shift-left",
    "shift-right-logical", "shift-right-arithmetic", "popcnt", "real", "imag",
    "reduce-precision", "stochastic-convert",
}  # fmt: skip
FREE = {
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "optimization-barrier", "iota",
    "add-dependency", "domain",
}  # fmt: skip
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter",
               "ragged-all-to-all", "collective-broadcast")  # fmt: skip
SLICING = {"dynamic-slice", "slice", "gather"}


@dataclasses.dataclass
class Loop:
    """A while loop as counted: nesting depth, trips, where the count came from, its op name."""

    depth: int
    trips: float
    source: str  # "static", "assumed" or "unknown (counted once)"
    op_name: str


@dataclasses.dataclass
class Cost:
    flops: float = 0.0
    transcendentals: float = 0.0
    hbm_bytes: float = 0.0
    kernel_boundary_bytes: float = 0.0  # Pallas kernels' operands and results (in hbm_bytes)
    kernel_declared_bytes: float = 0.0  # what those kernels declare they access
    kernel_declared_flops: float = 0.0  # and compute (in flops)
    collective_bytes: float = 0.0  # what cross-device ops deliver to this device (results)

    def add(self, other: Cost, times: float = 1.0) -> None:
        for field in dataclasses.fields(self):
            name = field.name
            setattr(self, name, getattr(self, name) + getattr(other, name) * times)

    @property
    def hbm_bytes_declared(self) -> float:
        """hbm_bytes with each Pallas kernel's declared bytes in place of its boundary's."""
        return self.hbm_bytes - self.kernel_boundary_bytes + self.kernel_declared_bytes


# ---------------------------------------------------------------------------------------------
# FLOPs and bytes per instruction
# ---------------------------------------------------------------------------------------------


def _operand_arrays(comp: Computation, name: str) -> list[Array]:
    ins = comp.instrs.get(name)
    return ins.arrays if ins is not None else []


def declared_cost(ins: Instr) -> tuple[float, float, float] | None:
    """(FLOPs, transcendentals, bytes) a Pallas kernel declares (its ``pl.CostEstimate``,
    in the custom call's backend config), or None for any other instruction."""
    if ins.opcode != "custom-call" or 'custom_call_target="tpu_custom_call"' not in ins.attrs:
        return None
    found = re.search(r'"cost_estimate":\{([^}]*)\}', ins.attrs)
    if not found:
        return None
    fields = dict(re.findall(r'"(\w+)":"?(\d+)"?', found.group(1)))
    return tuple(float(fields.get(k, 0)) for k in ("flops", "transcendentals", "bytes_accessed"))


def instr_flops(comp: Computation, ins: Instr) -> tuple[float, float]:
    """(FLOPs, transcendentals) of one instruction (not of the computations it calls)."""
    op = ins.opcode
    out = ins.arrays[0].elements if ins.arrays else 0
    if op == "dot":
        lhs = _operand_arrays(comp, ins.operands[0])
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        contract = [int(d) for d in dims.group(1).split(",") if d] if dims else []
        size = math.prod(lhs[0].dims[d] for d in contract) if lhs else 1
        return 2.0 * out * size, 0.0
    if op == "convolution":
        return convolution_flops(comp, ins), 0.0
    if op in TRANSCENDENTAL:
        return 0.0, float(out)
    if op in ELEMENTWISE:
        return float(out), 0.0
    if op in ("reduce", "reduce-window", "all-reduce", "reduce-scatter"):
        inputs = ins.operands[: max(len(ins.operands) // 2, 1)]
        return float(sum(a.elements for o in inputs for a in _operand_arrays(comp, o))), 0.0
    return 0.0, 0.0


def _window(attrs: str) -> dict[str, list[str]]:
    """`window={size=9 stride=8 lhs_dilate=9}` -> {"size": ["9"], "stride": ["8"], ...}."""
    found = re.search(r"window=\{([^}]*)\}", attrs)
    pairs = (item.split("=", 1) for item in (found.group(1).split() if found else []))
    return {key: value.split("x") for key, value in pairs}


def _taps(n_in: int, n_out: int, dim: int, window: dict[str, list[str]]) -> int:
    """Kernel taps along one spatial dimension that land on real input elements, summed over
    the output positions (padding and the holes of a dilated input contribute nothing)."""
    get = lambda key, default: window.get(key, [default] * (dim + 1))[dim]  # noqa: E731
    size, stride = int(get("size", "1")), int(get("stride", "1"))
    lhs_dilate, rhs_dilate = int(get("lhs_dilate", "1")), int(get("rhs_dilate", "1"))
    low = int(get("pad", "0_0").split("_")[0])
    if n_out * size > 10**6:  # a real image convolution: every tap counted
        return n_out * size
    span = (n_in - 1) * lhs_dilate + 1
    return sum(
        1
        for o in range(n_out)
        for t in range(size)
        if 0 <= (p := o * stride + t * rhs_dilate - low) < span and p % lhs_dilate == 0
    )


def convolution_flops(comp: Computation, ins: Instr) -> float:
    """2 x output batch x output features x input features per group x the kernel taps that
    touch real input elements. TPU XLA writes batched matmuls as convolutions whose batch is a
    spatial dimension under a dilated window (``window={size=9 stride=8 lhs_dilate=9}``: one
    real tap per output position), so taps are counted exactly, as XLA's cost analysis does."""
    lhs, rhs = (_operand_arrays(comp, o) for o in ins.operands[:2])
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if not lhs or not rhs or not ins.arrays or not labels:
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    out, kernel, window = ins.arrays[0].dims, rhs[0].dims, _window(ins.attrs)
    flops = 2.0 * out[out_l.index("b")] * out[out_l.index("f")] * kernel[rhs_l.index("i")]
    for dim, label in enumerate(c for c in out_l if c.isdigit()):
        n_in, n_out = lhs[0].dims[lhs_l.index(label)], out[out_l.index(label)]
        flops *= _taps(n_in, n_out, dim, window)
    return flops


def computation_flops(comps: dict[str, Computation], comp: Computation) -> tuple[float, float]:
    """(FLOPs, transcendentals) of a fused computation, nested fusions included."""
    flops = trans = 0.0
    for ins in comp.instrs.values():
        if ins.opcode == "fusion":
            f, t = computation_flops(comps, comps[ins.called("calls")])
        else:
            f, t = instr_flops(comp, ins)
        flops, trans = flops + f, trans + t
    return flops, trans


def _param_read(comps: dict[str, Computation], comp: Computation, name: str) -> float:
    """Bytes a fused computation reads of its value `name` (a parameter, or a bitcast of one):
    only the slices when every use slices it, nothing where it is updated in place."""
    full = comp.instrs[name].nbytes
    if name == comp.root:  # a nested computation's result: its consumer reads all of it
        return full
    total = 0.0
    for ins in comp.instrs.values():
        for j, operand in enumerate(ins.operands):
            if operand != name:
                continue
            if ins.opcode in SLICING and j == 0:
                total += ins.nbytes
            elif ins.opcode in ("dynamic-update-slice", "scatter") and j == 0:
                continue
            elif ins.opcode == "bitcast":
                total += _param_read(comps, comp, ins.name)
            elif ins.opcode == "fusion":
                inner = comps[ins.called("calls")]
                param = _parameter(inner, j)
                total += full if param is None else _param_read(comps, inner, param)
            else:
                return full
    return min(total, full)


def _parameter(comp: Computation, number: int) -> str | None:
    for ins in comp.instrs.values():
        if ins.opcode == "parameter" and constant_value(ins.args) == number:
            return ins.name
    return None


def _written(comps: dict[str, Computation], comp: Computation, name: str) -> float | None:
    """Bytes an output `name` of a fused computation writes when it updates a parameter in
    place (a dynamic-update-slice / scatter root): the update's; None when written whole."""
    ins = comp.instrs[name]
    if ins.opcode == "bitcast":
        return _written(comps, comp, ins.operands[0])
    if ins.opcode == "fusion":
        inner = comps[ins.called("calls")]
        return _written(comps, inner, inner.root)
    if ins.opcode == "dynamic-update-slice":
        return sum(a.nbytes for a in _operand_arrays(comp, ins.operands[1]))
    if ins.opcode == "scatter":
        return sum(a.nbytes for a in _operand_arrays(comp, ins.operands[-1]))
    return None


def _fusion_bytes(comps: dict[str, Computation], comp: Computation, ins: Instr) -> float:
    fused = comps[ins.called("calls")]
    total = 0.0
    for j, operand in enumerate(ins.operands):
        arrays = _operand_arrays(comp, operand)
        if arrays and all(a.hbm for a in arrays):
            param = _parameter(fused, j)
            total += _param_read(comps, fused, param) if param else sum(a.nbytes for a in arrays)
    root = fused.instrs[fused.root]
    outputs = root.operands if root.opcode == "tuple" else [root.name]
    for k, out in enumerate(outputs):
        array = ins.arrays[k] if k < len(ins.arrays) else None
        if array is None or not array.hbm:
            continue
        written = _written(comps, fused, out)
        total += array.nbytes if written is None else written
    return total


def boundary_bytes(comps: dict[str, Computation], comp: Computation, ins: Instr) -> float:
    """HBM bytes one kernel-level instruction reads and writes (module docstring)."""
    op = ins.opcode
    if op in FREE or op in ("while", "call", "conditional"):
        return 0.0
    if op == "fusion":
        return _fusion_bytes(comps, comp, ins)
    reads = [a for o in ins.operands for a in _operand_arrays(comp, o)]
    if op.endswith("-done"):
        return ins.hbm_bytes
    if op.endswith("-start"):
        if op in ("slice-start", "dynamic-slice-start") and len(ins.arrays) > 1:
            return ins.arrays[1].nbytes if reads and reads[0].hbm else 0.0
        return sum(a.nbytes for a in reads if a.hbm)
    if op in SLICING:
        return (ins.nbytes if reads and reads[0].hbm else 0.0) + ins.hbm_bytes
    if op in ("dynamic-update-slice", "scatter"):
        update = _operand_arrays(comp, ins.operands[1 if op == "dynamic-update-slice" else -1])
        return 2.0 * sum(a.nbytes for a in update) if ins.hbm_bytes else 0.0
    return sum(a.nbytes for a in reads if a.hbm) + ins.hbm_bytes


# ---------------------------------------------------------------------------------------------
# The whole program
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Collective:
    """A cross-device op of the program: opcode and the arrays it moves (operands, results)."""

    opcode: str
    operands: list[Array]
    results: list[Array]
    op_name: str


@dataclasses.dataclass
class Analysis:
    cost: Cost
    loops: list[Loop]
    pallas: bool
    collectives: list[Collective]
    # HBM bytes by source (`source_of`), loops times their trips, Pallas kernels at what they
    # declare: where `cost.hbm_bytes_declared` goes (the two sums agree)
    hbm_by_source: dict[str, float] = dataclasses.field(default_factory=dict)

    def top_sources(self, n: int = 10) -> list[tuple[str, float]]:
        """The n sources moving the most HBM bytes, largest first."""
        return sorted(self.hbm_by_source.items(), key=lambda kv: -kv[1])[:n]


def op_name(ins: Instr) -> str:
    found = re.search(r'op_name="([^"]*)"', ins.attrs)
    return found.group(1) if found else ""


def source_of(ins: Instr) -> str:
    """What an op is, for `Analysis.hbm_by_source`: the JAX primitive it came from (its op
    name's last part; a Pallas kernel's "pallas_call"; XLA's own ops, such as async copies,
    by opcode) and its first result's type, e.g. "dot_general -> bf16[8192,1792]"."""
    name = op_name(ins).rsplit("/", 1)[-1] or ins.opcode
    first = ins.arrays[0] if ins.arrays else None
    shape = "" if first is None else f" -> {first.dtype}[{','.join(map(str, first.dims))}]"
    return name + shape


def _walk(comps, comp, scalars, depth, assume, loops, ledger=None, scale=1.0) -> Cost:
    """The cost of `comp`, loops times their trips; `ledger` (a dict, or None) collects each
    op's HBM bytes by `source_of`, times `scale` (the trips of the loops around `comp`)."""
    cost = Cost()
    for ins in comp.instrs.values():
        op = ins.opcode
        if op == "while":
            trips, source = trip_count(comps, ins, scalars), "static"
            if trips is None:
                trips = assume(depth, op_name(ins)) if assume else None
                trips, source = (
                    (1, "unknown (counted once)") if trips is None else (trips, "assumed")
                )
            loops.append(Loop(depth, trips, source, op_name(ins)))
            body = _walk(comps, comps[ins.called("body")], invariant_scalars(comps, ins, scalars),
                         depth + 1, assume, loops, ledger, scale * trips)  # fmt: skip
            cond = comps[ins.called("condition")]
            cost.add(body, trips)
            cost.add(_walk(comps, cond, Scalars(comps, cond, {}), depth + 1, assume, loops,
                           ledger, scale * (trips + 1)), trips + 1)  # fmt: skip
        elif op == "call":
            callee = comps[ins.called("to_apply")]
            args = {i: scalars.value(o) for i, o in enumerate(ins.operands)}
            cost.add(_walk(comps, callee, Scalars(comps, callee, args), depth, assume, loops,
                           ledger, scale))  # fmt: skip
        elif op == "conditional":
            names = re.findall(
                r"%([\w.\-]+)",
                re.search(
                    r"(?:branch_computations=\{[^}]*\}|true_computation=.*)", ins.attrs
                ).group(0),
            )
            names = [n for n in names if n in comps]
            branches = [_walk(comps, comps[n], Scalars(comps, comps[n], {}), depth, assume, [])
                        for n in names]  # fmt: skip
            if not branches:
                continue
            costliest = max(range(len(branches)),
                            key=lambda b: (branches[b].flops, branches[b].hbm_bytes))  # fmt: skip
            cost.add(branches[costliest])
            if ledger is not None:  # walked again for its sources alone
                chosen = comps[names[costliest]]
                _walk(comps, chosen, Scalars(comps, chosen, {}), depth, assume, [], ledger, scale)
        else:
            declared = declared_cost(ins)
            moved = boundary_bytes(comps, comp, ins)
            counted = moved  # what the ledger books: a kernel's declared bytes in its place
            if op == "fusion":
                f, t = computation_flops(comps, comps[ins.called("calls")])
            elif declared is not None:
                f, t, counted = declared
                cost.kernel_declared_bytes += counted
                cost.kernel_declared_flops += f
                cost.kernel_boundary_bytes += moved
            else:
                f, t = instr_flops(comp, ins)
            cost.flops, cost.transcendentals = cost.flops + f, cost.transcendentals + t
            cost.hbm_bytes += moved
            if ledger is not None and counted:
                key = source_of(ins)
                ledger[key] = ledger.get(key, 0.0) + scale * counted
            if op.removesuffix("-start") in COLLECTIVES:  # an async pair counts at its start
                cost.collective_bytes += sum(r.nbytes for r in ins.arrays)
    return cost


def collectives(comps: dict[str, Computation]) -> list[Collective]:
    """Every cross-device op in the program (sync or the start of an async pair)."""
    out = []
    for comp in comps.values():
        for ins in comp.instrs.values():
            base = ins.opcode.removesuffix("-start")
            if base in COLLECTIVES:
                operands = [a for o in ins.operands for a in _operand_arrays(comp, o)]
                out.append(Collective(base, operands, ins.arrays, op_name(ins)))
    return out


def analyze(text: str, unknown_trips: float | Callable[[int, str], float | None] | None = None
            ) -> Analysis:  # fmt: skip
    """Counts a compiled program's text (`compiled.as_text()`).

    unknown_trips: trips of loops whose count is not static: a number, or a function of the
    loop's nesting depth (0 = in the entry computation) and its op name (None: count once).
    """
    comps, entry = parse_module(text)
    assume = unknown_trips if callable(unknown_trips) else (
        None if unknown_trips is None else (lambda depth, name: unknown_trips))  # fmt: skip
    loops: list[Loop] = []
    ledger: dict[str, float] = {}
    main = comps[entry]
    cost = _walk(comps, main, Scalars(comps, main, {}), 0, assume, loops, ledger)
    return Analysis(cost, loops, "tpu_custom_call" in text, collectives(comps), ledger)
