"""dge_jax side by side with transformers and kvpress: speed, memory, compile cost, agreement.

    bash benchmarks/setup_peers.sh                    # once: the peers' venv (kvpress 0.5.5)
    python -m benchmarks.run --suite cpu              # the full CPU suite (tens of minutes)
    python -m benchmarks.run --suite cpu --quick      # small sizes: every code path, minutes
    python -m benchmarks.run --suite gpu              # one NVIDIA GPU, JAX's CUDA build, < 8 min

Writes `benchmarks/results/<suite>[-quick].json` and a Markdown twin, and prints the tables.

What runs (issue 9), in one process, peers in a subprocess afterwards (never concurrently):

- machine limits: f32 matmul GFLOP/s and memory read bandwidth (`benchmarks.machine`);
- (a) the embedded SmolLM2-135M-Instruct on prompts of 2k / 4k / 8k tokens (8k = 8128, so
  that 64 new tokens fit its 8192 positions), batch 1 and 4: FullKV, SnapKV (kvpress preset:
  window 64, kernel 5, avg-pool) at budget 256 under `prefill` and `dge(2)`; per cell
  prefill tokens/s, time to first token, eviction overhead, decode tokens/s, end-to-end time,
  peak RSS, cache bytes, compile time and count; the same end-to-end figures for transformers'
  `generate` (FullKV) and kvpress's SnapKVPress at the same per-head budget, same weights,
  same token ids, exactly 64 new tokens each (EOS banned, as min_new_tokens = 64);
- the research grid: one prompt under 3 policies x 3 timings x 3 budgets with one
  `generate_grid` call, against kvpress running the same 27 cells one by one;
- agreement: FullKV tokens vs transformers, SnapKV-preset kept positions and tokens vs kvpress;
- (b) the KV-dominated random-weight model of `benchmarks.eviction_decode` (Llama-3-8B
  attention geometry on a 2-layer trunk) at 4k / 8k / 16k tokens: full vs compacted decode,
  cache bytes against the theoretical size of a compacted cache;
- the GPU suite: (b)'s model at 32 layers in bf16: prefill model-FLOP utilisation and decode
  bandwidth utilisation, full vs compacted, against the GPU's peaks (`machine.GPU_PEAKS`).

How dge_jax is timed. Scenario (a) calls the public API (`dge_jax.api.generate`, one call
per method) with its jitted steps (`decoding.prefill/draft/rewind/decode`, `api.keep_masks`,
`api.apply_eviction`, ...) wrapped for the duration of the call by timers that block on each
result (`StageTimer`), so one call gives both its wall time and where it went. Each call is
the first at its shapes, so it compiles: JAX reports every trace, lowering and XLA compile
(`jax.monitoring`), and every time is net of the compilation reported inside it, which is
itself reported (compile seconds and XLA compilations per call). The headline ratios use warm
repeats of the three calls at 4k tokens, timed whole; the grid runs cold, then warm. (b)
compiles every step ahead of time, as `benchmarks.eviction_decode` does, and reuses its
pieces. Best-of-N is used for the machine limits and (b)'s short steps, single runs for the
long ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import dge_jax
from benchmarks import eviction_decode as ed
from benchmarks import machine
from benchmarks.peers import RssSampler
from dge_jax import api
from dge_jax import decoding as gen
from dge_jax.config import ModelConfig
from dge_jax.evict import apply_keep, compact
from dge_jax.eviction import Eviction, capacity_for, select_for
from dge_jax.families import get_family
from dge_jax.policies import PyramidKV, SnapKV, StreamingLLM
from dge_jax.timing import Timing

ROOT = pathlib.Path(__file__).resolve().parent
PEERS_PYTHON = ROOT / ".peers" / "venv" / "bin" / "python"
SETUP_COMMAND = "bash benchmarks/setup_peers.sh"
MIB = 2**20

SNAPKV = SnapKV.kvpress()  # window 64, kernel 5, avg-pool: selects what SnapKVPress selects
PREFILL, DGE2, DGE_W2 = Timing("prefill", 1), Timing("dge", 2), Timing("dge_w", 2)
# The grid's policies, each with its kvpress press (same window where there is one).
GRID_POLICIES = (
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

COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
BACKEND_COMPILE = COMPILE_EVENTS[2]
_START = time.perf_counter()


def log(message: str) -> None:
    """Progress on stdout, with the minutes since the module was imported."""
    print(f"{(time.perf_counter() - _START) / 60:5.1f} min  {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# Plans: what each suite runs
# ---------------------------------------------------------------------------------------------


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
        common = dict(b_dtype="bfloat16", b_peers=False, b_layers=32, b_prefill_memory=None)
        if size == "full":
            return Plan(suite, size, b_configs=((8192, 4), (32768, 1)), **common)
        if size == "quick":
            return Plan(suite, size, b_configs=((2048, 2), (4096, 1)), b_target=(2048, 2), **common)
        common |= dict(b_layers=2, b_hidden=64, b_intermediate=128, b_new_tokens=6, runs=1)
        return Plan(suite, size, b_configs=((256, 2),), b_target=(256, 2), b_budget=48, **common)
    raise ValueError(f"unknown suite {suite!r}")


# ---------------------------------------------------------------------------------------------
# Instruments: compile events, memory, per-stage timers
# ---------------------------------------------------------------------------------------------


class CompileLog:
    """JAX's compile events (tracing, lowering, XLA compilation) as they happen."""

    _instance: CompileLog | None = None

    def __init__(self):
        self.events: list[tuple[str, float]] = []
        jax.monitoring.register_event_duration_secs_listener(self._record)

    @classmethod
    def get(cls) -> CompileLog:
        """The process's one log (a listener cannot be unregistered, so register it once)."""
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _record(self, event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS:
            self.events.append((event, duration))

    def mark(self) -> int:
        return len(self.events)

    def since(self, mark: int) -> tuple[float, int]:
        """(seconds spent compiling, XLA compilations) since `mark`."""
        events = self.events[mark:]
        return sum(d for _, d in events), sum(e == BACKEND_COMPILE for e, _ in events)


class Memory:
    """Peak memory of a region: process RSS on CPU; on GPU the device's peak bytes in use
    (`memory_stats`, a process-wide high-water mark that cannot be reset)."""

    def __init__(self):
        self.device = jax.devices()[0]
        self.on_gpu = self.device.platform == "gpu"
        self.rss = None if self.on_gpu else RssSampler()
        self.kind = "device peak bytes in use" if self.on_gpu else "process peak RSS"

    def mark(self) -> None:
        if self.rss is not None:
            self.rss.mark()

    def peak(self) -> int:
        if self.rss is not None:
            return self.rss.peak_since_mark()
        stats = self.device.memory_stats() or {}
        return int(stats.get("peak_bytes_in_use", 0))


@dataclasses.dataclass
class Call:
    """One measured API call: wall time, compile cost, the stage records, peak memory."""

    wall_s: float
    compile_s: float
    compilations: int
    records: list[dict]
    t0: float
    peak_mem: int


class StageTimer:
    """Wraps the jitted steps `dge_jax.api` calls, blocking on each result, to time them.

    Patched only inside `measure` (module attributes, restored afterwards): `decoding.prefill`,
    `draft` and `decode` (looked up as `gen.<name>` by the API at call time) and the API's own
    `keep_masks` and `apply_eviction`.
    """

    # (module, name): wrapped when the module has it (`rewind` came with per-row draft steps).
    TARGETS = (
        (gen, "prefill"),
        (gen, "draft"),
        (gen, "rewind"),
        (gen, "decode"),
        (gen, "stack_states"),
        (api, "keep_masks"),
        (api, "apply_eviction"),
    )

    def __init__(self, compiles: CompileLog, memory: Memory):
        self.compiles, self.memory = compiles, memory
        self.records: list[dict] = []
        self._call_mark = 0

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            info: dict = {}
            if name == "decode":  # decode(forward, cfg, params, state, ...): state is donated
                state = args[3]
                info = {
                    "start_step": np.asarray(state.step),  # [B] (a scalar before per-row k)
                    "cache_bytes": state.cache.nbytes(),
                    "rows": int(state.tokens.shape[0]),
                }
            mark = self.compiles.mark()
            self.memory.mark()
            start = time.perf_counter()
            out = jax.block_until_ready(fn(*args, **kwargs))
            end = time.perf_counter()
            compile_s, count = self.compiles.since(mark)
            if name == "prefill":
                info["cache_bytes"] = out.cache.nbytes()
            elif name == "apply_eviction":
                info["cache_bytes"] = out.nbytes()
                # What one capacity for all layers (the largest) would hold: k, v and pos all
                # scale with the slots.
                caps = out.capacities
                info["one_capacity_bytes"] = out.nbytes() * len(caps) * max(caps) // sum(caps)
            elif name == "decode":
                # The loop runs until the slowest row is done: its steps are the loop's.
                info["steps"] = int(np.max(np.asarray(out.step) - info.pop("start_step")))
            self.records.append(
                {
                    "stage": name,
                    "wall_s": end - start,
                    "compile_s": compile_s,
                    "compilations": count,
                    "peak_mem": self.memory.peak(),
                    "t_end": end,
                    # compile seconds of the whole call so far (for a time to first token
                    # net of compilation)
                    "compile_at_end": self.compiles.since(self._call_mark)[0],
                    **info,
                }
            )
            return out

        return timed

    def measure(self, fn: Callable[[], object]) -> tuple[object, Call]:
        """Runs fn() with the steps wrapped; returns its result and the `Call`."""
        originals = [
            (mod, name, getattr(mod, name)) for mod, name in self.TARGETS if hasattr(mod, name)
        ]
        self.records = []
        mark = self._call_mark = self.compiles.mark()
        self.memory.mark()
        start = time.perf_counter()
        try:
            for mod, name, fn_orig in originals:
                setattr(mod, name, self._wrap(name, fn_orig))
            out = fn()
        finally:
            for mod, name, fn_orig in originals:
                setattr(mod, name, fn_orig)
        wall = time.perf_counter() - start
        compile_s, count = self.compiles.since(mark)
        peak = max([self.memory.peak()] + [r["peak_mem"] for r in self.records])
        return out, Call(wall, compile_s, count, list(self.records), start, peak)


# ---------------------------------------------------------------------------------------------
# Work accounting: FLOPs of a prefill, bytes of a decode step
# ---------------------------------------------------------------------------------------------


def linear_params(cfg: ModelConfig) -> int:
    """Weights of one token's linear layers (q, k, v, o, gate, up, down) over all layers."""
    d, hd = cfg.hidden_size, cfg.head_dim
    attn = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + cfg.num_heads * hd * d
    return cfg.num_layers * (attn + 3 * d * cfg.intermediate_size)


def prefill_flops(cfg: ModelConfig, tokens: int, rows: int = 1) -> float:
    """Model FLOPs of prefilling `rows` prompts of `tokens` tokens: linear layers (2 per
    weight per token), causal attention (q·k and p·v over the t + 1 visible keys of query t),
    and the LM head on the last token, which is all a prefill computes logits for."""
    linear = 2 * linear_params(cfg) * tokens
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    head = 2 * cfg.hidden_size * cfg.vocab_size
    return rows * (linear + attention + head)


def tree_bytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------

PROMPT_TASKS = ("passkey", "niah_multikey", "vt_chain", "essay_qa")


def make_prompts(tokenizer, length: int, count: int, seed: int = 0) -> list[list[int]]:
    """`count` chat prompts of exactly `length` token ids: synthetic long-context tasks on the
    Paul Graham essays (`experiments.synthetic`), chat-templated, cut in the middle to size
    (LongBench's truncation), so every row of a batch has the same length (no padding)."""
    from experiments import protocol, synthetic

    sentences = synthetic.load_haystack()
    counts = synthetic.sentence_token_counts(tokenizer, sentences)
    prompts = []
    for i in range(count):
        task = PROMPT_TASKS[i % len(PROMPT_TASKS)]
        row = synthetic.make_row(task, i, tokenizer, length + 64, seed, sentences, counts)
        text = protocol.build_prompt(row, task)
        ids = tokenizer.encode_chat(text)
        if len(ids) < length:
            raise RuntimeError(f"prompt {i} has {len(ids)} tokens, fewer than {length}")
        prompts.append(protocol.truncate_middle(ids, length))
    return prompts


# ---------------------------------------------------------------------------------------------
# Scenario (a): the embedded model through the public API
# ---------------------------------------------------------------------------------------------

A_METHODS = ("FullKV", "SnapKV prefill", "SnapKV dge(2)")


def a_cells(budget: int) -> list[Eviction | None]:
    return [None, Eviction(SNAPKV, budget, PREFILL), Eviction(SNAPKV, budget, DGE2)]


def _net(record: dict) -> float:
    """A stage's wall time less the compilation JAX reported inside it."""
    return record["wall_s"] - record["compile_s"]


def call_row(call: Call, cfg: ModelConfig, rows: int, tokens: int, param_bytes: int,
             limits: dict) -> dict:  # fmt: skip
    """The figures of one single-cell `generate` call, every time net of the compilation JAX
    reported inside it, so that a cold call gives both its run time and its compile cost.

    End-to-end is the call's whole wall time (tokenization, prefill, draft, eviction, decode,
    host work) less compilation; time to first token runs from the call's start to the
    prefill's logits (the first token is their argmax).
    """

    def stage(*names: str) -> list[dict]:
        return [r for r in call.records if r["stage"] in names]

    (pre,) = stage("prefill")
    (dec,) = stage("decode")  # one cell: one decode group
    drafts, evicts = stage("draft"), stage("rewind", "keep_masks", "apply_eviction")
    evicted = stage("apply_eviction")
    decode_s = _net(dec)
    gflops = prefill_flops(cfg, tokens, rows) / _net(pre) / 1e9
    decode_gb_s = (param_bytes + dec["cache_bytes"]) * dec["steps"] / decode_s / 1e9
    return {
        "prefill_s": _net(pre),
        "prefill_tok_s": rows * tokens / _net(pre),
        "ttft_s": pre["t_end"] - call.t0 - pre["compile_at_end"],
        "draft_s": sum(map(_net, drafts)) if drafts else None,
        "evict_s": sum(map(_net, evicts)) if evicted else None,
        "decode_s": decode_s,
        "decode_steps": dec["steps"],
        "decode_tok_s": rows * dec["steps"] / decode_s,
        "e2e_s": call.wall_s - call.compile_s,
        "peak_mem": call.peak_mem,
        "cache_bytes": evicted[0]["cache_bytes"] if evicted else dec["cache_bytes"],
        "cache_bytes_full": pre["cache_bytes"],
        "prefill_gflops": gflops,
        "prefill_peak_frac": gflops / limits["gflops"],
        "decode_gb_s": decode_gb_s,
        "decode_bw_frac": decode_gb_s / limits["gb_s"],
        "compile_s": call.compile_s,
        "compilations": call.compilations,
        "host_s": call.wall_s - sum(r["wall_s"] for r in call.records),
    }


def run_embedded_config(model, prompts, tokens: int, batch: int, plan: Plan, timer: StageTimer,
                        limits: dict) -> tuple[list[dict], dict]:  # fmt: skip
    """Scenario (a) at one (prompt length, batch): per method, a cold `generate` call (the
    first at its shapes: its compile cost) and a warm one (every other figure).

    Returns (rows, the warm results per method)."""
    n = plan.new_tokens
    ids = prompts[:batch]
    param_bytes = tree_bytes(model.params)
    rows, results = [], {}
    for method, ev in zip(A_METHODS, a_cells(plan.budget), strict=True):

        def call(ev=ev):
            return api.generate(model, ids, eviction=ev, max_new_tokens=n, min_new_tokens=n)

        _, cold = timer.measure(call)
        result, warm = timer.measure(call)
        results[method] = result
        figures = call_row(warm, model.config, batch, tokens, param_bytes, limits)
        figures |= {
            "compile_s": cold.compile_s,
            "compilations": cold.compilations,
            "cold_wall_s": cold.wall_s,
            "warm_compilations": warm.compilations,
        }
        rows.append(
            {"scenario": "a", "system": "dge_jax", "method": method, "prompt_tokens": tokens,
             "batch": batch, "budget": ev.budget if ev else None, **figures}
        )  # fmt: skip
    return rows, results


def headline(plan: Plan, rows: list[dict]) -> dict:
    """End-to-end seconds (warm calls, compile excluded) at the headline configuration, one
    prompt, batch 1, and the ratios the targets read."""
    tokens, batch = plan.headline
    runs = [("dge_jax", m) for m in A_METHODS]
    runs += [("transformers", "FullKV"), ("kvpress", "SnapKVPress prefill")]
    e2e = {}
    for system, method in runs:
        r = _find(rows, scenario="a", system=system, method=method, prompt_tokens=tokens,
                  batch=batch)  # fmt: skip
        e2e[f"{system} {method}"] = r["e2e_s"] if r else None

    def ratio(a: str, b: str) -> float | None:
        return e2e[a] / e2e[b] if e2e[a] and e2e[b] else None

    return {
        "prompt_tokens": tokens,
        "batch": batch,
        "e2e_s": e2e,
        "ratios": {
            "dge(2) / kvpress SnapKV": ratio("dge_jax SnapKV dge(2)",
                                             "kvpress SnapKVPress prefill"),
            "dge(2) / transformers FullKV": ratio("dge_jax SnapKV dge(2)", "transformers FullKV"),
            "SnapKV prefill / kvpress SnapKV": ratio("dge_jax SnapKV prefill",
                                                     "kvpress SnapKVPress prefill"),
            "FullKV / transformers FullKV": ratio("dge_jax FullKV", "transformers FullKV"),
        },
    }  # fmt: skip


def run_grid(model, prompt: list[int], plan: Plan, timer: StageTimer) -> dict:
    """The research loop: 3 policies x 3 timings x 3 budgets on one prompt in one
    `generate_grid` call (one prefill, one draft, cells of one cache shape, its capacities
    per layer, decoded as one batch), cold then warm."""
    n = plan.new_tokens
    cells = [
        Eviction(policy, budget, timing)
        for _, policy in GRID_POLICIES
        for _, timing in GRID_TIMINGS
        for budget in plan.grid_budgets
    ]

    def call():
        return api.generate_grid(model, [prompt], cells, max_new_tokens=n, min_new_tokens=n)

    _, cold = timer.measure(call)
    _, warm = timer.measure(call)

    def total(*stages: str) -> float:
        return sum(r["wall_s"] for r in warm.records if r["stage"] in stages)

    def evicted(key: str) -> int:
        """Sum of `key` over the evicted caches (one record per cell)."""
        return sum(r.get(key, 0) for r in warm.records if r["stage"] == "apply_eviction")

    return {
        "cells": len(cells),
        "prompt_tokens": len(prompt),
        "new_tokens": n,
        "warm_wall_s": warm.wall_s,
        "cold_wall_s": cold.wall_s,
        "compile_s": cold.compile_s,
        "compilations": cold.compilations,
        "warm_compilations": warm.compilations,
        "prefill_s": total("prefill"),
        "draft_s": total("draft"),
        "evict_s": total("rewind", "keep_masks", "apply_eviction"),
        "decode_s": total("decode"),
        "decode_groups": sum(r["stage"] == "decode" for r in warm.records),
        "stack_s": total("stack_states"),
        "evicted_cache_bytes": evicted("cache_bytes"),
        "one_capacity_cache_bytes": evicted("one_capacity_bytes"),
        "host_s": warm.wall_s - sum(r["wall_s"] for r in warm.records),
        "jit_cache": jit_cache_sizes(),
    }


def prefill_profile(model, tokens: int, new_tokens: int, chunk: int = api.DEFAULT_CHUNK) -> dict:
    """Where one prefill's time goes (batch 1, `tokens` tokens, as `generate` runs it).

    Times, each compiled ahead and on random data of the prefill's own shapes: the linear
    layers alone (q, k, v, o, gate, up, down, chunk by chunk over every layer) and the library's
    `written_slot_attention` alone (chunk i's queries over the i + 1 written key blocks, which
    is what the chunked prefill computes); the rest of the prefill is norms, RoPE, cache
    writes and the LM head. (XLA's cost analysis does not see inside the prefill's scans.)
    """
    from dge_jax.attention import written_slot_attention

    cfg, params = model.config, model.params
    t = api.bucket_length(tokens, chunk)
    c = min(chunk, t)
    capacity = t + api.bucket_length(new_tokens, chunk)
    n = t // c
    hq, hkv, hd, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (n, 1, c, d), jnp.float32)

    def linear_only(layers, x):
        def per_chunk(acc, xc):
            def per_layer(acc, lp):
                q, k, v = xc @ lp.wq, xc @ lp.wk, xc @ lp.wv
                mlp = (jax.nn.silu(xc @ lp.w_gate) * (xc @ lp.w_up)) @ lp.w_down
                return acc + jnp.sum(q @ lp.wo) + jnp.sum(mlp) + jnp.sum(k) + jnp.sum(v), None

            return jax.lax.scan(per_layer, acc, layers)[0], None

        return jax.lax.scan(per_chunk, jnp.zeros(()), x)[0]

    # One cache layer per model layer: a loop-invariant attention would be hoisted out of
    # the layer loop by XLA and computed once instead of L times.
    k = jax.random.normal(keys[1], (cfg.num_layers, 1, hkv, capacity, hd), jnp.float32)
    v = jax.random.normal(keys[2], (cfg.num_layers, 1, hkv, capacity, hd), jnp.float32)
    q = jax.random.normal(keys[3], (n, 1, c, hq, hd), jnp.float32)

    def attention_only(q, k, v):
        def per_chunk(acc, i):
            query_pos = (i * c + jnp.arange(c, dtype=jnp.int32))[None, :]
            written = jnp.arange(capacity, dtype=jnp.int32) < (i + 1) * c
            slot_pos = jnp.broadcast_to(
                jnp.where(written, jnp.arange(capacity, dtype=jnp.int32), -1), (1, hkv, capacity)
            )

            def per_layer(acc, kv):
                out, _ = written_slot_attention(
                    q[i], kv[0], kv[1], slot_pos, query_pos, (i + 1) * c, block=c
                )
                return acc + jnp.sum(out), None

            return jax.lax.scan(per_layer, acc, (k, v))[0], None

        return jax.lax.scan(per_chunk, jnp.zeros(()), jnp.arange(n))[0]

    def best(fn, *args):
        exe = jax.jit(fn).lower(*args).compile()
        return min(ed.timed(exe, *args)[0] for _ in range(2))

    linear_s = best(linear_only, params.layers, x)
    attention_s = best(attention_only, q, k, v)
    linear_flops = 2 * linear_params(cfg) * t
    done = 4.0 * cfg.num_layers * hq * hd * c * c * n * (n + 1) / 2
    return {
        "tokens": tokens,
        "bucket": t,
        "chunk": c,
        "capacity": capacity,
        "linear_s": linear_s,
        "linear_gflops": linear_flops / linear_s / 1e9,
        "attention_s": attention_s,
        # What the chunked attention performs (chunk i over (i + 1) * c slots) and the causal
        # part of it that the model needs.
        "attention_flops_done": done,
        "attention_flops_causal": 4.0 * cfg.num_layers * hq * hd * t * (t + 1) / 2,
        "attention_gflops_done": done / attention_s / 1e9,
    }


