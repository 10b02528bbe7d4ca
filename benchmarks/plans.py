"""What each suite runs: the `Plan` of sizes per suite, and the methods, grid and targets.

`make_plan(suite, size)` gives the sizes of the CPU suite (scenario (a), the research grid,
scenario (b)) and of the GPU suite at "full", "quick" or "tiny" (tests) size.
"""

from __future__ import annotations

import dataclasses

import dge_jax
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import Timing
from dge_jax.rules.pyramidkv import PyramidKV
from dge_jax.rules.snapkv import SnapKV
from dge_jax.rules.streamingllm import StreamingLLM

SNAPKV = SnapKV.kvpress()  # window 64, kernel 5, avg-pool: selects what SnapKVPress selects
PREFILL, DGE2, DGE_W2 = Timing("prefill", 1), Timing("dge", 2), Timing("dge_w", 2)
# The grid's rules, each with its kvpress press (same window where there is one).
GRID_RULES = (
    ("snapkv", SNAPKV),
    ("pyramidkv", PyramidKV(window=64, kernel=5, pooling="avg")),
    ("streamingllm", StreamingLLM(sinks=4)),
)
GRID_TIMINGS = (("prefill", PREFILL), ("dge(2)", DGE2), ("dge_w(2)", DGE_W2))

TARGETS = {
    "prefill_peak_frac": 0.70,
    "e2e_vs_kvpress": 0.9,
    "e2e_vs_transformers": 0.9,
    "grid_speedup": 10.0,
    "batch_decode_ratio": 3.0,
    "fullkv_agreement": 0.95,
    "b_decode_speedup": 3.0,
    "b_cache_overhead": 0.10,
}

# Every row of the figure tables has these fields (None where a figure does not apply).
ROW_FIELDS = (
    "scenario", "system", "method", "prompt_tokens", "batch", "budget", "prefill_s",
    "prefill_tok_s", "ttft_s", "draft_s", "evict_s", "decode_s", "decode_steps", "decode_tok_s",
    "e2e_s", "peak_mem", "cache_bytes", "compile_s", "compilations",
)  # fmt: skip

# Scenario (a)'s methods, one `generate` call each (see `a_cells`).
A_METHODS = ("FullKV", "SnapKV prefill", "SnapKV dge(2)")


def a_cells(budget: int) -> list[Eviction | None]:
    return [None, Eviction(SNAPKV, budget, PREFILL), Eviction(SNAPKV, budget, DGE2)]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes of one suite. Configurations are (prompt tokens, batch)."""

    suite: str
    size: str  # "full", "quick" or "tiny" (tests)
    model: str = dge_jax.DEFAULT_MODEL  # scenario (a): embedded name or checkpoint folder
    a_configs: tuple[tuple[int, int], ...] = ()
    new_tokens: int = 64
    budget: int = 256
    headline: tuple[int, int] = (4096, 1)  # the ratios' configuration (grid prompt too)
    grid_budgets: tuple[int, ...] = (128, 256, 512)
    b_configs: tuple[tuple[int, int], ...] = ()
    b_target: tuple[int, int] = (8192, 4)
    b_budget: int = 512
    b_new_tokens: int = 64
    b_layers: int = 2
    b_hidden: int = 1024
    b_intermediate: int = 3584
    b_window: int = 32
    b_dtype: str = "float32"
    b_peers: bool = True
    b_prefill_memory: int | None = 4 << 30  # cap on a prefill chunk's attention (None: ed's)
    runs: int = 3  # timed runs of the short steps of (b) (best of)


def make_plan(suite: str, size: str) -> Plan:
    """The plan of `suite` ("cpu" | "gpu") at `size` ("full" | "quick" | "tiny")."""
    if suite == "cpu":
        if size == "full":
            return Plan(
                suite,
                size,
                a_configs=((2048, 1), (4096, 1), (8128, 1), (2048, 4), (4096, 4)),
                b_configs=((4096, 1), (8192, 1), (16384, 1), (8192, 4)),
            )
        if size == "quick":
            return Plan(
                suite,
                size,
                a_configs=((512, 1), (1024, 1), (512, 4)),
                new_tokens=16,
                budget=128,
                headline=(512, 1),
                grid_budgets=(96, 128, 192),
                b_configs=((1024, 1), (1024, 2)),
                b_target=(1024, 2),
                b_budget=64,
                b_new_tokens=18,
                b_hidden=256,
                b_intermediate=896,
                runs=2,
            )
        return Plan(
            suite,
            size,
            a_configs=((256, 1),),
            new_tokens=6,
            budget=96,
            headline=(256, 1),
            grid_budgets=(72, 96, 112),
            b_configs=((256, 2),),
            b_target=(256, 2),
            b_budget=48,
            b_new_tokens=6,
            b_hidden=64,
            b_intermediate=128,
            b_peers=False,
            runs=1,
        )
    if suite == "gpu":
        # Every size has the same shape: decode at batch 1, 8 and 32 (two lengths, so that
        # batch 32's full cache stays a few GiB), then one long batch-1 prompt for prefill at
        # length; each configuration under each attention backend (suites.gpu_attention).
        common = dict(b_dtype="bfloat16", b_peers=False, b_layers=32, b_prefill_memory=None)
        if size == "full":
            # One H200 (141 GB). The model has Llama-3.1-8B's geometry (hidden 4096, MLP
            # 14336, 32 layers, 32 / 8 heads x 128; vocab 1024, as (b)'s): 7.0 B parameters,
            # 14 GB in bf16, and 128 KiB of bf16 cache per token. Full caches: 8192 x 8 =
            # 8.6 GB; 4096 x 32 = 17 GB, the largest (five live copies would be 86 GB, with
            # the weights 100 GB); 32768 x 1 = 4.3 GB. Time, estimated (no H200 run yet):
            # machine limits ~20 s; per configuration ~6 compiles of 5-15 s on the xla pass,
            # the prefill's alone on the cudnn pass, plus the runs: prefill up to 7e14 FLOPs
            # (32k x 1: ~1.5 s at 500 TFLOP/s), decode 2 caches x 4 runs x 62 steps of 3-10
            # ms (14 GB of weights per step at ~4 TB/s); 4 configurations x 2 backends:
            # ~6-9 min in all, under the 10 minutes this plan was sized for.
            return Plan(
                suite,
                size,
                b_configs=((8192, 1), (8192, 8), (4096, 32), (32768, 1)),
                b_target=(8192, 8),
                b_hidden=4096,
                b_intermediate=14336,
                **common,
            )
        if size == "quick":
            return Plan(
                suite,
                size,
                b_configs=((2048, 1), (2048, 8), (1024, 32), (8192, 1)),
                b_target=(2048, 8),
                **common,
            )
        common |= dict(b_layers=2, b_hidden=64, b_intermediate=128, b_new_tokens=6, runs=1)
        return Plan(
            suite,
            size,
            b_configs=((128, 1), (128, 8), (64, 32), (256, 1)),
            b_target=(128, 8),
            b_budget=48,
            **common,
        )
    raise ValueError(f"unknown suite {suite!r}")
