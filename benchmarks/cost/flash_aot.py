"""The Pallas prefill kernel compiled for a TPU without one: memory and counted cost.

    python -m benchmarks.cost.flash_aot                          # Llama-3.1-8B heads, 8k and 32k
    python -m benchmarks.cost.flash_aot --seq 8192 --topology v6e:2x4 --block_q 1024
    python -m benchmarks.cost.flash_aot --batch 24 --heads 4 --kv_heads 1 --seq 131072  # 1/8 heads

Deviceless ahead-of-time compilation (libtpu, `jax[tpu]`) on one chip of the topology of one
layer's prefill attention (`kernels/flash.py`): the whole prompt as one call (T = S), bf16,
32 query / 8 kv heads of 128 (Llama-3.1-8B) by default, with and without H2O's probs sum;
`written_slot_attention`, the XLA path it replaces, at the same shape; and each inside a
layer (x @ W_q -> attention -> @ W_o, hidden 4096), where XLA may fold the kernel's q
regrouping into the projections. Prints XLA's memory_analysis (argument / output / temporary
bytes on the chip) and cost_analysis (FLOPs, bytes: for the kernels these are the estimates
flash.py attaches, dense bounds that count no skipped tile; for the XLA path a loop body is
counted once). Nothing runs: compiled memory and counted work, not time on a chip.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from benchmarks.cost.tpu_aot import NoLibtpu, topology_devices
from dge_jax.kernels.attention import AttentionSpec, LayerCache, Tiles, written_slot_attention
from dge_jax.kernels.flash import flash_attention

HIDDEN, HEAD_DIM = 4096, 128  # Llama-3.1-8B
GIB = 2**30


def compile_one(device, fn, flags, seq: int, layer: bool):
    """fn(q, k, v, slot_pos, query_pos, num_slots) -> (out, sums) compiled for `device` at
    T = S = seq; layer: q made by a projection of x and the output projected back."""
    where = jax.sharding.SingleDeviceSharding(device)

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=where)

    b, hq, width = flags.batch, flags.heads, flags.heads * HEAD_DIM
    cache = (b, flags.kv_heads, seq, HEAD_DIM)
    rest = (spec(cache), spec(cache), spec(cache[:3], jnp.int32), spec((b, seq), jnp.int32),
            spec((), jnp.int32))  # fmt: skip
    if not layer:
        return jax.jit(fn).lower(spec((b, seq, hq, HEAD_DIM)), *rest).compile()

    def one_layer(x, wq, wo, *rest):
        out, sums = fn((x @ wq).reshape(b, seq, hq, HEAD_DIM), *rest)
        return out.reshape(b, seq, width) @ wo, sums

    shapes = (spec((b, seq, HIDDEN)), spec((HIDDEN, width)), spec((width, HIDDEN)))
    return jax.jit(one_layer).lower(*shapes, *rest).compile()


def report(name: str, compiled, seconds: float) -> None:
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    kernels = compiled.as_text().count('custom_call_target="tpu_custom_call"')
    gib = [x / GIB for x in (mem.argument_size_in_bytes, mem.output_size_in_bytes,
                             mem.temp_size_in_bytes, cost.get("bytes accessed", 0))]  # fmt: skip
    print(
        f"  {name:36s} compile {seconds:5.1f} s  args {gib[0]:6.3f}  out {gib[1]:6.3f}"
        f"  temp {gib[2]:6.3f} GiB  flops {cost.get('flops', 0) / 1e12:7.2f} T"
        f"  bytes {gib[3]:7.2f} GiB  pallas kernels {kernels}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5e:2x4")
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--block_q", type=int, default=512)
    parser.add_argument("--block_k", type=int, default=512)
    parser.add_argument("--xla_block", type=int, default=512, help="written_slot_attention's")
    flags = parser.parse_args()
    try:  # no libtpu, or a topology it cannot lay out: one line, as tpu_aot
        device = topology_devices(flags.topology)[0]
    except (NoLibtpu, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(
        f"{flags.topology} ({device.device_kind}), one chip, batch {flags.batch}, bf16, Hq "
        f"{flags.heads} Hkv {flags.kv_heads} D {HEAD_DIM}, blocks {flags.block_q} x "
        f"{flags.block_k}"
    )
    tiles = Tiles(block_q=flags.block_q, block_k=flags.block_k)

    def loose(fn, spec, *extra):
        """fn over one layer, from the loose (q, k, v, slot_pos, query_pos, num_slots)."""
        return lambda q, k, v, sp, qp, n: fn(q, qp, LayerCache.one(k, v, sp), n, spec, *extra)

    variants = {
        "flash": loose(flash_attention, AttentionSpec(), tiles),
        "flash + probs sum": loose(flash_attention, AttentionSpec(record_attn=True), tiles),
        "written_slot_attention (XLA)": loose(
            written_slot_attention, AttentionSpec(key_block=flags.xla_block)
        ),
    }
    for seq in flags.seq:
        print(f"T = S = {seq}")
        for layer in (False, True):
            for name, fn in variants.items():
                name = f"layer: {name}" if layer else name
                start = time.perf_counter()
                try:
                    compiled = compile_one(device, fn, flags, seq, layer)
                except Exception as error:  # report and go on: one failing variant is a result
                    print(f"  {name:36s} does not compile: {str(error).splitlines()[0][:300]}")
                    continue
                report(name, compiled, time.perf_counter() - start)


if __name__ == "__main__":
    main()
