"""Scenario (b): the KV-dominated random-weight model, every step compiled ahead of time.

`run_kv_config` runs one configuration of (b), and of the GPU suite (the same model at 32
layers in bf16): prefill, draft, select + compact, decode full vs compacted, each step
compiled ahead as `benchmarks.eviction_decode` does (whose pieces it reuses), its short steps
timed best of `Plan.runs`. Its prefill runs the attention backend it is given
(`dge_jax.runtime.platform.ATTENTION`); the later steps always run the XLA path, so a second
backend of the same configuration finds their executables in JAX's compile cache (same
functions, static arguments and shapes) and compiles its prefill alone. `write_hf_folder`
writes the same weights as a Hugging Face folder for the peers. What the suites run is in
`benchmarks.suites`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import eviction_decode as ed
from benchmarks.harness import CompileCost, CompileLog, Memory
from benchmarks.plans import DGE2, Plan
from benchmarks.work import prefill_flops, tree_bytes
from dge_jax.config import ModelConfig
from dge_jax.eviction.evict import (
    SelectionInputs,
    SelectionSpec,
    capacity_for,
    select_for_budgets,
)
from dge_jax.families import get_family
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime import decoding as gen
from dge_jax.runtime import platform
from dge_jax.runtime.compaction import compact
from dge_jax.runtime.selection import apply_keep


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


@dataclasses.dataclass
class KvSteps:
    """What one (b) configuration measured: seconds per step, the kept counts, the caches."""

    prefill_s: float
    ttft_s: float
    draft_s: float
    select_s: float
    compact_s: float
    decode: dict[str, tuple[float, int]]  # "full" | "compacted": (seconds, cache bytes)
    remaining: int  # decode steps after the draft
    counts: np.ndarray  # kept entries per layer, row and kv head
    compacted_capacity: int
    cache_bytes_full: int


def prefill_chunk(plan: Plan, cfg: ModelConfig, batch: int, tokens: int, capacity: int) -> int:
    """`eviction_decode`'s prefill chunk, capped by `plan.b_prefill_memory`."""
    chunk = ed.prefill_chunk(cfg, batch, tokens, capacity)
    if plan.b_prefill_memory:  # a shared CPU host: half of eviction_decode's 8 GiB per chunk
        per_query = batch * cfg.num_heads * capacity * 4 * ed.ATTN_COPIES
        while chunk > 1 and chunk * per_query > plan.b_prefill_memory:
            chunk //= 2
    return chunk


def run_kv_config(
    plan: Plan,
    tokens: int,
    batch: int,
    compiles: CompileLog,
    memory: Memory,
    limits: dict,
    attention: str = "auto",
) -> tuple[list[dict], dict]:
    """One (b) configuration: prefill, draft (k=2), select + compact, decode full vs compacted.

    attention: prefill's attention backend ("auto": the platform's; the rows record the one
    that ran). Returns (the two rows, extras: theoretical compacted size, kept counts, the
    prompt)."""
    from models.llama_like import init_params

    _, cfg = kv_config(plan, tokens, batch)
    dtype = jnp.dtype(plan.b_dtype)
    capacity = tokens + plan.b_new_tokens
    chunk = prefill_chunk(plan, cfg, batch, tokens, capacity)
    params = init_params(cfg, jax.random.PRNGKey(0), dtype)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, (batch, tokens))
    ids = jnp.asarray(prompt, jnp.int32)
    lengths = jnp.full((batch,), tokens, jnp.int32)
    key = jax.random.PRNGKey(0)
    cost = CompileCost(compiles)
    memory.mark()
    steps = time_kv_steps(plan, cfg, params, (ids, lengths, key), capacity, chunk, cost, attention)
    peak = memory.peak()
    flops = prefill_flops(cfg, tokens, batch)
    common = {
        "scenario": "b",
        "system": "dge_jax",
        "prompt_tokens": tokens,
        "batch": batch,
        "attention": platform.current(attention).attention,
        "prefill_s": steps.prefill_s,
        "prefill_tok_s": batch * tokens / steps.prefill_s,
        "ttft_s": steps.ttft_s,
        "peak_mem": peak,
        "cache_bytes_full": steps.cache_bytes_full,
        "prefill_gflops": flops / steps.prefill_s / 1e9,
        "prefill_peak_frac": flops / steps.prefill_s / 1e9 / limits["gflops"],
        "compile_s": cost.seconds,
        "compilations": cost.count,
        "prefill_chunk": chunk,
        "dtype": dtype.name,
        "layers": cfg.num_layers,
    }
    rows = kv_rows(plan, common, steps, tree_bytes(params), limits)
    # Theoretical compacted cache: per layer, row and kv head, `budget` kept entries plus one
    # slot per token still to come, each holding k and v (head_dim values) and a position.
    slot_bytes = 2 * cfg.head_dim * dtype.itemsize + 4
    slots = plan.b_budget + steps.remaining
    extras = {
        "prompt_tokens": tokens,
        "batch": batch,
        "attention": common["attention"],
        "select_s": steps.select_s,
        "compact_s": steps.compact_s,
        "compacted_capacity": steps.compacted_capacity,
        "kept_max": int(steps.counts.max()),
        "theoretical_bytes": cfg.num_layers * batch * cfg.num_kv_heads * slots * slot_bytes,
        "compacted_bytes": steps.decode["compacted"][1],
        "decode_speedup": steps.decode["full"][0] / steps.decode["compacted"][0],
        "prompt": prompt[:1].tolist(),
    }
    return rows, extras


