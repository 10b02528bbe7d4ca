"""What eviction buys at decode time: per-token decode speed and cache bytes, full vs compacted.

    python -m benchmarks.eviction_decode            # Llama-3-8B attention, 8k prompts, batch 4
    python -m benchmarks.eviction_decode --quick    # ~20 s smoke run

Random weights with Llama-3-8B's attention geometry (32 query heads, 8 kv heads, head_dim 128)
on a small trunk (hidden 1024, MLP 3584, 2 layers, vocab 1024): the cache, not the weights,
dominates decode, as it does for a real 8B model at long context. SnapKV, DGE k=2, budget 512.

Every measured function is compiled ahead of time (`.lower().compile()`), so timings hold no
compilation; decode times are the median of several runs of a fixed number of steps (no EOS),
each ended by `block_until_ready`. Targets: decode >= 3x faster, cache bytes
<= 1/8 of full, scoring + selection + compaction <= 5 % of prefill.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dge_jax.config import ModelConfig, RopeConfig
from dge_jax.eviction.evict import SelectionInputs, SelectionSpec, select_for_budgets
from dge_jax.eviction.timing import Timing
from dge_jax.families import get_family
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime import decoding as gen
from dge_jax.runtime.compaction import compact
from dge_jax.runtime.selection import apply_keep
from dge_jax.text.sampling import Greedy

GREEDY = Greedy()
EOS_IDS: tuple[int, ...] = ()  # no EOS: every run decodes the same number of steps
STEPS = gen.StepSpec(GREEDY, EOS_IDS)  # every draft and decode step's settings
PREFILL_MEMORY = 8 << 30  # bytes allowed for one prefill chunk's attention intermediates
ATTN_COPIES = 4  # live [B, Hq, chunk, S] f32 buffers in one chunk's attention (scores, probs...)

TARGETS = {"decode speed-up": 3.0, "cache bytes ratio": 1 / 8, "eviction / prefill": 0.05}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.eviction_decode", description=__doc__)
    p.add_argument("--prompt_len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--budget", type=int, default=512, help="entries kept per kv head")
    p.add_argument("--new_tokens", type=int, default=34, help="answer tokens (k=2 drafted)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3584)
    p.add_argument("--window", type=int, default=32, help="SnapKV observation window")
    p.add_argument("--k", type=int, default=2, help="DGE: answer tokens generated with the "
                   "full cache before eviction (k-1 draft steps)")
    p.add_argument("--chunk", type=int, default=0, help="prefill chunk (0 = largest that fits)")
    p.add_argument("--runs", type=int, default=5, help="timed runs (median reported)")
    p.add_argument("--quick", action="store_true", help="small config for a ~20 s smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt_len, args.batch, args.budget, args.new_tokens = 1024, 1, 64, 18
        args.hidden, args.intermediate, args.runs = 256, 896, 3
    if args.budget >= args.prompt_len:
        p.error(f"--budget {args.budget} must be below --prompt_len {args.prompt_len}")
    if not 1 <= args.k < args.new_tokens:
        p.error("need 1 <= --k < --new_tokens")
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    """Llama-3-8B attention geometry (GQA 32/8, head_dim 128, RoPE theta 5e5) on a small trunk."""
    return ModelConfig(
        family="llama",
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0),
        max_position_embeddings=args.prompt_len + args.new_tokens,
    )


def prefill_chunk(cfg: ModelConfig, batch: int, prompt_len: int, capacity: int) -> int:
    """The largest power-of-two chunk dividing the prompt whose attention fits PREFILL_MEMORY.

    One chunk's scores are [B, Hq, chunk, S] f32 with S = capacity, a few of them live at once.
    """
    per_query = batch * cfg.num_heads * capacity * 4 * ATTN_COPIES
    chunk = 1
    while (
        chunk * 2 <= prompt_len
        and prompt_len % (chunk * 2) == 0
        and chunk * 2 * per_query <= PREFILL_MEMORY
    ):
        chunk *= 2
    return chunk


def timed(fn, *args, runs: int = 1, prepare=None) -> tuple[float, object]:
    """(median seconds over `runs`, last result); `prepare()` builds fresh args when given
    (for functions that donate their inputs), outside the timed region."""
    times, out = [], None
    for _ in range(runs):
        call_args = prepare() if prepare else args
        jax.block_until_ready(call_args)
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*call_args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def fresh(state: gen.DecodeState) -> tuple:
    return (jax.tree.map(jnp.copy, state),)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    command = ["python", "-m", "benchmarks.eviction_decode"]
    print("$ " + shlex.join(command + (sys.argv[1:] if argv is None else list(argv))))
    from models.llama_like import init_params

    cfg = model_config(args)
    fwd = get_family("llama").forward
    b, t, n_new = args.batch, args.prompt_len, args.new_tokens
    capacity = t + n_new
    chunk = args.chunk or prefill_chunk(cfg, b, t, capacity)
    rule, timing = SnapKV(window=args.window), Timing("dge", args.k)
    small = args.budget + n_new  # compacted capacity: budget + every token still to come
    print(
        f"device {jax.devices()[0].device_kind}; batch {b}, prompt {t}, {n_new} new tokens, "
        f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, "
        f"heads {cfg.num_heads}/{cfg.num_kv_heads} x {cfg.head_dim}; {rule}, "
        f"timing {timing.kind} k={timing.k}, "
        f"budget {args.budget}; prefill chunk {chunk}"
    )

    params = init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    lengths = jnp.full((b,), t, jnp.int32)
    key = jax.random.PRNGKey(0)

    # Prefill (compiled ahead, timed once: it is by far the longest step).
    compile_start = time.perf_counter()
    prefill = gen.prefill_prompt.lower(
        fwd,
        cfg,
        params,
        tokens,
        lengths,
        gen.PrefillSpec(capacity, chunk, rule.needs.recording),
    ).compile()
    compile_s = time.perf_counter() - compile_start
    t_prefill, pre = timed(prefill, params, tokens, lengths)

    # Draft k-1 steps with the full cache (DGE), then evict once.
    start = gen.start_state(pre.cache, GREEDY(pre.logits, key), lengths, n_new, EOS_IDS, key)
    state, drafts = gen.draft_tokens(fwd, cfg, params, start, STEPS, num_steps=timing.draft_steps)
    budget, observe = jnp.asarray(args.budget, jnp.int32), jnp.asarray(timing.observes_drafts)
    select_args = (state.cache, pre.obs, drafts, (budget,), SelectionInputs(observe))
    select = select_for_budgets.lower(*select_args, spec=SelectionSpec(rule)).compile()
    t_select, (keep,) = timed(select, *select_args, runs=args.runs)

    shrink = jax.jit(lambda cache, keep: compact(apply_keep(cache, keep), small))
    shrink = shrink.lower(state.cache, keep).compile()
    t_compact, small_cache = timed(shrink, state.cache, keep, runs=args.runs)
    kept = np.asarray(small_cache.num_kept())
    assert kept.max() <= args.budget, kept.max()

    # Decode the remaining tokens: full cache, masked cache (same shapes), compacted cache.
    steps = n_new - int(np.min(np.asarray(state.step)))
    variants = {
        "full": state,
        "masked": dataclasses.replace(state, cache=apply_keep(state.cache, keep)),
        "compacted": dataclasses.replace(state, cache=small_cache),
    }
    rows = {}
    for name, st in variants.items():
        lowered = gen.decode_loop.lower(fwd, cfg, params, st, STEPS)
        decode = lowered.compile()
        timed(decode, prepare=lambda st=st: (params, *fresh(st)))  # warm up
        seconds, out = timed(decode, runs=args.runs, prepare=lambda st=st: (params, *fresh(st)))
        assert (np.asarray(out.step) == n_new).all(), out.step
        rows[name] = (seconds / steps, st.cache.nbytes(), st.cache.capacity)

    t_evict = t_select + t_compact
    ratios = {
        "decode speed-up": rows["full"][0] / rows["compacted"][0],
        "cache bytes ratio": rows["compacted"][1] / rows["full"][1],
        "eviction / prefill": t_evict / t_prefill,
    }
    print()
    print("| cache | slots per head | bytes | decode ms / token |")
    print("|---|---:|---:|---:|")
    for name, (per_token, nbytes, slots) in rows.items():
        print(f"| {name} | {slots} | {nbytes / 2**20:,.1f} MiB | {per_token * 1e3:.2f} |")
    print()
    print("| step | ms |")
    print("|---|---:|")
    print(f"| prefill ({t} tokens x {b}, chunk {chunk}) | {t_prefill * 1e3:,.1f} |")
    print(f"| score + select (select_for) | {t_select * 1e3:.2f} |")
    print(f"| apply_keep + compact to {small} slots | {t_compact * 1e3:.2f} |")
    print(
        f"(prefill compile {compile_s:.1f} s, not counted; decode: median of {args.runs} runs "
        f"of {steps} steps)"
    )
    print()
    ok = {
        "decode speed-up": ratios["decode speed-up"] >= TARGETS["decode speed-up"],
        "cache bytes ratio": ratios["cache bytes ratio"] <= TARGETS["cache bytes ratio"],
        "eviction / prefill": ratios["eviction / prefill"] <= TARGETS["eviction / prefill"],
    }
    print(
        f"decode speed-up full/compacted: {ratios['decode speed-up']:.2f}x "
        f"(target >= 3x) {'ok' if ok['decode speed-up'] else 'MISSED'}"
    )
    print(
        f"cache bytes compacted/full: {ratios['cache bytes ratio']:.4f} = "
        f"1/{1 / ratios['cache bytes ratio']:.1f} (target <= 1/8) "
        f"{'ok' if ok['cache bytes ratio'] else 'MISSED'}"
    )
    print(
        f"eviction/prefill: {ratios['eviction / prefill'] * 100:.2f} % (target <= 5 %) "
        f"{'ok' if ok['eviction / prefill'] else 'MISSED'}"
    )
    return {"rows": rows, "ratios": ratios, "ok": ok}


if __name__ == "__main__":
    main()
