"""The text of a compiled XLA program, read: computations, instructions, shapes (with their
memory space), and the trip counts of while loops, found by running each loop's scalar state.

`benchmarks.cost.hlo_cost` counts FLOPs and bytes on what this module reads; its docstring says how.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2,
    "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8,
    "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5,
    "token": 0,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of an HLO shape: element type, dimensions, and whether it lives in HBM."""

    dtype: str
    dims: tuple[int, ...]
    hbm: bool

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> float:
        return self.elements * DTYPE_BYTES.get(self.dtype, 4)


@dataclasses.dataclass
class Instr:
    """One HLO instruction: result arrays (a tuple flattened), opcode, operand names, attributes."""

    name: str
    arrays: list[Array]
    opcode: str
    operands: list[str]
    attrs: str
    args: str  # the text inside the operand parentheses (a constant's value)

    def called(self, key: str) -> str | None:
        found = re.search(key + r"=%([\w.\-]+)", self.attrs)
        return found.group(1) if found else None

    @property
    def nbytes(self) -> float:
        return sum(a.nbytes for a in self.arrays)

    @property
    def hbm_bytes(self) -> float:
        return sum(a.nbytes for a in self.arrays if a.hbm)


@dataclasses.dataclass
class Computation:
    name: str
    instrs: dict[str, Instr]
    root: str


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*)$")


def parse_arrays(shape: str) -> list[Array]:
    """The arrays of an HLO shape string (a tuple's in order); memory space from the layout."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        if dtype not in DTYPE_BYTES:
            continue
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append(Array(dtype, tuple(int(d) for d in dims.split(",") if d),
                         space is None or space.group(1) == "0"))  # fmt: skip
    return out


def _split_balanced(text: str, start: int) -> int:
    """Index just past the group that opens at text[start] ('(' / '[' / '{')."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _parse_instr(name: str, rest: str) -> Instr:
    """`SHAPE opcode(operands), attributes` -> Instr."""
    rest = re.sub(r"/\*.*?\*/", "", rest)
    if rest.startswith("("):
        end = _split_balanced(rest, 0)
    else:  # up to the first space outside any brackets (layouts hold parentheses)
        end, depth = len(rest), 0
        for i, c in enumerate(rest):
            depth += c in "([{"
            depth -= c in ")]}"
            if c == " " and depth == 0:
                end = i
                break
    shape, tail = rest[:end], rest[end:].lstrip()
    paren = tail.find("(")
    opcode = tail[:paren].strip()
    close = _split_balanced(tail, paren)
    args = tail[paren + 1 : close - 1]
    operands = re.findall(r"%([\w.\-]+)", args)
    return Instr(name, parse_arrays(shape), opcode, operands, tail[close:], args)


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
    """{name: Computation} of an HLO module's text, and the entry computation's name."""
    comps: dict[str, Computation] = {}
    entry = ""
    current: Computation | None = None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header:
                current = Computation(header.group(1), {}, "")
                entry = header.group(1) if line.startswith("ENTRY") else entry
            continue
        if line.strip() == "}":
            comps[current.name] = current
            current = None
            continue
        found = _INSTR.match(line)
        if found:
            instr = _parse_instr(found.group(2), found.group(3))
            current.instrs[instr.name] = instr
            if found.group(1):
                current.root = instr.name
    return comps, entry


# ---------------------------------------------------------------------------------------------
# Trip counts: the loop's scalar state, run
# ---------------------------------------------------------------------------------------------

MAX_TRIPS = 1_000_000
_COMPARE = {
    "LT": lambda a, b: a < b, "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b,
    "GE": lambda a, b: a >= b, "EQ": lambda a, b: a == b, "NE": lambda a, b: a != b,
}  # fmt: skip
_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": lambda a, b: a + b, "subtract": lambda a, b: a - b, "multiply": lambda a, b: a * b,
    "divide": lambda a, b: int(a / b) if isinstance(a, int) and isinstance(b, int) else a / b,
    "remainder": lambda a, b: math.fmod(a, b), "maximum": max, "minimum": min,
    "and": lambda a, b: a & b if isinstance(a, int) else a and b,
    "or": lambda a, b: a | b if isinstance(a, int) else a or b,
}  # fmt: skip
_PASS = {"copy", "bitcast", "convert", "reshape", "broadcast", "copy-done", "opt-barrier"}