def jit_cache_sizes() -> dict[str, int]:
    """Compiled variants held by each of the library's jitted steps so far."""
    from dge_jax import eviction

    fns = {
        "prefill": gen.prefill,
        "draft": gen.draft,
        "decode": gen.decode,
        "select_for": select_for,
        "compact": eviction.compact,
    }
    return {name: fn._cache_size() for name, fn in fns.items()}


# ---------------------------------------------------------------------------------------------
# Scenario (b) and the GPU suite: the KV-dominated model, every step compiled ahead of time
# ---------------------------------------------------------------------------------------------


def kv_config(plan: Plan, tokens: int, batch: int, max_tokens: int | None = None):
    """`eviction_decode`'s model config and arguments for one (b) configuration."""
    args = ed.parse_args(
        [
            "--prompt_len",
            str(tokens),
            "--batch",
            str(batch),
            "--budget",
            str(plan.b_budget),
            "--new_tokens",
            str(plan.b_new_tokens),
            "--layers",
            str(plan.b_layers),
            "--hidden",
            str(plan.b_hidden),
            "--intermediate",
            str(plan.b_intermediate),
            "--window",
            str(plan.b_window),
        ]
    )
    if max_tokens is not None:  # one checkpoint for every length: positions only bound RoPE
        args = argparse.Namespace(**{**vars(args), "prompt_len": max_tokens})
    return args, ed.model_config(args)


