"""Scenario (a) and the research grid: the embedded model through the public API.

`run_embedded_config` times one (prompt length, batch) of scenario (a), a cold and a warm
`generate` call per method (`plans.A_METHODS`), each under `harness.StageTimer`;
`prefill_profile` splits one prefill's time into its linear layers and its attention;
`run_grid` times the research grid's one `generate_grid` call. What the suite runs, and the
peers' side of it, is in `benchmarks.suites`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import eviction_decode as ed
from benchmarks.harness import Call, StageTimer, jit_cache_sizes
from benchmarks.plans import A_METHODS, GRID_RULES, GRID_TIMINGS, Plan, a_cells
from benchmarks.work import linear_params, prefill_flops, tree_bytes
from dge_jax import generation
from dge_jax.config import ModelConfig
from dge_jax.eviction.evict import Eviction
from dge_jax.text import prompts

PROMPT_TASKS = ("passkey", "niah_multikey", "vt_chain", "essay_qa")


def make_prompts(tokenizer, length: int, count: int, seed: int = 0) -> list[list[int]]:
    """`count` chat prompts of exactly `length` token ids: synthetic long-context tasks on the
    Paul Graham essays (`experiments.suites.synthetic`), chat-templated, cut in the middle to size
    (LongBench's truncation), so every row of a batch has the same length (no padding)."""
    from experiments import protocol
    from experiments.suites import synthetic

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

        def call(hook, ev=ev):
            return generation.generate(
                model, ids, eviction=ev, max_new_tokens=n, min_new_tokens=n, hook=hook
            )

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


def run_grid(model, prompt: list[int], plan: Plan, timer: StageTimer) -> dict:
    """The research loop: 3 rules x 3 timings x 3 budgets on one prompt in one
    `generate_grid` call (one prefill, one draft, cells of one cache shape, its capacities
    per layer, decoded as one batch), cold then warm."""
    n = plan.new_tokens
    cells = [
        Eviction(rule, budget, timing)
        for _, rule in GRID_RULES
        for _, timing in GRID_TIMINGS
        for budget in plan.grid_budgets
    ]

    def call(hook):
        return generation.generate_grid(
            model, [prompt], cells, max_new_tokens=n, min_new_tokens=n, hook=hook
        )

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


def _linear_only(layers, x):
    """The prefill's linear layers alone: every layer over every chunk, summed."""

    def per_chunk(acc, xc):
        def per_layer(acc, lp):
            q, k, v = xc @ lp.wq, xc @ lp.wk, xc @ lp.wv
            mlp = (jax.nn.silu(xc @ lp.w_gate) * (xc @ lp.w_up)) @ lp.w_down
            return acc + jnp.sum(q @ lp.wo) + jnp.sum(mlp) + jnp.sum(k) + jnp.sum(v), None

        return jax.lax.scan(per_layer, acc, layers)[0], None

    return jax.lax.scan(per_chunk, jnp.zeros(()), x)[0]


def prefill_profile(
    model, tokens: int, new_tokens: int, chunk: int = prompts.DEFAULT_CHUNK
) -> dict:
    """Where one prefill's time goes (batch 1, `tokens` tokens, as `generate` runs it).

    Times, each compiled ahead and on random data of the prefill's own shapes: the linear
    layers alone (q, k, v, o, gate, up, down, chunk by chunk over every layer) and the library's
    `written_slot_attention` alone (chunk i's queries over the i + 1 written key blocks, which
    is what the chunked prefill computes); the rest of the prefill is norms, RoPE, cache
    writes and the LM head. (XLA's cost analysis does not see inside the prefill's scans.)
    """
    from dge_jax.kernels.attention import AttentionSpec, LayerCache, written_slot_attention

    cfg, params = model.config, model.params
    t = prompts.bucket_length(tokens, chunk)
    c = min(chunk, t)
    capacity = t + prompts.bucket_length(new_tokens, chunk)
    n = t // c
    hq, hkv, hd, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (n, 1, c, d), jnp.float32)

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
                layer = LayerCache.one(kv[0], kv[1], slot_pos)
                out, _ = written_slot_attention(
                    q[i], query_pos, layer, (i + 1) * c, AttentionSpec(key_block=c)
                )
                return acc + jnp.sum(out), None

            return jax.lax.scan(per_layer, acc, (k, v))[0], None

        return jax.lax.scan(per_chunk, jnp.zeros(()), jnp.arange(n))[0]

    def best(fn, *args):
        exe = jax.jit(fn).lower(*args).compile()
        return min(ed.timed(exe, *args)[0] for _ in range(2))

    linear_s = best(_linear_only, params.layers, x)
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