def constant_value(args: str) -> Any:
    text = args.strip()
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return None


class Scalars:
    """Values of the scalar instructions of a computation, given its parameters' values.

    params: parameter number -> value; a tuple parameter's value is a list (None: unknown).
    """

    def __init__(self, comps: dict[str, Computation], comp: Computation, params: dict):
        self.comps, self.comp, self.params, self.memo = comps, comp, params, {}

    def value(self, name: str) -> Any:
        if name not in self.memo:
            self.memo[name] = None  # cycles cannot happen in HLO; this only guards recursion
            self.memo[name] = self._eval(self.comp.instrs.get(name))
        return self.memo[name]

    def _eval(self, ins: Instr | None) -> Any:
        if ins is None:
            return None
        op, ops = ins.opcode, ins.operands
        if op == "parameter":
            return self.params.get(constant_value(ins.args))
        if op == "tuple":
            return [self.value(o) for o in ops]
        if op == "get-tuple-element":
            whole = self.value(ops[0])
            index = int(re.search(r"index=(\d+)", ins.attrs).group(1))
            return whole[index] if isinstance(whole, list) and index < len(whole) else None
        if any(a.dims for a in ins.arrays) or len(ins.arrays) != 1:
            return None  # only scalars are followed
        if op == "constant":
            return constant_value(ins.args)
        vals = [self.value(o) for o in ops]
        if op in _PASS:
            return vals[0] if vals else None
        if None in vals:
            return None
        if op == "compare":
            direction = re.search(r"direction=(\w+)", ins.attrs).group(1)
            return _COMPARE[direction](*vals)
        if op in _BINARY:
            return _BINARY[op](*vals)
        if op == "not":
            return not vals[0] if isinstance(vals[0], bool) else ~vals[0]
        if op == "negate":
            return -vals[0]
        if op == "select":
            return vals[1] if vals[0] else vals[2]
        if op == "clamp":
            return min(max(vals[1], vals[0]), vals[2])
        if op == "fusion":
            fused = self.comps[ins.called("calls")]
            return Scalars(self.comps, fused, dict(enumerate(vals))).value(fused.root)
        return None


def trip_count(comps: dict[str, Computation], whl: Instr, outer: Scalars) -> int | None:
    """How many times `whl`'s body runs, when its scalar loop state decides it statically."""
    state = outer.value(whl.operands[0])
    if not isinstance(state, list):
        return None
    cond, body = comps[whl.called("condition")], comps[whl.called("body")]
    for trips in range(MAX_TRIPS):
        going = Scalars(comps, cond, {0: state}).value(cond.root)
        if going is None:
            return None
        if not going:
            return trips
        run = Scalars(comps, body, {0: state})
        state = run.value(body.root)
        if not isinstance(state, list):
            return None
    return None


def invariant_scalars(comps: dict[str, Computation], whl: Instr, outer: Scalars) -> Scalars:
    """The body's scalars, knowing the loop state elements that no trip changes."""
    body = comps[whl.called("body")]
    init = outer.value(whl.operands[0])
    root = body.instrs[body.root]
    known: list = [None] * len(root.operands)
    if isinstance(init, list) and root.opcode == "tuple":
        for i, name in enumerate(root.operands):
            ins = body.instrs[name]
            index = re.search(r"index=(\d+)", ins.attrs)
            same = ins.opcode == "get-tuple-element" and index and int(index.group(1)) == i
            if same and i < len(init) and body.instrs[ins.operands[0]].opcode == "parameter":
                known[i] = init[i]
    return Scalars(comps, body, {0: known})