def compiled(compiles: CompileLog, fn, *args, **statics) -> tuple[Callable, float, int]:
    """fn.lower(*args, **statics).compile(), with its compile seconds and XLA compile count."""
    mark = compiles.mark()
    exe = fn.lower(*args, **statics).compile()
    seconds, count = compiles.since(mark)
    return exe, seconds, count


def run_kv_config(
    plan: Plan, tokens: int, batch: int, compiles: CompileLog, memory: Memory, limits: dict
) -> tuple[list[dict], dict]:
    """One (b) configuration: prefill, draft (k=2), select + compact, decode full vs compacted.

    Returns (the two rows, extras: theoretical compacted size, kept counts, the prompt)."""
    from models.llama_like import init_params

    args, cfg = kv_config(plan, tokens, batch)
    dtype = jnp.dtype(plan.b_dtype)
    fwd = get_family("llama").forward
    n_new, runs = plan.b_new_tokens, plan.runs
    capacity = tokens + n_new
    chunk = ed.prefill_chunk(cfg, batch, tokens, capacity)
    if plan.b_prefill_memory:  # a shared CPU host: half of eviction_decode's 8 GiB per chunk
        per_query = batch * cfg.num_heads * capacity * 4 * ed.ATTN_COPIES
        while chunk > 1 and chunk * per_query > plan.b_prefill_memory:
            chunk //= 2
    policy, timing = SnapKV(window=plan.b_window), DGE2
    params = init_params(cfg, jax.random.PRNGKey(0), dtype)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, (batch, tokens))
    ids = jnp.asarray(prompt, jnp.int32)
    lengths = jnp.full((batch,), tokens, jnp.int32)
    key = jax.random.PRNGKey(0)
    compile_s, compilations = 0.0, 0

    def add(exe_info):
        nonlocal compile_s, compilations
        exe, s, c = exe_info
        compile_s, compilations = compile_s + s, compilations + c
        return exe

    memory.mark()
    prefill = add(
        compiled(
            compiles,
            gen.prefill,
            fwd,
            cfg,
            params,
            ids,
            lengths,
            capacity=capacity,
            chunk=chunk,
            obs_window=policy.obs_window,
        )
    )
    t_prefill, pre = ed.timed(prefill, params, ids, lengths)
    start_time = time.perf_counter()
    first = ed.GREEDY(pre.logits, key)
    start = jax.block_until_ready(
        gen.start_state(pre.cache, first, lengths, n_new, ed.EOS_IDS, key)
    )
    ttft = t_prefill + (time.perf_counter() - start_time)
    draft = add(
        compiled(
            compiles,
            gen.draft,
            fwd,
            cfg,
            params,
            start,
            sampler=ed.GREEDY,
            eos_ids=ed.EOS_IDS,
            num_steps=timing.draft_steps,
        )
    )
    t_draft, (state, drafts) = ed.timed(draft, params, start)
    budget, observe = jnp.asarray(plan.b_budget, jnp.int32), jnp.asarray(timing.observes_drafts)
    select_args = (state.cache, pre.obs, drafts, budget, observe)
    select = add(compiled(compiles, select_for, *select_args, policy=policy))
    t_select, keep = ed.timed(select, *select_args, runs=runs)
    remaining = n_new - int(np.min(np.asarray(state.step)))
    counts = np.asarray(jnp.sum(keep, axis=-1))
    small = capacity_for(counts, remaining)  # the API's rule: kept, rounded up, + new tokens
    shrink = add(
        compiled(
            compiles, jax.jit(lambda c, k: compact(apply_keep(c, k), small)), state.cache, keep
        )
    )
    t_compact, small_cache = ed.timed(shrink, state.cache, keep, runs=runs)
    param_bytes = tree_bytes(params)
    decode_rows = {}
    for name, st in (("full", state), ("compacted", dataclasses.replace(state, cache=small_cache))):
        decode = add(
            compiled(
                compiles, gen.decode, fwd, cfg, params, st, sampler=ed.GREEDY, eos_ids=ed.EOS_IDS
            )
        )
        ed.timed(decode, prepare=lambda st=st: (params, *ed.fresh(st)))  # warm up
        seconds, out = ed.timed(decode, runs=runs, prepare=lambda st=st: (params, *ed.fresh(st)))
        assert np.all(np.asarray(out.step) == n_new), out.step
        decode_rows[name] = (seconds, st.cache.nbytes())
    peak = memory.peak()
    # Theoretical compacted cache: per layer, row and kv head, `budget` kept entries plus one
    # slot per token still to come, each holding k and v (head_dim values) and a position.
    slot_bytes = 2 * cfg.head_dim * dtype.itemsize + 4
    theory = cfg.num_layers * batch * cfg.num_kv_heads * (plan.b_budget + remaining) * slot_bytes
    flops = prefill_flops(cfg, tokens, batch)
    common = {
        "scenario": "b",
        "system": "dge_jax",
        "prompt_tokens": tokens,
        "batch": batch,
        "prefill_s": t_prefill,
        "prefill_tok_s": batch * tokens / t_prefill,
        "ttft_s": ttft,
        "peak_mem": peak,
        "cache_bytes_full": state.cache.nbytes(),
        "prefill_gflops": flops / t_prefill / 1e9,
        "prefill_peak_frac": flops / t_prefill / 1e9 / limits["gflops"],
        "compile_s": compile_s,
        "compilations": compilations,
        "prefill_chunk": chunk,
        "dtype": dtype.name,
        "layers": cfg.num_layers,
    }
    rows = []
    for name, (seconds, nbytes) in decode_rows.items():
        gb_s = (param_bytes + nbytes) * remaining / seconds / 1e9
        compacted = name == "compacted"
        rows.append(
            common
            | {
                "method": "SnapKV dge(2) compacted" if compacted else "FullKV",
                "budget": plan.b_budget if compacted else None,
                "draft_s": t_draft,
                "evict_s": t_select + t_compact if compacted else None,
                "decode_s": seconds,
                "decode_steps": remaining,
                "decode_tok_s": batch * remaining / seconds,
                "decode_ms_per_step": seconds / remaining * 1e3,
                "e2e_s": ttft + t_draft + (t_select + t_compact if compacted else 0) + seconds,
                "cache_bytes": nbytes,
                "decode_gb_s": gb_s,
                "decode_bw_frac": gb_s / limits["gb_s"],
            }
        )
    extras = {
        "prompt_tokens": tokens,
        "batch": batch,
        "select_s": t_select,
        "compact_s": t_compact,
        "compacted_capacity": small,
        "kept_max": int(counts.max()),
        "theoretical_bytes": theory,
        "compacted_bytes": decode_rows["compacted"][1],
        "decode_speedup": decode_rows["full"][0] / decode_rows["compacted"][0],
        "prompt": prompt[:1].tolist(),
    }
    return rows, extras


