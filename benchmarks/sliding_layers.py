"""Local and global layers on CPU: what a Gemma-3-shaped model's cache holds per layer type, and
its prefill and decode speed beside a Llama of the same widths.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.sliding_layers [--window 256]

Random weights (no quality is measured: a tiny random model says nothing about accuracy). Both
models: 6 layers, hidden 256, 4 query heads over 1 kv head of 64, vocab 512; the Gemma one
with Gemma 3's switches (five sliding layers of `--window` keys, then one global layer; local
and global RoPE; q/k norms; sandwich norms; GeGLU). A prompt of 8 windows, batch 1, three
cells, each in its own grid: FullKV, SnapKV at prefill and DGE-SnapKV (k=2), budget
`--budget`, compacted. The Gemma model runs twice: with its sliding layers at the prompt's
length (`sliding_cache="full"`) and holding their window plus one prefill step ("bounded",
`dge_jax.runtime.window_cache`). Prints each cell's slots per layer after eviction (sliding
layers keep the window, global layers the budget), prefill's cache (slots per layer, MiB),
and per run the warm times of the prefill stage and of each cell's decode stage per token,
medians of `--runs` grids.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import jax
import numpy as np

import dge_jax
from dge_jax.config import ModelConfig, RopeConfig
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import dge, prefill
from dge_jax.families import get_family
from dge_jax.model import Model
from dge_jax.rules.snapkv import SnapKV
from models.llama_like import init_params

WIDTHS = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=6,
              num_heads=4, num_kv_heads=1, head_dim=64, max_position_embeddings=32768)  # fmt: skip


def models(window: int) -> dict[str, Model]:
    """The Llama and the Gemma-3-shaped model, seeded random weights."""
    llama = ModelConfig(family="llama", **WIDTHS)
    gemma = ModelConfig(
        family="gemma3_text", **WIDTHS, layer_windows=(window,) * 5 + (0,),
        rope=RopeConfig(theta=1e6), local_rope=RopeConfig(theta=1e4), attn_scale=64**-0.5,
        embed_scale=True, norm_offset=True, sandwich_norms=True, hidden_act="gelu_tanh",
        qk_norm=True, tie_word_embeddings=True,
    )  # fmt: skip
    out = {}
    for cfg in (llama, gemma):
        params = init_params(cfg, jax.random.PRNGKey(0), scale=0.1)
        out[cfg.family] = Model(get_family(cfg.family), cfg, params, tokenizer=None)
    return out


def run_grid(model: Model, prompt: list[int], cells, new: int, layout: str = "auto"):
    """One grid; returns (stage -> [seconds], (slots per layer, most kept per head per
    layer) of each evicted cache, the full cache's slots per layer)."""
    times: dict[str, list[float]] = collections.defaultdict(list)
    evicted, full = [], []

    def hook(stage, fn, *args, **kwargs):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        times[stage].append(time.perf_counter() - start)
        # summaries now: decoding donates (deletes) these caches
        if stage == "apply_eviction":
            evicted.append((out.capacities, np.asarray(out.num_kept()).max(axis=(1, 2))))
        if stage == "prefill":
            full.append((out.cache.capacities, out.cache.nbytes()))
        return out

    dge_jax.generate_grid(model, [prompt], cells, max_new_tokens=new, min_new_tokens=new,
                          hook=hook, sliding_cache=layout)  # fmt: skip
    return times, evicted, full[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    prompt_len = 8 * args.window
    prompt = np.random.default_rng(0).integers(3, WIDTHS["vocab_size"], prompt_len).tolist()
    cells = [None, Eviction(SnapKV(), budget=args.budget, timing=prefill()),
             Eviction(SnapKV(), budget=args.budget, timing=dge(2))]  # fmt: skip
    names = ["FullKV", "SnapKV prefill", "DGE-SnapKV k=2"]
    print(f"prompt {prompt_len} tokens (8 windows of {args.window}), budget {args.budget}, "
          f"{args.new_tokens} new tokens, batch 1, CPU, medians of {args.runs} warm grids")
    rows = {}
    built = models(args.window)
    gemma = built["gemma3_text"]
    runs_of = [("llama", built["llama"], "auto"), ("gemma3_text full", gemma, "full"),
               ("gemma3_text bounded", gemma, "bounded")]  # fmt: skip
    for label, model, layout in runs_of:
        prefill_s, decode = [], []
        for name, cell in zip(names, cells, strict=True):
            # one grid per cell: cells of one cache shape would decode as one batch
            run_grid(model, prompt, [cell], args.new_tokens, layout)  # compile
            runs = [run_grid(model, prompt, [cell], args.new_tokens, layout)
                    for _ in range(args.runs)]  # fmt: skip
            _, evicted, (slots, nbytes) = runs[0]
            if cell is None:
                print(f"\n{label}: prefill cache slots per layer {slots}, {nbytes / 2**20:.2f} MiB")
                prefill_s = statistics.median(t["prefill"][0] for t, _, _ in runs)
            else:
                slots, kept = evicted[0]
                print(f"  {name}: slots per layer {slots}, most kept per head {kept.tolist()}")
            decode.append(statistics.median(t["decode"][0] for t, _, _ in runs) / args.new_tokens)
        rows[label] = (prefill_s, decode)
    print("\n| run | prefill (s) | " + " | ".join(f"decode {n} (ms/token)" for n in names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for label, (prefill_s, decode) in rows.items():
        cols = " | ".join(f"{1e3 * d:.2f}" for d in decode)
        print(f"| {label} | {prefill_s:.3f} | {cols} |")
    lp, ld = rows["llama"]
    for label in ("gemma3_text full", "gemma3_text bounded"):
        gp, gd = rows[label]
        ratios = " | ".join(f"{g / max(x, 1e-12):.2f}" for g, x in zip(gd, ld, strict=True))
        print(f"| {label} / llama | {gp / lp:.2f} | {ratios} |")


if __name__ == "__main__":
    main()
