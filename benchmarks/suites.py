"""The suites: what runs, in which order, and the peers' jobs of each configuration.

What runs, in one process, peers in a subprocess afterwards (never concurrently):

- machine limits: f32 matmul GFLOP/s and memory read bandwidth (`benchmarks.machine`);
- (a) the embedded SmolLM2-135M-Instruct on prompts of 2k / 4k / 8k tokens (8k = 8128, so
  that 64 new tokens fit its 8192 positions), batch 1 and 4: FullKV, SnapKV (kvpress preset:
  window 64, kernel 5, avg-pool) at budget 256 under `prefill` and `dge(2)`; per cell
  prefill tokens/s, time to first token, eviction overhead, decode tokens/s, end-to-end time,
  peak RSS, cache bytes, compile time and count; the same end-to-end figures for transformers'
  `generate` (FullKV) and kvpress's SnapKVPress at the same per-head budget, same weights,
  same token ids, exactly 64 new tokens each (EOS banned, as min_new_tokens = 64);
- the research grid: one prompt under 3 rules x 3 timings x 3 budgets with one
  `generate_grid` call, against kvpress running the same 27 cells one by one;
- agreement: FullKV tokens vs transformers, SnapKV-preset kept positions and tokens vs kvpress;
- (b) the KV-dominated random-weight model of `benchmarks.eviction_decode` (Llama-3-8B
  attention geometry on a 2-layer trunk) at 4k / 8k / 16k tokens: full vs compacted decode,
  cache bytes against the theoretical size of a compacted cache;
- the GPU suite: (b)'s attention at 32 layers in bf16 (the full plan with Llama-3.1-8B's
  hidden and MLP sizes) at batch 1, 8 and 32 (and one long batch-1 prompt): prefill tok/s
  and model-FLOP utilisation, decode tok/s and bandwidth utilisation from the full and the
  compacted cache, against the GPU's peaks (`machine.GPU_PEAKS`), each configuration under
  each prefill attention backend (`gpu_attention`).

How each is timed: `benchmarks.harness`. The machine limits are measured by
`benchmarks.run.main` before a suite starts.
"""

from __future__ import annotations

import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp

import dge_jax
from benchmarks.harness import CompileLog, Memory, StageTimer, log
from benchmarks.peers.agreement import agreement
from benchmarks.peers.peer_client import Peers, peer_row
from benchmarks.plans import GRID_RULES, GRID_TIMINGS, Plan
from benchmarks.scenario_a import make_prompts, prefill_profile, run_embedded_config, run_grid
from benchmarks.scenario_b import kv_config, run_kv_config, write_hf_folder
from benchmarks.targets import headline
from benchmarks.work import tree_bytes
from dge_jax.runtime import platform


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
    out["rows"] += peer_rows(plan, res)
    if plan.a_configs:
        out["headline"] = headline(plan, out["rows"])
        grid_jobs = [v for k, v in res.items() if k.startswith("grid/")]
        if grid_jobs:
            out["grid"]["kvpress_runs"] = len(grid_jobs)
            out["grid"]["kvpress_cells"] = len(grid_jobs) * len(GRID_TIMINGS)
            out["grid"]["kvpress_total_s"] = len(GRID_TIMINGS) * sum(r["e2e_s"] for r in grid_jobs)
        out["agreement"] = agreement(plan, a_results, res)
    return out


def peer_rows(plan: Plan, res: dict) -> list[dict]:
    """The peers' rows of the figure tables, from their results by job id."""
    rows = []
    for tokens, batch in plan.a_configs:
        if (r := res.get(f"a/{tokens}/{batch}/transformers")) is not None:
            rows.append(peer_row(r, "a", "FullKV", tokens, batch, None))
        if batch == 1 and (r := res.get(f"a/{tokens}/p0/kvpress")) is not None:
            rows.append(peer_row(r, "a", "SnapKVPress prefill", tokens, 1, plan.budget))
    for tokens, batch in plan.b_configs:
        if (r := res.get(f"b/{tokens}/{batch}/transformers")) is not None:
            rows.append(peer_row(r, "b", "FullKV", tokens, batch, None))
        if (r := res.get(f"b/{tokens}/{batch}/kvpress")) is not None:
            rows.append(peer_row(r, "b", "SnapKVPress prefill", tokens, batch, plan.b_budget))
    return rows


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
    log(f"[grid] {len(GRID_RULES) * len(GRID_TIMINGS) * len(plan.grid_budgets)} cells")
    out["grid"] = run_grid(model, prompts[head_tokens][0], plan, timer)
    if peers:
        # kvpress has no draft timing: the three "timings" of a (rule, budget) cell are one
        # and the same run, so each distinct run is timed once and counted for all three.
        jobs = [{"id": f"grid/{name}/prefill/{budget}", "system": "kvpress",
                 "prompts": [prompts[head_tokens][0]], "press": name, "budget": budget, **common}
                for name, _ in GRID_RULES for budget in plan.grid_budgets]  # fmt: skip
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


def gpu_attention() -> tuple[str, ...]:
    """The prefill attention backends the GPU suite times: ("xla", "cudnn") on a GPU; only
    "xla" elsewhere (the --tiny test runs this suite's code on CPU), since cuDNN flash
    attention runs on GPUs only (`platform.Backend.of` refuses it elsewhere)."""
    on_gpu = platform.Backend.of(platform.current_platform()).platform == "gpu"
    return ("xla", "cudnn") if on_gpu else ("xla",)


def gpu_suite(plan: Plan, limits: dict, peaks: dict, compiles: CompileLog, memory: Memory) -> dict:
    """The 8B-attention-geometry model at 32 layers in bf16, each configuration under each
    prefill attention backend (`gpu_attention`): prefill tok/s and MFU, decode tok/s and
    bandwidth utilisation from the full and the compacted cache. The steps after prefill run
    the XLA path under every backend, so a configuration's later backends find their
    executables in JAX's compile cache: each row's compile s (#) is what its backend's pass
    compiled (after the first, the prefill alone)."""
    out: dict = {"rows": [], "b_extras": []}
    for tokens, batch in plan.b_configs:
        for attention in gpu_attention():
            log(f"[gpu] {tokens} tokens x {batch}, {plan.b_layers} layers, {plan.b_dtype}, "
                f"{attention} attention")  # fmt: skip
            rows, extras = run_kv_config(
                plan, tokens, batch, compiles, memory, limits, attention=attention
            )
            extras.pop("prompt")
            for row in rows:
                row["scenario"] = "gpu"
                row["mfu"] = row["prefill_gflops"] / peaks["gflops"]
                row["bw_util"] = row["decode_gb_s"] / peaks["gb_s"]
            out["rows"] += rows
            out["b_extras"].append(extras)
    return out