def write_hf_folder(cfg: ModelConfig, params, folder: pathlib.Path) -> None:
    """A Hugging Face Llama folder (config.json + model.safetensors) holding `params`: the
    reverse of `models.llama_like.HF_KEY_TABLE`, so the peers run the very same weights."""
    from safetensors.numpy import save_file

    from models.llama_like import HF_KEY_TABLE

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for pattern, field, transform in HF_KEY_TABLE:
        holder, _, name = field.rpartition(".")
        value = getattr(params.layers if holder == "layers" else params, name)
        if value is None:
            continue
        value = np.asarray(value, np.float32)
        template = pattern.replace(r"\.", ".").replace(r"(\d+)", "{}")
        stacked = holder == "layers"
        for i, item in enumerate(value if stacked else [value]):
            item = item.T if transform == "transpose" else item
            tensors[template.format(i) if stacked else template] = np.ascontiguousarray(item)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope.theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))


# ---------------------------------------------------------------------------------------------
# Peers: one subprocess in the peers' venv, after every dge_jax measurement
# ---------------------------------------------------------------------------------------------


class Peers:
    """The peers' worker: `benchmarks/peers.py --serve` in the peers' venv, one for the run.

    `run(jobs)` sends jobs as JSON lines and waits for each result, so a configuration's peer
    runs follow its dge_jax runs within minutes, under the same machine load, and the two
    processes never compute at the same time.
    """

    def __init__(self, python: pathlib.Path = PEERS_PYTHON):
        cmd = [str(python), str(ROOT / "peers.py"), "--serve"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)  # fmt: skip
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"{' '.join(cmd)} exited with {self.proc.wait()}")
        self.versions = json.loads(hello)["versions"]
        self.results: dict[str, dict] = {}

    @classmethod
    def start(cls, use: bool) -> tuple[Peers | None, str]:
        """(the worker, "") or (None, why there is none)."""
        if not use:
            return None, "--no-peers"
        if not PEERS_PYTHON.exists():
            return None, f"{PEERS_PYTHON} is missing; run `{SETUP_COMMAND}`"
        return cls(), ""

    def run(self, jobs: list[dict]) -> None:
        for job in jobs:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the peers' worker died on job {job['id']}")
            self.results[job["id"]] = json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def peer_row(
    result: dict, scenario: str, method: str, tokens: int, batch: int, budget: int | None
) -> dict:
    rows = batch
    return {
        "scenario": scenario,
        "system": result["system"],
        "method": method,
        "prompt_tokens": tokens,
        "batch": batch,
        "budget": budget,
        "prefill_s": result["prefill_s"],
        "prefill_tok_s": rows * tokens / result["prefill_s"],
        "ttft_s": result["ttft_s"],
        "draft_s": None,
        "evict_s": result["evict_s"],
        "decode_s": result["decode_s"],
        "decode_steps": result["decode_steps"],
        "decode_tok_s": rows * result["decode_steps"] / result["decode_s"],
        "e2e_s": result["e2e_s"],
        "peak_mem": result["peak_rss"],
        "cache_bytes": result["cache_bytes"],
        "compile_s": None,
        "compilations": None,
    }


