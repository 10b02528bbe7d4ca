"""The Pallas attention kernels compiled for a TPU without one: memory and counted cost.

    python -m benchmarks.cost.flash_aot                          # Llama-3.1-8B heads, 8k and 32k
    python -m benchmarks.cost.flash_aot --seq 8192 --topology v6e:2x4 --block_q 1024
    python -m benchmarks.cost.flash_aot --batch 24 --heads 4 --kv_heads 1 --seq 131072  # 1/8 heads
    python -m benchmarks.cost.flash_aot --kv_quant int8 --seq 8192 32768  # an int8 cache
    python -m benchmarks.cost.flash_aot --kv_quant int4 --seq 32768       # KIVI's int4 cache
    python -m benchmarks.cost.flash_aot --kv_quant int4 --seq 32768 --chunk 512  # a chunk

Deviceless ahead-of-time compilation (libtpu, `jax[tpu]`) on one chip of the topology of one
layer's attention over a cache of S = --seq slots, bf16 activations, 32 query / 8 kv heads
of 128 (Llama-3.1-8B) by default, the cache stored bf16 or, with --kv_quant int8, as int8
values with bf16 scales, or with int4 as KIVI's packed int4 with bf16 scales, zeros and
residual block (`runtime.quantized`; the kernels unpack each block in VMEM): the prefill
kernel (`kernels/flash.py`; `kernels/flash_int4.py` for int4) over the whole prompt as one
call (T = S), with and without H2O's probs sum (int4: `kernels/flash_int4_sums.py` beside it),
and `written_slot_attention`, the XLA path it replaces; one decode step (T = 1) over the full
cache in the decode kernel (`kernels/flash_decode.py`; `kernels/flash_decode_int4.py`) and
in `cached_attention`, the XLA path it replaces; and each inside a layer (x @ W_q ->
attention -> @ W_o, hidden 4096), where XLA may fold the kernel's q regrouping into the
projections.

Prints XLA's memory_analysis (argument / output / temporary bytes on the chip; "cache" is the
arguments' k and v as stored), its cost_analysis (FLOPs, bytes: for the kernels these are the
estimates they attach, dense bounds that count no skipped tile, plus XLA's count of the ops
around them; for the XLA paths a loop body is counted once), and "kernel": the bytes the
Pallas kernels declare (`benchmarks.cost.hlo_cost`'s ``kernel_declared_bytes``: the prefill
kernel one layer's k and v per query tile, the decode kernel one layer's k and v, an int8
cache's scales included). Nothing runs: compiled memory and counted work, not time on a
chip.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

from benchmarks.cost import hlo_cost
from benchmarks.cost.tpu_aot import NoLibtpu, topology_devices
from dge_jax.kernels.attention import (
    AttentionSpec,
    LayerCache,
    ScoreSpec,
    Tiles,
    cached_attention,
    written_slot_attention,
)
from dge_jax.kernels.flash import flash_attention
from dge_jax.kernels.flash_decode import decode_attention
from dge_jax.kernels.flash_decode_int4 import int4_decode_attention
from dge_jax.kernels.flash_int4 import int4_flash_attention
from dge_jax.runtime.quantized import Int8Entries, KVQuant, quantize_int4_entries

HIDDEN, HEAD_DIM = 4096, 128  # Llama-3.1-8B
MIB = 2**20


def cache_specs(flags, seq: int, spec) -> tuple:
    """k and v [B, Hkv, S, D] as stored: bf16, int8 values with bf16 scales [.., S, 1], or
    KIVI's int4 entries (groups of 32, residual block 128) with every slot written."""
    cache = (flags.batch, flags.kv_heads, seq, HEAD_DIM)
    if flags.kv_quant == "int8":
        one = Int8Entries(spec(cache, jnp.int8), spec((*cache[:3], 1)))
    elif flags.kv_quant == "int4":
        return tuple(jax.tree.map(lambda x: spec(x.shape, x.dtype), jax.eval_shape(
            functools.partial(quantize_int4_entries, index=seq, like=KVQuant("int4", 32, 128),
                              keys=keys), jax.ShapeDtypeStruct(cache, jnp.bfloat16)))
            for keys in (True, False))  # fmt: skip
    else:
        one = spec(cache)
    return one, one


def compile_one(device, fn, flags, seq: int, t: int, layer: bool):
    """fn(q, k, v, slot_pos, query_pos, num_slots) -> (out, sums) compiled for `device` at
    T = t queries over S = seq slots; layer: q made by a projection of x and the output
    projected back."""
    where = jax.sharding.SingleDeviceSharding(device)

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=where)

    b, hq, width = flags.batch, flags.heads, flags.heads * HEAD_DIM
    rest = (*cache_specs(flags, seq, spec), spec((b, flags.kv_heads, seq), jnp.int32),
            spec((b, t), jnp.int32), spec((), jnp.int32))  # fmt: skip
    if not layer:
        return jax.jit(fn).lower(spec((b, t, hq, HEAD_DIM)), *rest).compile()

    def one_layer(x, wq, wo, *rest):
        out, sums = fn((x @ wq).reshape(b, t, hq, HEAD_DIM), *rest)
        return out.reshape(b, t, width) @ wo, sums

    shapes = (spec((b, t, HIDDEN)), spec((HIDDEN, width)), spec((width, HIDDEN)))
    return jax.jit(one_layer).lower(*shapes, *rest).compile()


