"""The KV cache's storage options (`GenerationConfig.kv_quant`, the CLI's and runner's
--kv_quant): "none", "int8", or "int4" with KIVI's group and residual sizes."""

from __future__ import annotations

import re
from typing import NamedTuple

# The cache's storage choices (`GenerationConfig.kv_quant`, the CLI's and runner's
# --kv_quant); "int4" also takes options, "int4-g64-r256" (`parse_kv_quant`).
KV_QUANTS = ("none", "int8", "int4")
INT4_GROUP, INT4_RESIDUAL = 32, 128  # KIVI's defaults
_INT4 = re.compile(r"int4(?:-g(\d+))?(?:-r(\d+))?")


class KVQuant(NamedTuple):
    """A parsed kv_quant: kind ("none", "int8", "int4") and int4's group G and residual R."""

    kind: str
    group: int = INT4_GROUP
    residual: int = INT4_RESIDUAL

    @property
    def name(self) -> str:
        """The canonical string: "int4" for KIVI's defaults, else "int4-g{G}-r{R}"."""
        if self.kind != "int4" or (self.group, self.residual) == (INT4_GROUP, INT4_RESIDUAL):
            return self.kind
        return f"int4-g{self.group}-r{self.residual}"


def parse_kv_quant(kv_quant: str) -> KVQuant:
    """"none" | "int8" | "int4[-g<G>][-r<R>]" -> `KVQuant`; a ValueError naming the grammar
    otherwise (G >= 1, R a multiple of G; int4 defaults G 32, R 128)."""
    grammar = ("kv_quant must be 'none', 'int8' or 'int4[-g<G>][-r<R>]' (int4: G tokens per "
               f"key group, G channels per value group, R a multiple of G; default G {INT4_GROUP},"
               f" R {INT4_RESIDUAL}), got {kv_quant!r}")  # fmt: skip
    if kv_quant in ("none", "int8"):
        return KVQuant(kv_quant)
    match = _INT4.fullmatch(kv_quant) if isinstance(kv_quant, str) else None
    if match is None:
        raise ValueError(grammar)
    group = int(match.group(1) or INT4_GROUP)
    residual = int(match.group(2) or INT4_RESIDUAL)
    if group < 1 or residual < group or residual % group:
        raise ValueError(grammar)
    return KVQuant("int4", group, residual)


def check_kv_quant(kv_quant: str) -> str:
    """`kv_quant` if `parse_kv_quant` reads it, else its ValueError."""
    parse_kv_quant(kv_quant)
    return kv_quant