@functools.partial(jax.jit, static_argnames="capacity")
def compact_kept(cache, keep, capacity: int):
    """The cache holding only the kept entries, in `capacity` slots (module level, so that
    JAX's compile cache finds it again for the same shapes)."""
    return compact(apply_keep(cache, keep), capacity)


def time_kv_steps(
    plan: Plan,
    cfg: ModelConfig,
    params,
    inputs: tuple,
    capacity: int,
    chunk: int,
    cost: CompileCost,
    attention: str = "auto",
) -> KvSteps:
    """Compiles each step ahead (`cost` adds up the compile cost) and times it: prefill, the
    first token, draft, select, compact, then decode from the full and the compacted cache.

    inputs: (token ids [B, T], lengths [B], the sampler's key). attention: the prefill's
    attention backend (`platform.ATTENTION`); every later step runs the XLA path whatever
    it is. Every step is a module-level jitted function, so a step compiled before with the
    same static arguments and shapes comes from JAX's compile cache and `cost` counts only
    what this call compiled (a second backend's pass: its prefill)."""
    ids, lengths, key = inputs

    fwd = get_family("llama").forward
    n_new, runs = plan.b_new_tokens, plan.runs
    rule, timing = SnapKV(window=plan.b_window), DGE2
    prefill = cost.compile(
        gen.prefill_prompt,
        fwd,
        cfg,
        params,
        ids,
        lengths,
        gen.PrefillSpec(capacity, chunk, rule.needs.recording, attention=attention),
    )
    t_prefill, pre = ed.timed(prefill, params, ids, lengths)
    start_time = time.perf_counter()
    first = ed.GREEDY(pre.logits, key)
    start = jax.block_until_ready(
        gen.start_state(pre.cache, first, lengths, n_new, ed.EOS_IDS, key)
    )
    ttft = t_prefill + (time.perf_counter() - start_time)
    draft = cost.compile(
        gen.draft_tokens,
        fwd,
        cfg,
        params,
        start,
        ed.STEPS,
        num_steps=timing.draft_steps,
    )
    t_draft, (state, drafts) = ed.timed(draft, params, start)
    budget, observe = jnp.asarray(plan.b_budget, jnp.int32), jnp.asarray(timing.observes_drafts)
    select_args = (state.cache, pre.obs, drafts, (budget,), SelectionInputs(observe))
    select = cost.compile(select_for_budgets, *select_args, spec=SelectionSpec(rule))
    t_select, (keep,) = ed.timed(select, *select_args, runs=runs)
    remaining = n_new - int(np.min(np.asarray(state.step)))
    counts = np.asarray(jnp.sum(keep, axis=-1))
    small = capacity_for(counts, remaining)  # the API's rule: kept, rounded up, + new tokens
    shrink = cost.compile(compact_kept, state.cache, keep, capacity=small)
    t_compact, small_cache = ed.timed(shrink, state.cache, keep, runs=runs)
    decode_rows = {}
    for name, st in (("full", state), ("compacted", dataclasses.replace(state, cache=small_cache))):
        decode = cost.compile(gen.decode_loop, fwd, cfg, params, st, ed.STEPS)
        ed.timed(decode, prepare=lambda st=st: (params, *ed.fresh(st)))  # warm up
        seconds, out = ed.timed(decode, runs=runs, prepare=lambda st=st: (params, *ed.fresh(st)))
        assert np.all(np.asarray(out.step) == n_new), out.step
        decode_rows[name] = (seconds, st.cache.nbytes())
    return KvSteps(
        t_prefill,
        ttft,
        t_draft,
        t_select,
        t_compact,
        decode_rows,
        remaining,
        counts,
        small,
        state.cache.nbytes(),
    )


def kv_rows(plan: Plan, common: dict, steps: KvSteps, param_bytes: int, limits: dict) -> list[dict]:
    """The full and the compacted decode's rows: `common` and the decode's figures."""
    rows = []
    t_evict = steps.select_s + steps.compact_s
    for name, (seconds, nbytes) in steps.decode.items():
        gb_s = (param_bytes + nbytes) * steps.remaining / seconds / 1e9
        compacted = name == "compacted"
        rows.append(
            common
            | {
                "method": "SnapKV dge(2) compacted" if compacted else "FullKV",
                "budget": plan.b_budget if compacted else None,
                "draft_s": steps.draft_s,
                "evict_s": t_evict if compacted else None,
                "decode_s": seconds,
                "decode_steps": steps.remaining,
                "decode_tok_s": common["batch"] * steps.remaining / seconds,
                "decode_ms_per_step": seconds / steps.remaining * 1e3,
                "e2e_s": steps.ttft_s + steps.draft_s + (t_evict if compacted else 0) + seconds,
                "cache_bytes": nbytes,
                "decode_gb_s": gb_s,
                "decode_bw_frac": gb_s / limits["gb_s"],
            }
        )
    return rows


def write_hf_folder(cfg: ModelConfig, params, folder: pathlib.Path) -> None:
    """A Hugging Face Llama folder (config.json + model.safetensors) holding `params`: the
    reverse of `models.llama_like.hf_key_table`, so the peers run the very same weights."""
    from safetensors.numpy import save_file

    from models.llama_like import hf_key_table

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for pattern, field, transform in hf_key_table(cfg):
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