# ---------------------------------------------------------------------------------------------
# Agreement
# ---------------------------------------------------------------------------------------------


def first_divergence(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def fullkv_agreement(pairs: list[dict]) -> dict:
    """pairs: {"label", "ours", "theirs", "margins"}; identical fraction and divergences."""
    diverged = []
    for p in pairs:
        i = first_divergence(p["ours"], p["theirs"])
        if i is not None:
            margin = p["margins"][i] if i < len(p["margins"]) else None
            diverged.append(
                {
                    "prompt": p["label"],
                    "step": i,
                    "ours": p["ours"][i],
                    "transformers": p["theirs"][i],
                    "transformers_margin": margin,
                }
            )
    n = len(pairs)
    return {
        "prompts": n,
        "identical": n - len(diverged),
        "fraction": (n - len(diverged)) / n if n else None,
        "diverged": diverged,
    }


def kept_agreement(pairs: list[dict]) -> dict:
    """pairs: {"label", "ours_kept" [L][H][pos], "theirs_kept", "ours", "theirs" (tokens),
    "theirs_gap" [L][H] or None: kvpress's relative score gap at the budget boundary}.

    A differing head whose gap is tiny (~1e-6, float rounding) is a near-tie that summation
    order can flip; the details list each differing head with its gap."""
    heads = same_heads = same_prompts = same_tokens = 0
    details = []
    for p in pairs:
        ours, theirs = p["ours_kept"], p["theirs_kept"]
        diff = [
            (layer, h)
            for layer, (a, b) in enumerate(zip(ours, theirs, strict=True))
            for h, (x, y) in enumerate(zip(a, b, strict=True))
            if sorted(x) != sorted(y)
        ]
        n_heads = sum(len(a) for a in ours)
        heads += n_heads
        same_heads += n_heads - len(diff)
        same_prompts += not diff
        tokens_equal = p["ours"] == p["theirs"]
        same_tokens += tokens_equal
        details.append(
            {
                "prompt": p["label"],
                "heads_differing": len(diff),
                "first_differing_head": diff[0] if diff else None,
                "differing_heads": [
                    {"layer": layer, "head": h,
                     "boundary_gap": p["theirs_gap"][layer][h] if p.get("theirs_gap") else None,
                     "only_ours": sorted(set(ours[layer][h]) - set(theirs[layer][h]))[:8],
                     "only_theirs": sorted(set(theirs[layer][h]) - set(ours[layer][h]))[:8]}
                    for layer, h in diff[:8]
                ],  # fmt: skip
                "tokens_identical": tokens_equal,
                "token_divergence": first_divergence(p["ours"], p["theirs"]),
            }
        )
    n = len(pairs)
    return {
        "prompts": n,
        "kept_identical_prompts": same_prompts,
        "heads": heads,
        "kept_identical_heads": same_heads,
        "tokens_identical_prompts": same_tokens,
        "details": details,
    }


# ---------------------------------------------------------------------------------------------
# The suites
# ---------------------------------------------------------------------------------------------


def cpu_suite(plan: Plan, limits: dict, compiles: CompileLog, memory: Memory,
              use_peers: bool) -> dict:  # fmt: skip
    """Scenarios (a) and (b), the grid, peers and agreement; returns the result sections.

    Every configuration runs dge_jax first, then the peers' jobs of that configuration."""
    timer = StageTimer(compiles, memory)
    out: dict = {"rows": [], "b_extras": []}
    peers, reason = Peers.start(use_peers)
    out["peers"] = {"available": True, "versions": peers.versions} if peers else {
        "available": False, "reason": reason}  # fmt: skip
    try:
        a_results = embedded_suite(plan, limits, timer, peers, out) if plan.a_configs else {}
        kv_suite(plan, limits, compiles, memory, peers, out)
    finally:
        if peers:
            peers.close()
    res = peers.results if peers else {}
    out["peer_results"] = {
        k: {f: v for f, v in r.items() if f not in ("kept", "margins")} for k, r in res.items()
    }
    for tokens, batch in plan.a_configs:
        if (r := res.get(f"a/{tokens}/{batch}/transformers")) is not None:
            out["rows"].append(peer_row(r, "a", "FullKV", tokens, batch, None))
        if batch == 1 and (r := res.get(f"a/{tokens}/p0/kvpress")) is not None:
            out["rows"].append(peer_row(r, "a", "SnapKVPress prefill", tokens, 1, plan.budget))
    for tokens, batch in plan.b_configs:
        if (r := res.get(f"b/{tokens}/{batch}/transformers")) is not None:
            out["rows"].append(peer_row(r, "b", "FullKV", tokens, batch, None))
        if (r := res.get(f"b/{tokens}/{batch}/kvpress")) is not None:
            out["rows"].append(
                peer_row(r, "b", "SnapKVPress prefill", tokens, batch, plan.b_budget)
            )
    if plan.a_configs:
        out["headline"] = headline(plan, out["rows"])
        grid_jobs = [v for k, v in res.items() if k.startswith("grid/")]
        if grid_jobs:
            out["grid"]["kvpress_runs"] = len(grid_jobs)
            out["grid"]["kvpress_cells"] = len(grid_jobs) * len(GRID_TIMINGS)
            out["grid"]["kvpress_total_s"] = len(GRID_TIMINGS) * sum(r["e2e_s"] for r in grid_jobs)
        out["agreement"] = agreement(plan, a_results, res)
    return out


def embedded_suite(plan: Plan, limits: dict, timer: StageTimer, peers: Peers | None,
                   out: dict) -> dict:  # fmt: skip
    """Scenario (a), the prefill profile and the grid, each configuration followed by its
    peer jobs. Returns the warm dge_jax results per configuration (for agreement)."""
    start = time.perf_counter()
    model = dge_jax.load(plan.model)
    eos_ids = list(model.tokenizer.eos_ids)
    out["model"] = {
        "name": plan.model,
        "path": str(model.path),
        "config": str(model.config),
        "load_s": time.perf_counter() - start,
        "param_bytes": tree_bytes(model.params),
    }
    prompts: dict[int, list[list[int]]] = {}
    for tokens in sorted({t for t, _ in plan.a_configs}):
        count = max(b for t, b in plan.a_configs if t == tokens)
        prompts[tokens] = make_prompts(model.tokenizer, tokens, count)
    common = {"folder": str(model.path), "new_tokens": plan.new_tokens, "eos_ids": eos_ids}
    a_results: dict[tuple[int, int], dict] = {}
    kvpress_done: set[tuple[int, int]] = set()
    for tokens, batch in plan.a_configs:
        log(f"[a] {tokens} tokens x {batch}")
        rows, results = run_embedded_config(
            model, prompts[tokens], tokens, batch, plan, timer, limits
        )
        out["rows"] += rows
        a_results[(tokens, batch)] = results
        if peers:
            jobs = [{"id": f"a/{tokens}/{batch}/transformers", "system": "transformers",
                     "prompts": prompts[tokens][:batch], **common}]  # fmt: skip
            for p in range(batch):  # kvpress runs batch 1: one job per prompt (agreement)
                if (tokens, p) not in kvpress_done:
                    kvpress_done.add((tokens, p))
                    jobs.append({"id": f"a/{tokens}/p{p}/kvpress", "system": "kvpress",
                                 "prompts": [prompts[tokens][p]], "press": "snapkv",
                                 "budget": plan.budget, "record_kept": True, **common})  # fmt: skip
            log(f"[a] peers: {len(jobs)} jobs")
            peers.run(jobs)
    head_tokens, _ = plan.headline
    log(f"[a] prefill profile at {head_tokens} tokens")
    out["prefill_profile"] = prefill_profile(model, head_tokens, plan.new_tokens)
    log(f"[grid] {len(GRID_POLICIES) * len(GRID_TIMINGS) * len(plan.grid_budgets)} cells")
    out["grid"] = run_grid(model, prompts[head_tokens][0], plan, timer)
    if peers:
        # kvpress has no draft timing: the three "timings" of a (policy, budget) cell are one
        # and the same run, so each distinct run is timed once and counted for all three.
        jobs = [{"id": f"grid/{name}/prefill/{budget}", "system": "kvpress",
                 "prompts": [prompts[head_tokens][0]], "press": name, "budget": budget, **common}
                for name, _ in GRID_POLICIES for budget in plan.grid_budgets]  # fmt: skip
        log(f"[grid] peers: {len(jobs)} kvpress runs")
        peers.run(jobs)
    return a_results


def kv_suite(plan: Plan, limits: dict, compiles: CompileLog, memory: Memory,
             peers: Peers | None, out: dict) -> None:  # fmt: skip
    """Scenario (b), each batch-1 configuration followed by its peer jobs (same weights,
    written as a Hugging Face folder)."""
    folder = None
    if peers and plan.b_peers and plan.b_configs:
        from models.llama_like import init_params

        longest = max(t for t, _ in plan.b_configs)
        _, cfg = kv_config(plan, longest, 1, max_tokens=longest + plan.b_new_tokens)
        folder = pathlib.Path(tempfile.mkdtemp(prefix="dge_bench_b_"))
        write_hf_folder(cfg, init_params(cfg, jax.random.PRNGKey(0), jnp.float32), folder)
        out["b_folder"] = str(folder)
    for tokens, batch in plan.b_configs:
        log(f"[b] {tokens} tokens x {batch}")
        rows, extras = run_kv_config(plan, tokens, batch, compiles, memory, limits)
        out["rows"] += rows
        prompt = extras.pop("prompt")
        out["b_extras"].append(extras)
        if folder is not None and batch == 1:
            common = {"folder": str(folder), "prompts": prompt, "new_tokens": plan.b_new_tokens,
                      "eos_ids": []}  # fmt: skip
            log("[b] peers: 2 jobs")
            peers.run([
                {"id": f"b/{tokens}/1/transformers", "system": "transformers", **common},
                {"id": f"b/{tokens}/1/kvpress", "system": "kvpress", "press": "snapkv",
                 "budget": plan.b_budget, "window": plan.b_window, **common},
            ])  # fmt: skip


def agreement(plan: Plan, a_results: dict, res: dict) -> dict:
    """FullKV tokens vs transformers; SnapKV (kvpress preset, prefill) vs kvpress."""
    full_pairs, kept_pairs = [], []
    for (tokens, batch), results in a_results.items():
        r = res.get(f"a/{tokens}/{batch}/transformers")
        if r is not None:
            for row in range(batch):
                full_pairs.append(
                    {
                        "label": f"{tokens} tokens, batch {batch}, row {row}",
                        "ours": results["FullKV"].tokens[row],
                        "theirs": r["tokens"][row],
                        "margins": r["margins"][row],
                    }
                )
    widest = {}
    for tokens, batch in plan.a_configs:
        widest[tokens] = max(widest.get(tokens, 0), batch)
    for tokens, batch in widest.items():
        snap = a_results[(tokens, batch)]["SnapKV prefill"]
        for row in range(batch):
            r = res.get(f"a/{tokens}/p{row}/kvpress")
            if r is None or "kept" not in r:
                continue
            kept_pairs.append(
                {
                    "label": f"{tokens} tokens, prompt {row}",
                    "ours": snap.tokens[row],
                    "theirs": r["tokens"][0],
                    "ours_kept": snap.kept[row],
                    "theirs_kept": r["kept"][0],
                    "theirs_gap": (r.get("boundary_gap") or [None])[0],
                }
            )
    return {"fullkv": fullkv_agreement(full_pairs), "kvpress": kept_agreement(kept_pairs)}


def gpu_suite(plan: Plan, limits: dict, peaks: dict, compiles: CompileLog, memory: Memory) -> dict:
    """The 8B-geometry model at 32 layers in bf16: prefill MFU, decode bandwidth utilisation."""
    out: dict = {"rows": [], "b_extras": []}
    for tokens, batch in plan.b_configs:
        log(f"[gpu] {tokens} tokens x {batch}, {plan.b_layers} layers, {plan.b_dtype}")
        rows, extras = run_kv_config(plan, tokens, batch, compiles, memory, limits)
        extras.pop("prompt")
        for row in rows:
            row["scenario"] = "gpu"
            row["mfu"] = row["prefill_gflops"] / peaks["gflops"]
            row["bw_util"] = row["decode_gb_s"] / peaks["gb_s"]
        out["rows"] += rows
        out["b_extras"].append(extras)
    return out


# ---------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------


def _find(rows, **match) -> dict | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _target(name: str, value, goal: str, met, detail: str = "") -> dict:
    return {
        "name": name,
        "value": value,
        "target": goal,
        "met": None if value is None else bool(met),
        "detail": detail,
    }


def targets(plan: Plan, out: dict, limits: dict) -> list[dict]:
    """Every target of issue 9 this plan can measure, met or missed (None: not measured)."""
    rows, t = out["rows"], []
    head_t, head_b = plan.headline
    if plan.a_configs:
        full = _find(
            rows,
            scenario="a",
            system="dge_jax",
            method="FullKV",
            prompt_tokens=head_t,
            batch=head_b,
        )
        frac = full["prefill_peak_frac"] if full else None
        t.append(
            _target(
                f"prefill >= 70 % of matmul peak ({head_t} tokens)",
                frac,
                ">= 0.70",
                frac is not None and frac >= TARGETS["prefill_peak_frac"],
                f"{full['prefill_gflops']:.1f} of {limits['gflops']:.1f} GFLOP/s" if full else "",
            )
        )
        head = out.get("headline", {"e2e_s": {}, "ratios": {}})
        ours = head["e2e_s"].get("dge_jax SnapKV dge(2)")
        for peer, key, theirs_key in (
            ("kvpress", "e2e_vs_kvpress", "kvpress SnapKVPress prefill"),
            ("transformers", "e2e_vs_transformers", "transformers FullKV"),
        ):
            theirs = head["e2e_s"].get(theirs_key)
            ratio = ours / theirs if theirs and ours else None
            t.append(
                _target(
                    f"end-to-end dge(2) / {peer} ({head_t} tokens, batch {head_b})",
                    ratio,
                    "<= 0.9",
                    ratio is not None and ratio <= TARGETS[key],
                    f"{ours:.2f} s vs {theirs:.2f} s" if ratio else "",
                )
            )
        grid = out.get("grid", {})
        speed = (
            grid["kvpress_total_s"] / grid["warm_wall_s"] if grid.get("kvpress_total_s") else None
        )
        t.append(
            _target(
                f"grid of {grid.get('cells')} cells: kvpress time / dge_jax time",
                speed,
                ">= 10",
                speed is not None and speed >= TARGETS["grid_speedup"],
                f"{grid.get('kvpress_total_s', 0):.1f} s vs {grid['warm_wall_s']:.1f} s"
                if speed
                else "",
            )
        )
        batches = sorted({b for t_, b in plan.a_configs if t_ == head_t})
        one = _find(
            rows,
            scenario="a",
            system="dge_jax",
            method="SnapKV dge(2)",
            prompt_tokens=head_t,
            batch=1,
        )
        many = _find(
            rows,
            scenario="a",
            system="dge_jax",
            method="SnapKV dge(2)",
            prompt_tokens=head_t,
            batch=batches[-1],
        )
        ratio = (
            many["decode_tok_s"] / one["decode_tok_s"] if one and many and many is not one else None
        )
        t.append(
            _target(
                f"batch {batches[-1]} / batch 1 decode tokens/s (dge(2), {head_t})",
                ratio,
                ">= 3",
                ratio is not None and ratio >= TARGETS["batch_decode_ratio"],
            )
        )
        agree = out.get("agreement", {})
        fk = agree.get("fullkv", {})
        t.append(
            _target(
                "FullKV tokens identical to transformers",
                fk.get("fraction"),
                ">= 0.95",
                (fk.get("fraction") or 0) >= TARGETS["fullkv_agreement"],
                f"{fk.get('identical')}/{fk.get('prompts')} prompts",
            )
        )
        kv = agree.get("kvpress", {})
        n = kv.get("prompts")
        value = kv["kept_identical_heads"] / kv["heads"] if n else None
        t.append(
            _target(
                "kvpress-preset kept sets identical to kvpress",
                value,
                "= 1",
                value == 1.0,
                f"{kv.get('kept_identical_heads')}/{kv.get('heads')} "
                f"heads, {kv.get('kept_identical_prompts')}/{n} prompts; tokens "
                f"identical on {kv.get('tokens_identical_prompts')}/{n}"
                if n
                else "",
            )
        )
    if plan.b_configs:
        bt, bb = plan.b_target
        ex = next(
            (e for e in out["b_extras"] if (e["prompt_tokens"], e["batch"]) == (bt, bb)), None
        )
        speed = ex["decode_speedup"] if ex else None
        t.append(
            _target(
                f"(b) compacted / full decode speed ({bt} tokens, batch {bb}, budget "
                f"{plan.b_budget})",
                speed,
                ">= 3",
                speed is not None and speed >= TARGETS["b_decode_speedup"],
            )
        )
        over = ex["compacted_bytes"] / ex["theoretical_bytes"] - 1 if ex else None
        t.append(
            _target(
                "(b) compacted cache bytes over theoretical",
                over,
                "<= 10 %",
                over is not None and over <= TARGETS["b_cache_overhead"],
                f"{ex['compacted_bytes'] / MIB:.2f} MiB vs {ex['theoretical_bytes'] / MIB:.2f} MiB"
                if ex
                else "",
            )
        )
    return t


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def _f(x, fmt: str = ".2f", scale: float = 1.0) -> str:
    return "–" if x is None else format(x * scale, fmt)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> list[str]:
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def markdown(result: dict) -> str:
    """The report: machine, figures per scenario, utilisation, grid, agreement, targets."""
    m, lim = result["machine"], result["limits"]
    lines = [f"# Benchmarks: `{result['suite']}` suite ({result['size']})", ""]
    lines += [
        f"- command: `{result['command']}`",
        f"- date: {result['date']}",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; "
        f"{m['platform']} / {m['device_kind']}; jax {m['jax']}",
        f"- load average at start / end: {result['load_start']} / {result['load_end']}",
        f"- measured limits: matmul {lim['gflops']:.1f} GFLOP/s ({lim['matmul']['dtype']}, "
        f"n = {lim['matmul']['n']}), read bandwidth {lim['gb_s']:.1f} GB/s "
        f"(reduce {lim['bandwidth']['reduce_gb_s']:.1f}, matrix-vector "
        f"{lim['bandwidth']['gemv_gb_s']:.1f})",
        f"- memory column: {result['memory_kind']}",
        f"- wall time of the whole run: {result['wall_s'] / 60:.1f} min",
    ]
    if "peaks" in result:
        p = result["peaks"]
        lines.append(
            f"- peaks for utilisation: {p['gflops'] / 1e3:.3g} TFLOP/s, "
            f"{p['gb_s'] / 1e3:.2f} TB/s ({p['source']})"
        )
    peers = result.get("peers", {})
    if peers.get("available"):
        v = peers["versions"]
        lines.append(
            f"- peers: torch {v['torch']} ({v['torch_threads']} threads), transformers "
            f"{v['transformers']}, kvpress {v['kvpress']} (`{SETUP_COMMAND}`)"
        )
    elif peers:
        lines.append(f"- peers: not run ({peers.get('reason')})")
    if "model" in result:
        lines.append(
            f"- scenario (a) model: {result['model']['name']} "
            f"({result['model']['param_bytes'] / MIB:.0f} MiB of parameters)"
        )
    lines.append("")
    header = [
        "prompt",
        "batch",
        "system",
        "method",
        "prefill tok/s",
        "TTFT s",
        "evict ms",
        "decode tok/s",
        "end-to-end s",
        "peak mem MiB",
        "cache MiB",
        "compile s (#)",
    ]
    plan = result["plan"]
    titles = {
        "a": f"Scenario (a): {plan['model']}, {plan['new_tokens']} new tokens, SnapKV budget "
        f"{plan['budget']}",
        "b": f"Scenario (b): KV-dominated random weights ({plan['b_layers']} layers, 32/8 heads "
        f"x 128, hidden {plan['b_hidden']}), {plan['b_new_tokens']} new tokens, budget "
        f"{plan['b_budget']}",
        "gpu": f"GPU suite: Llama-3-8B attention geometry, {plan['b_layers']} layers, hidden "
        f"{plan['b_hidden']}, {plan['b_dtype']}, budget {plan['b_budget']}",
    }
    notes = {
        "a": "dge_jax: per method a cold `generate` call, the first at its shapes, whose "
        "compilation (as JAX reports it) is compile s (#), then a warm call that gives every "
        "other figure (the FullKV call compiles the prefill, the SnapKV prefill call compiles "
        "it again with the observation window, dge(2) reuses that). Peers: one run each after "
        "a warm-up; kvpress at batch 1 only, as its pipeline runs. Peak mem: process RSS "
        "(dge_jax: the benchmark process, model and JAX included; peers: the peer process).",
        "b": "Every step compiled ahead of time; decode is the best of several runs; the "
        "compacted row's evict ms is select + compact.",
        "gpu": "Every step compiled ahead of time; decode is the best of several runs.",
    }
    for scenario, title in titles.items():
        rows = [r for r in result["rows"] if r["scenario"] == scenario]
        if not rows:
            continue
        rows.sort(key=lambda r: (r["prompt_tokens"], r["batch"], r["system"] != "dge_jax"))
        lines += [f"## {title}", ""]
        lines += _table(
            header,
            [
                [
                    str(r["prompt_tokens"]),
                    str(r["batch"]),
                    r["system"],
                    r["method"],
                    _f(r["prefill_tok_s"], ".0f"),
                    _f(r["ttft_s"]),
                    _f(r["evict_s"], ".1f", 1e3),
                    _f(r["decode_tok_s"], ".1f"),
                    _f(r["e2e_s"]),
                    _f(r["peak_mem"], ".0f", 1 / MIB),
                    _f(r["cache_bytes"], ".1f", 1 / MIB),
                    "–"
                    if r["compile_s"] is None
                    else f"{r['compile_s']:.1f} ({r['compilations']})",
                ]
                for r in rows
            ],
            align="rrll" + "r" * 8,
        )
        lines += ["", notes[scenario], ""]
        ours = [r for r in rows if r["system"] == "dge_jax"]
        util_header = [
            "prompt",
            "batch",
            "method",
            "prefill GFLOP/s",
            "% of matmul peak",
            "decode GB/s",
            "% of bandwidth",
        ]
        util = [
            [
                str(r["prompt_tokens"]),
                str(r["batch"]),
                r["method"],
                _f(r["prefill_gflops"], ".1f"),
                _f(r["prefill_peak_frac"], ".0f", 100),
                _f(r["decode_gb_s"], ".1f"),
                _f(r["decode_bw_frac"], ".0f", 100),
            ]
            for r in ours
        ]
        if scenario == "gpu":
            util_header += ["MFU %", "bandwidth util %"]
            for u, r in zip(util, ours, strict=True):
                u += [_f(r["mfu"], ".1f", 100), _f(r["bw_util"], ".1f", 100)]
        lines += [f"dge_jax against the measured limits ({scenario}):", ""]
        lines += _table(util_header, util, align="rrl" + "r" * (len(util_header) - 3))
        lines.append("")
    if result.get("headline"):
        h = result["headline"]
        lines += [
            f"## Headline: end-to-end at {h['prompt_tokens']} tokens, batch {h['batch']} (warm, "
            "compile excluded)",
            "",
        ]
        lines += _table(["run", "end-to-end s"], [[k, _f(v)] for k, v in h["e2e_s"].items()])
        lines += [""] + _table(["ratio", "value"], [[k, _f(v, ".3f")]
                                                   for k, v in h["ratios"].items()])  # fmt: skip
        lines.append("")
    if result.get("prefill_profile"):
        p = result["prefill_profile"]
        head = next(
            (r for r in result["rows"] if r["scenario"] == "a" and r["system"] == "dge_jax"
             and r["method"] == "FullKV" and r["prompt_tokens"] == p["tokens"] and r["batch"] == 1),
            None,
        )  # fmt: skip
        total = head["prefill_s"] if head else None
        other = total - p["linear_s"] - p["attention_s"] if total else None
        lines += [f"## Where the {p['tokens']}-token prefill's time goes (batch 1)", ""]
        lines += _table(
            ["part", "seconds", "GFLOP/s", "note"],
            [
                ["whole prefill (FullKV row above)", _f(total), _f(head and head["prefill_gflops"],
                 ".1f"), "model FLOPs: linear + causal attention + LM head"],
                ["linear layers alone", _f(p["linear_s"]), _f(p["linear_gflops"], ".1f"),
                 f"chunks of {p['chunk']} tokens"],
                ["chunked attention alone", _f(p["attention_s"]), _f(p["attention_gflops_done"],
                 ".1f"), f"chunk i over its {p['chunk']}-key blocks 0..i: "
                 f"{p['attention_flops_done'] / p['attention_flops_causal']:.2f}x causal FLOPs"],
                ["the rest", _f(other), "–", "norms, RoPE, cache writes, LM head"
                 + (" (below 0: the parts timed alone, in other runs, add up to more than "
                    "the whole; machine noise)" if other is not None and other < 0 else "")],
            ],
            align="lrrl",
        )  # fmt: skip
        lines.append("")
    if result.get("grid"):
        g = result["grid"]
        lines += [
            f"## Research grid: {g['cells']} cells on one {g['prompt_tokens']}-token prompt",
            "",
        ]
        lines += _table(
            ["system", "wall s", "prefill s", "draft s", "evict s", "decode s", "compile s (#)"],
            [
                [
                    "dge_jax generate_grid (warm)",
                    _f(g["warm_wall_s"]),
                    _f(g["prefill_s"]),
                    _f(g["draft_s"]),
                    _f(g["evict_s"]),
                    _f(g["decode_s"]),
                    f"{g['compile_s']:.1f} ({g['compilations']})",
                ],
                [
                    f"kvpress, {g.get('kvpress_cells', 0)} cells ({g.get('kvpress_runs', 0)} "
                    "distinct runs x 3 timings)",
                    _f(g.get("kvpress_total_s")),
                    "–",
                    "–",
                    "–",
                    "–",
                    "–",
                ],
            ],
        )
        lines += [
            "",
            f"3 policies (SnapKV and PyramidKV with kvpress's window 64 / kernel 5 / avg-pool, "
            f"StreamingLLM with 4 sinks) x 3 timings (prefill, dge(2), dge_w(2)) x budgets "
            f"{', '.join(map(str, plan['grid_budgets']))}, {g['new_tokens']} new tokens each. "
            "dge_jax: one `generate_grid` call: one prefill, one draft, one scoring per "
            "(scorer, timing: SnapKV and PyramidKV share theirs) and a selection per budget, "
            "compacted cells sized per layer (PyramidKV's layers keep different counts) and "
            f"cells of one cache shape decoded as one batch ({g['decode_groups']} decode "
            "call(s)); compile s (#) from the cold call. kvpress (SnapKVPress, PyramidKVPress, "
            "StreamingLLMPress at the same budgets) has no draft timing, so the three timings of "
            "a (policy, budget) cell are one and the same run: each distinct run is timed once "
            "and counted three times."
            + (
                f" The evicted cells' caches hold {g['evicted_cache_bytes'] / 2**20:,.1f} MiB in "
                f"all ({g['one_capacity_cache_bytes'] / 2**20:,.1f} MiB if every layer had its "
                "cache's largest layer capacity)."
                if g.get("evicted_cache_bytes")
                else ""
            ),
            "",
        ]
    if result.get("agreement"):
        a = result["agreement"]
        fk, kv = a["fullkv"], a["kvpress"]
        lines += ["## Agreement", ""]
        lines.append(
            f"- FullKV tokens identical to transformers: {fk['identical']}/{fk['prompts']} prompts"
        )
        for d in fk["diverged"]:
            lines.append(
                f"  - {d['prompt']}: first divergence at token {d['step']} (ours "
                f"{d['ours']}, transformers {d['transformers']}; transformers' top-1 - "
                f"top-2 logit margin there {_f(d['transformers_margin'], '.4f')})"
            )
        lines.append(
            f"- SnapKV (kvpress preset, prefill) kept sets identical to kvpress: "
            f"{kv['kept_identical_heads']}/{kv['heads']} heads, "
            f"{kv['kept_identical_prompts']}/{kv['prompts']} prompts; tokens identical "
            f"on {kv['tokens_identical_prompts']}/{kv['prompts']}"
        )
        for d in kv["details"]:
            if d["heads_differing"] or not d["tokens_identical"]:
                first = d["first_differing_head"]
                where = "none" if first is None else "layer {}, kv head {}".format(*first)
                tokens = ("tokens identical" if d["token_divergence"] is None
                          else f"tokens diverge at step {d['token_divergence']}")  # fmt: skip
                lines.append(
                    f"  - {d['prompt']}: {d['heads_differing']} head(s) differ (first: "
                    f"{where}); {tokens}"
                )
                for h in d.get("differing_heads", []):
                    lines.append(
                        f"    - layer {h['layer']}, kv head {h['head']}: kept only by dge_jax "
                        f"{h['only_ours']}, only by kvpress {h['only_theirs']}; kvpress's "
                        f"relative score gap at the budget boundary {_f(h['boundary_gap'], '.2e')}"
                    )
        lines.append("")
    if result.get("b_extras") and result["suite"] == "cpu":
        lines += ["## Scenario (b): eviction at decode time", ""]
        lines += _table(
            [
                "prompt",
                "batch",
                "select ms",
                "compact ms",
                "slots kept / capacity",
                "compacted MiB",
                "theoretical MiB",
                "decode speed-up",
            ],
            [
                [
                    str(e["prompt_tokens"]),
                    str(e["batch"]),
                    _f(e["select_s"], ".1f", 1e3),
                    _f(e["compact_s"], ".1f", 1e3),
                    f"{e['kept_max']} / {e['compacted_capacity']}",
                    _f(e["compacted_bytes"], ".2f", 1 / MIB),
                    _f(e["theoretical_bytes"], ".2f", 1 / MIB),
                    _f(e["decode_speedup"], ".2f"),
                ]
                for e in result["b_extras"]
            ],
        )
        lines.append("")
    if result.get("targets"):
        lines += ["## Targets", ""]
        lines += _table(
            ["target", "value", "goal", "met", "detail"],
            [
                [
                    t["name"],
                    _f(t["value"], ".3f"),
                    t["target"],
                    {True: "yes", False: "**no**", None: "not measured"}[t["met"]],
                    t["detail"],
                ]
                for t in result["targets"]
            ],
            align="lrlll",
        )
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n", 1)[0]
    )
    p.add_argument("--suite", choices=("cpu", "gpu"), default="cpu")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes: every path, minutes")
    size.add_argument("--tiny", action="store_true", help="smallest sizes (tests; needs --model)")
    p.add_argument("--model", default=None, help="scenario (a)'s model: embedded name or folder")
    p.add_argument("--no-peers", action="store_true", help="skip transformers and kvpress")
    p.add_argument("--out", default=str(ROOT / "results"), help="results folder")
    p.add_argument("--peak-tflops", type=float, default=None, help="GPU peak (bf16 TFLOP/s)")
    p.add_argument("--peak-tbps", type=float, default=None, help="GPU peak bandwidth (TB/s)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    plan = make_plan(args.suite, size)
    if args.model:
        plan = dataclasses.replace(plan, model=args.model)
    command = "python -m benchmarks.run " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(f"$ {command}")
    start = time.perf_counter()
    load_start = os.getloadavg()
    compiles, memory = CompileLog.get(), Memory()
    dtype = jnp.bfloat16 if args.suite == "gpu" else jnp.float32
    log("[machine] measuring matmul peak and read bandwidth")
    limits = machine.measure(quick=size != "full", dtype=dtype)
    result: dict = {
        "suite": args.suite,
        "size": size,
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine.describe(),
        "limits": limits,
        "memory_kind": memory.kind,
        "plan": dataclasses.asdict(plan),
        "load_start": " ".join(f"{x:.2f}" for x in load_start),
    }
    if args.suite == "cpu":
        result |= cpu_suite(plan, limits, compiles, memory, use_peers=not args.no_peers)
    else:
        peaks = machine.peaks_for(
            result["machine"]["device_kind"], limits, args.peak_tflops, args.peak_tbps
        )
        result["peaks"] = peaks
        result |= gpu_suite(plan, limits, peaks, compiles, memory)
    result["targets"] = targets(plan, result, limits)
    result["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    result["wall_s"] = time.perf_counter() - start
    text = markdown(result)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.suite + ("" if size == "full" else f"-{size}")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=_json_default))
    (out / f"{stem}.md").write_text(text + "\n")
    print()
    print(text)
    print(f"\nwrote {out / (stem + '.json')} and {out / (stem + '.md')}")
    return result


def _json_default(x):
    if isinstance(x, np.integer | np.floating):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


if __name__ == "__main__":
    main()
