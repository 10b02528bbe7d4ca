"""The machine's own limits, measured in the same run as the benchmark they calibrate.

- `matmul_gflops`: a large jitted square matmul, the best of several timed runs (FLOP/s
  counted as 2 n³). On CPU this is the f32 peak the prefill is judged against; on a GPU the
  bf16 one.
- `read_bandwidth`: bytes read per second by a jitted full reduction over a large array and by
  a matrix-vector product (what a decode step does to the weights and the cache); the faster
  of the two is the bandwidth.
- `GPU_PEAKS`: vendor peak dense bf16 TFLOP/s and HBM bandwidth of known GPUs, matched on
  JAX's `device_kind`; `peaks_for` falls back to flags, then to the measured figures.

Best-of-N, not the median: on a shared machine noise only ever adds time, so the fastest run
is the closest to what the hardware can do.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class GpuPeak:
    """Vendor peaks: dense bf16 tensor-core TFLOP/s (no sparsity) and memory bandwidth TB/s."""

    name: str
    bf16_tflops: float
    hbm_tb_s: float


# Matched in order against the lower-cased `device_kind` ("NVIDIA H100 80GB HBM3", ...);
# the first entry whose every keyword occurs wins, so the specific variants come first.
GPU_PEAKS: tuple[tuple[tuple[str, ...], GpuPeak], ...] = (
    (("h200",), GpuPeak("H200 SXM", 989.0, 4.8)),
    (("gh200",), GpuPeak("GH200", 989.0, 4.0)),
    (("h100", "pcie"), GpuPeak("H100 PCIe", 756.0, 2.0)),
    (("h100", "nvl"), GpuPeak("H100 NVL", 835.0, 3.9)),
    (("h100",), GpuPeak("H100 SXM", 989.0, 3.35)),
    (("a100", "40gb"), GpuPeak("A100 40GB", 312.0, 1.555)),
    (("a100", "pcie"), GpuPeak("A100 80GB PCIe", 312.0, 1.935)),
    (("a100",), GpuPeak("A100 80GB SXM", 312.0, 2.039)),
    (("l40s",), GpuPeak("L40S", 362.0, 0.864)),
    (("l4",), GpuPeak("L4", 121.0, 0.3)),
)


def known_gpu(device_kind: str) -> GpuPeak | None:
    """The table entry for a JAX `device_kind`, or None for an unknown device."""
    kind = device_kind.lower()
    for keywords, peak in GPU_PEAKS:
        if all(k in kind for k in keywords):
            return peak
    return None


def call_seconds(fn, *args, runs: int) -> list[float]:
    """Wall seconds of `runs` calls of fn(*args), each ended by block_until_ready, after one
    untimed call (it compiles, and the first run of a buffer size pays page faults)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def median_ms(fn, *args, runs: int) -> float:
    """Median wall ms of fn(*args) over `runs` calls, after one compiling call."""
    return 1e3 * statistics.median(call_seconds(fn, *args, runs=runs))


def _best_seconds(fn, *args, runs: int) -> float:
    """Fastest of `runs` timed calls of a compiled function."""
    return min(call_seconds(fn, *args, runs=runs))


def matmul_gflops(n: int = 4096, dtype=jnp.float32, runs: int = 5) -> dict:
    """GFLOP/s of a jitted [n, n] @ [n, n] matmul (2 n³ FLOPs), best of `runs`."""
    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(key_a, (n, n), dtype)
    b = jax.random.normal(key_b, (n, n), dtype)
    matmul = jax.jit(jnp.matmul).lower(a, b).compile()
    seconds = _best_seconds(matmul, a, b, runs=runs)
    return {
        "n": n,
        "dtype": jnp.dtype(dtype).name,
        "seconds": seconds,
        "gflops": 2 * n**3 / seconds / 1e9,
    }


def read_bandwidth(nbytes: int = 1 << 30, dtype=jnp.float32, runs: int = 5) -> dict:
    """GB/s read by a jitted reduction and by a matrix-vector product over `nbytes`, best of
    `runs`; `gb_s` is the faster of the two."""
    itemsize = jnp.dtype(dtype).itemsize
    cols = 4096
    rows = max(1, nbytes // (itemsize * cols))
    x = jnp.ones((rows, cols), dtype)
    v = jnp.ones((cols,), dtype)
    total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)).lower(x).compile()
    gemv = jax.jit(lambda x, v: x @ v).lower(x, v).compile()
    size = rows * cols * itemsize
    reduce_s = _best_seconds(total, x, runs=runs)
    gemv_s = _best_seconds(gemv, x, v, runs=runs)
    figures = {"reduce_gb_s": size / reduce_s / 1e9, "gemv_gb_s": size / gemv_s / 1e9}
    return {"bytes": size, "dtype": jnp.dtype(dtype).name, **figures, "gb_s": max(figures.values())}


def describe() -> dict:
    """Where the run happened: CPU model, cores, memory, device, library versions, load."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 0
    dev = jax.devices()[0]
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()),
    }


def measure(quick: bool = False, dtype=jnp.float32) -> dict:
    """Matmul peak and read bandwidth of the default device (small sizes when `quick`)."""
    on_gpu = jax.devices()[0].platform == "gpu"
    n = 1024 if quick else (8192 if on_gpu else 4096)
    nbytes = (64 << 20) if quick else ((4 << 30) if on_gpu else (1 << 30))
    runs = 3 if quick else 5
    mm = matmul_gflops(n, dtype, runs)
    bw = read_bandwidth(nbytes, dtype, runs)
    return {"matmul": mm, "bandwidth": bw, "gflops": mm["gflops"], "gb_s": bw["gb_s"]}


def peaks_for(
    device_kind: str, measured: dict, tflops: float | None = None, tb_s: float | None = None
) -> dict:
    """The peaks utilisation is reported against: flags, else the GPU table, else measured.

    Returns {"gflops", "gb_s", "source"}; the measured figures are always kept beside them.
    """
    if tflops or tb_s:
        known = known_gpu(device_kind)
        return {
            "gflops": (tflops * 1e3)
            if tflops
            else (known.bf16_tflops * 1e3 if known else measured["gflops"]),
            "gb_s": (tb_s * 1e3) if tb_s else (known.hbm_tb_s * 1e3 if known else measured["gb_s"]),
            "source": "flags",
        }
    known = known_gpu(device_kind)
    if known is not None:
        return {
            "gflops": known.bf16_tflops * 1e3,
            "gb_s": known.hbm_tb_s * 1e3,
            "source": f"table: {known.name}",
        }
    return {"gflops": measured["gflops"], "gb_s": measured["gb_s"], "source": "measured"}


if __name__ == "__main__":
    import json

    print(json.dumps({"machine": describe(), "limits": measure()}, indent=2))