def report(name: str, compiled, seconds: float, cache_bytes: int) -> None:
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    kernels = text.count('custom_call_target="tpu_custom_call"')
    declared = hlo_cost.analyze(text).cost.kernel_declared_bytes
    sizes = (cache_bytes, mem.argument_size_in_bytes, mem.output_size_in_bytes,
             mem.temp_size_in_bytes, cost.get("bytes accessed", 0), declared)  # fmt: skip
    mib = [x / MIB for x in sizes]
    print(
        f"  {name:42s} compile {seconds:5.1f} s  cache {mib[0]:7.1f}  args {mib[1]:7.1f}  out"
        f" {mib[2]:6.1f}  temp {mib[3]:7.1f} MiB  flops {cost.get('flops', 0) / 1e12:7.3f} T"
        f"  bytes {mib[4]:8.1f}  kernel {mib[5]:8.1f} MiB  pallas kernels {kernels}"
    )


def variants(flags) -> dict:
    """name -> (fn over the loose (q, k, v, slot_pos, query_pos, num_slots), prefill?)."""
    tiles = Tiles(block_q=flags.block_q, block_k=flags.block_k)

    def loose(fn, spec, *extra):
        """fn over one layer, from the loose (q, k, v, slot_pos, query_pos, num_slots)."""
        return lambda q, k, v, sp, qp, n: fn(q, qp, LayerCache.one(k, v, sp), n, spec, *extra)

    def decode(q, k, v, sp, qp, n):
        if flags.kv_quant == "int4":
            return int4_decode_attention(q, qp, LayerCache.one(k, v, sp), ScoreSpec()), None
        return decode_attention(q, qp, LayerCache.one(k, v, sp), AttentionSpec(), None,
                                tiles), None  # fmt: skip

    def flash(q, k, v, sp, qp, n, spec=None):
        spec = spec or AttentionSpec()
        if flags.kv_quant == "int4":
            return int4_flash_attention(q, qp, LayerCache.one(k, v, sp), n, spec, tiles)
        return flash_attention(q, qp, LayerCache.one(k, v, sp), n, spec, tiles)

    def probs_sum(q, k, v, sp, qp, n):
        return flash(q, k, v, sp, qp, n, AttentionSpec(record_attn=True))

    def xla_decode(q, k, v, sp, qp, n):
        return cached_attention(q, qp, LayerCache.one(k, v, sp), AttentionSpec())

    return {
        "flash": (flash, True),
        "flash + probs sum": (probs_sum, True),
        "written_slot_attention (XLA)": (
            loose(written_slot_attention, AttentionSpec(key_block=flags.xla_block)), True
        ),
        "decode step (kernel)": (decode, False),
        "decode step (XLA cached_attention)": (xla_decode, False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5e:2x4")
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument(
        "--kv_quant", choices=("none", "int8", "int4"), default="none",
        help="the cache's storage: bf16 ('none'), int8 values with bf16 scales, or KIVI's int4",
    )  # fmt: skip
    parser.add_argument("--block_q", type=int, default=512)
    parser.add_argument("--block_k", type=int, default=512)
    parser.add_argument("--xla_block", type=int, default=512, help="written_slot_attention's")
    parser.add_argument("--chunk", type=int, default=0,
                        help="prefill queries T (0: the whole prompt, T = S; generate's "
                             "chunks: 512, the last ones of the prompt)")  # fmt: skip
    flags = parser.parse_args()
    try:  # no libtpu, or a topology it cannot lay out: one line, as tpu_aot
        device = topology_devices(flags.topology)[0]
    except (NoLibtpu, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(
        f"{flags.topology} ({device.device_kind}), one chip, batch {flags.batch}, bf16, Hq "
        f"{flags.heads} Hkv {flags.kv_heads} D {HEAD_DIM}, cache {flags.kv_quant}, blocks "
        f"{flags.block_q} x {flags.block_k}"
    )
    for seq in flags.seq:
        chunk = flags.chunk or seq
        print(f"S = {seq} (prefill T = {'S' if chunk == seq else chunk}, decode T = 1)")
        shapes = cache_specs(flags, seq, lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(
            shape, dtype))  # fmt: skip
        cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
        for layer in (False, True):
            for name, (fn, prefill) in variants(flags).items():
                name = f"layer: {name}" if layer else name
                start = time.perf_counter()
                try:
                    compiled = compile_one(device, fn, flags, seq, chunk if prefill else 1, layer)
                except Exception as error:  # report and go on: one failing variant is a result
                    print(f"  {name:42s} does not compile: {str(error).splitlines()[0][:300]}")
                    continue
                report(name, compiled, time.perf_counter() - start, cache_bytes)


if __name__ == "__main__":
    main()
