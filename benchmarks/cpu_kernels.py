"""What XLA:CPU's own kernels cost at SmolLM2's shapes: the floors under the cpu suite's misses.

    python -m benchmarks.cpu_kernels            # SmolLM2-135M geometry, about 20 s
    python -m benchmarks.cpu_kernels --quick    # tiny shapes, seconds

Why: three targets of the cpu suite (prefill share of the matmul peak, end-to-end time
against torch, batch 4 decode at 3x batch 1) are set by kernels this library does not
write. This measures them alone, on random weights and inputs of the model's geometry (the
costs do not depend on the values):

1. Decode-step projections with M rows (batch M): every layer's seven matmuls, unrolled over
   per-layer weights as `decode` runs them on CPU, with XLA:CPU's default dot library
   (YNNPACK) and with its Eigen dots (a per-computation compiler option). Batch 4 at 3x the
   throughput of batch 1 needs M = 4 to cost at most 4/3 of M = 1.
2. Prefill attention of one layer, a 4,096-token prompt in 512-token chunks, as the chunked
   prefill runs it: `written_slot_attention` against the same blocks' two matmuls alone,
   and the matmuls plus the exp. What the library pays beyond "matmuls + exp" is the online
   softmax's other elementwise passes (mask, max, sum, rescale), which a fused attention
   kernel (torch's CPU flash attention) does not make over memory.

Medians of --runs calls after a compiling one; ratios come from the same run, and the
machine is noisy.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks import machine
from dge_jax.kernels.attention import (
    AttentionSpec,
    LayerCache,
    _group_queries,
    written_slot_attention,
)

# (layers, hidden, intermediate, query heads, kv heads, head dim, prompt tokens, chunk):
# SmolLM2-135M, and the prefill chunk `generate` uses.
FULL = (30, 576, 1536, 9, 3, 64, 4096, 512)
QUICK = (2, 64, 128, 4, 2, 16, 256, 64)
ROWS = (1, 2, 4, 8)

# XLA:CPU sends dots to YNNPACK; a library-fusion list holding only reductions leaves them
# to Eigen. A compiler option, so it applies to one computation and both run in one process.
EIGEN_DOTS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_kernels", description=__doc__)
    p.add_argument("--runs", type=int, default=5, help="timed calls per figure (median)")
    p.add_argument("--quick", action="store_true", help="tiny shapes")
    return p.parse_args(argv)


def layer_weights(shape, key: jax.Array) -> tuple[dict, ...]:
    """One dict of projection weights [in, out] per layer, separate buffers (as `decode`'s
    unrolled loop holds them)."""
    nl, d, f, hq, hkv, hd = shape[:6]
    dims = {"wq": (d, hq * hd), "wk": (d, hkv * hd), "wv": (d, hkv * hd), "wo": (hq * hd, d),
            "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}  # fmt: skip
    keys = iter(jax.random.split(key, nl * len(dims)))
    return tuple(
        {name: 0.02 * jax.random.normal(next(keys), dim) for name, dim in dims.items()}
        for _ in range(nl)
    )


def projections(layers: tuple[dict, ...], x: jax.Array) -> jax.Array:
    """x [M, D] through every layer's seven matmuls; each layer reads the last one's output,
    so XLA can neither hoist nor drop any of them."""
    for lp in layers:
        q, k, v = x @ lp["wq"], x @ lp["wk"], x @ lp["wv"]
        x = x + (q + jnp.tile(k + v, q.shape[-1] // k.shape[-1])) @ lp["wo"]
        x = x + (jax.nn.silu(x @ lp["w_gate"]) * (x @ lp["w_up"])) @ lp["w_down"]
    return x


def projection_figures(shape, runs: int) -> list[dict]:
    """ms of the decode-step projections per row count, YNNPACK and Eigen dots."""
    layers = layer_weights(shape, jax.random.PRNGKey(0))
    rows = []
    for m in ROWS:
        x = jax.random.normal(jax.random.PRNGKey(m), (m, shape[1]))
        ynnpack_ms = machine.median_ms(jax.jit(projections), layers, x, runs=runs)
        row = {"rows": m, "ynnpack_ms": ynnpack_ms}
        try:
            eigen = jax.jit(projections, compiler_options=EIGEN_DOTS).lower(layers, x).compile()
        except jax.errors.JaxRuntimeError as err:  # an XLA without the option: say so, go on
            row["eigen_ms"], row["eigen_error"] = None, str(err).splitlines()[0]
        else:
            row["eigen_ms"] = machine.median_ms(eigen, layers, x, runs=runs)
        rows.append(row)
    return rows


def _blocks_only(with_exp: bool, block: int):
    """The block loop of `written_slot_attention` keeping only its two matmuls (and the exp):
    chunk i's queries over key blocks 0..i, no mask, max, sum or rescale. Same arguments as
    `written_slot_attention`; the positions are unused (every block is taken whole)."""

    def attend(q, k, v, slot_pos, query_pos, num_slots):
        qg = _group_queries(q, k.shape[1]) * q.shape[-1] ** -0.5  # the library's row layout

        def body(j, acc):
            kb = jax.lax.dynamic_slice_in_dim(k, j * block, block, axis=2)
            vb = jax.lax.dynamic_slice_in_dim(v, j * block, block, axis=2)
            s = jnp.einsum("bkqd,bksd->bkqs", qg, kb)
            return acc + jnp.einsum("bkqs,bksd->bkqd", jnp.exp(s) if with_exp else s, vb)

        return jax.lax.fori_loop(0, (num_slots + block - 1) // block, body, jnp.zeros_like(qg))

    return attend


def attention_figures(shape, runs: int) -> dict:
    """ms of one layer's chunked prefill attention: the library's, and its matmuls (+ exp)."""
    _, _, _, hq, hkv, hd, prompt, chunk = shape
    n = prompt // chunk
    slots = prompt + chunk  # the prompt and an answer bucket, as `generate` sizes the cache
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(keys[0], (n, 1, chunk, hq, hd))
    k = jax.random.normal(keys[1], (1, hkv, slots, hd))
    v = jax.random.normal(keys[2], (1, hkv, slots, hd))

    def over_chunks(attend):
        def run(q, k, v):
            def per_chunk(total, i):
                written = (i + 1) * chunk
                query_pos = (i * chunk + jnp.arange(chunk, dtype=jnp.int32))[None]
                slot = jnp.arange(slots, dtype=jnp.int32)
                slot_pos = jnp.broadcast_to(jnp.where(slot < written, slot, -1), (1, hkv, slots))
                return total + jnp.sum(attend(q[i], k, v, slot_pos, query_pos, written)), None

            return jax.lax.scan(per_chunk, jnp.zeros(()), jnp.arange(n))[0]

        return jax.jit(run)

    library = over_chunks(
        lambda q, k, v, sp, qp, w: written_slot_attention(
            q, qp, LayerCache.one(k, v, sp), w, AttentionSpec(key_block=chunk)
        )[0]
    )
    dots, dots_exp = (over_chunks(_blocks_only(e, chunk)) for e in (False, True))
    # Chunk i computes (i + 1) full blocks: 2 matmuls x 2 FLOPs per multiply-add.
    flops = 4 * hq * chunk * hd * chunk * n * (n + 1) // 2
    return {
        "gflop": flops / 1e9,
        "library_ms": machine.median_ms(library, q, k, v, runs=runs),
        "matmuls_ms": machine.median_ms(dots, q, k, v, runs=runs),
        "matmuls_exp_ms": machine.median_ms(dots_exp, q, k, v, runs=runs),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    shape = QUICK if args.quick else FULL
    nl, d, f, hq, hkv, hd, prompt, chunk = shape
    peak = machine.matmul_gflops(n=512 if args.quick else 4096, runs=3)["gflops"]
    figures = {
        "shape": shape,
        "matmul_peak_gflops": peak,
        "projections": projection_figures(shape, args.runs),
        "attention": attention_figures(shape, args.runs),
    }
    print(f"# XLA:CPU kernels at {'tiny' if args.quick else 'SmolLM2-135M'} shapes ({nl} layers, "
          f"hidden {d}, intermediate {f}, {hq}/{hkv} heads x {hd}), {jax.default_backend()}, "
          f"median of {args.runs}; matmul peak {peak:.1f} GFLOP/s\n")  # fmt: skip
    print(f"Decode-step projections: {nl} layers x 7 matmuls, M rows, unrolled\n")
    print("| rows M | YNNPACK ms | M x t(1) / t(M) | Eigen ms | M x t(1) / t(M) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    proj = figures["projections"]
    for row in proj:
        m, ynn, eigen = row["rows"], row["ynnpack_ms"], row["eigen_ms"]
        ynn_ratio = m * proj[0]["ynnpack_ms"] / ynn
        if eigen is None:
            eigen_cells = f"– ({row['eigen_error']}) | –"
        else:
            eigen_cells = f"{eigen:.2f} | {m * proj[0]['eigen_ms'] / eigen:.2f}"
        print(f"| {m} | {ynn:.2f} | {ynn_ratio:.2f} | {eigen_cells} |")
    att = figures["attention"]
    print(f"\nPrefill attention, one layer: {prompt}-token prompt in {chunk}-token chunks, "
          f"chunk i over key blocks 0..i ({att['gflop']:.1f} GFLOP)\n")  # fmt: skip
    print("| computation | ms | GFLOP/s | % of matmul peak |")
    print("| --- | ---: | ---: | ---: |")
    for label, key in (("written_slot_attention (the library)", "library_ms"),
                       ("its two matmuls alone", "matmuls_ms"),
                       ("the matmuls and the exp", "matmuls_exp_ms")):  # fmt: skip
        gflops = att["gflop"] / (att[key] / 1e3)
        print(f"| {label} | {att[key]:.1f} | {gflops:.0f} | {100 * gflops / peak:.0f} |")
    print(f"\nOver the {nl} layers of one prompt: the library's attention takes "
          f"{nl * att['library_ms'] / 1e3:.2f} s; attention that paid only for its matmuls and "
          f"exp would take {nl * att['matmuls_exp_ms'] / 1e3:.2f} s, and only for its matmuls "
          f"{nl * att['matmuls_ms'] / 1e3:.2f} s.", flush=True)  # fmt: skip
    return figures


if __name__ == "__main__":
    main()
