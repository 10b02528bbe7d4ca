"""Decode-time compression: cache bytes, peak memory and decode speed against answer length.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.decode_memory \
        [--lengths 256,1024,4096] [--prompt_len 512] [--budget 128] [--interval 32] \
        [--peer-python benchmarks/.peers/venv/bin/python | --no-peers] [--quick]

For each model (the embedded SmolLM2-135M-Instruct, and the KV-dominated random-weight Llama
of the benchmarks: 2 layers, GQA 32/8 x 128, hidden 1024) and each answer length N, one
prompt of `--prompt_len` tokens, batch 1, greedy with EOS banned so every run generates
exactly N tokens:

- dge_jax FullKV: prefill into a cache of prompt + N slots, then `decoding.decode_loop`;
- dge_jax decode-time compression, timing "decode" (nothing evicted at prefill; every
  `--interval` new tokens back to `--budget` entries per kv head), StreamingLLM (4 sinks)
  and SnapKV (window 8, the block's queries observed);
- with the peers' venv: transformers `generate` (FullKV) and kvpress `DecodingPress` around
  `StreamingLLMPress` on the same weights, right after dge_jax on the same configuration.

Per run: the cache bytes at the end, the peak RSS above the process's RSS just before the
prefill (sampled every 5 ms: prefill's cache, then the decode), and decode tokens/s (N - 1
steps; dge_jax's loops are compiled ahead of the timed run). StreamingLLM's tokens are
compared with kvpress's: the two keep the same entries by definition, so equal tokens check
the loop end to end.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import log

PEERS_PYTHON = pathlib.Path(__file__).resolve().parent / ".peers" / "venv" / "bin" / "python"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--lengths", default="256,1024,4096", help="answer lengths N (tokens)")
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--budget", type=int, default=128, help="decode budget per kv head")
    p.add_argument("--interval", type=int, default=32, help="decode steps between compressions")
    p.add_argument("--models", default="embedded,kv", help="embedded and/or kv")
    p.add_argument("--peer-python", default=str(PEERS_PYTHON), help="the peers' venv python")
    p.add_argument("--no-peers", action="store_true", help="dge_jax only")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    p.add_argument("--quick", action="store_true", help="lengths 32,64, prompt 64: a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.prompt_len, args.budget, args.interval = "32,64", 64, 32, 8
    args.lengths = [int(n) for n in args.lengths.split(",")]
    return args


def load_models(names: list[str], folders: bool = True) -> dict:
    """name -> (Model, Hugging Face folder the peers load; None unless `folders`)."""
    import dge_jax
    from benchmarks.scenario_b import write_hf_folder
    from dge_jax.families import get_family
    from dge_jax.model import Model
    from models.llama_like import init_params

    out = {}
    if "embedded" in names:
        model = dge_jax.load(dge_jax.DEFAULT_MODEL)
        out["smollm2-135m"] = (model, model.path)
    if "kv" in names:
        from benchmarks import eviction_decode as ed

        cfg = ed.model_config(ed.parse_args(["--prompt_len", "8192", "--new_tokens", "4096"]))
        params = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
        folder = None
        if folders:  # the peers load the very same weights from it
            folder = pathlib.Path(tempfile.mkdtemp(prefix="dge_decode_memory_"))
            write_hf_folder(cfg, params, folder)
        out["kv-dominated"] = (Model(get_family("llama"), cfg, params, tokenizer=None), folder)
    return out


def prompt_ids(model, length: int) -> list[int]:
    """A fixed prompt of `length` ids: an essay passage for a model with a tokenizer, else
    seeded random ids."""
    if model.tokenizer is None:
        return np.random.default_rng(0).integers(3, model.config.vocab_size, length).tolist()
    from benchmarks.scenario_a import make_prompts

    return make_prompts(model.tokenizer, length, 1)[0]


def eos_of(model) -> tuple[int, ...]:
    return tuple(model.tokenizer.eos_ids) if model.tokenizer is not None else ()


def run_dge(model, prompt: list[int], n: int, rule, args, rss) -> dict:
    """One dge_jax run: FullKV (rule None) or decode-time compression with `rule`. The
    prefill cache holds prompt + N slots for FullKV, prompt + one interval (rounded as the
    pipeline rounds it, `grid_plan.GridPlan.room`) for compression."""
    from dge_jax.eviction import decode_compression
    from dge_jax.eviction.decode_spec import DecodeCompression
    from dge_jax.eviction.evict import SelectionSpec, round_up_slots
    from dge_jax.runtime import decoding
    from dge_jax.runtime.recorders import QueryWindow, Recording
    from dge_jax.text.sampling import Greedy

    cfg, params, eos = model.config, model.params, eos_of(model)
    tokens = jnp.asarray([prompt], jnp.int32)
    lengths = jnp.asarray([len(prompt)], jnp.int32)
    room = n if rule is None else round_up_slots(args.interval)
    chunk = 512 if len(prompt) % 512 == 0 else len(prompt)

    windowed = rule is not None and rule.needs.window

    def start():
        recording = Recording.of(*([QueryWindow(8)] if windowed else []))
        spec = decoding.PrefillSpec(len(prompt) + room, chunk, recording)
        pre = decoding.prefill_prompt(model.forward, cfg, params, tokens, lengths, spec)
        first = jnp.argmax(decoding.suppress_eos(pre.logits, eos, True), -1).astype(jnp.int32)
        return decoding.start_state(pre.cache, first, lengths, n, eos, jax.random.PRNGKey(0))

    statics = dict(sampler=Greedy(), eos_ids=eos, min_new_tokens=n)
    budget = jnp.int32(args.budget)
    if rule is None:
        steps = decoding.StepSpec(**statics)
        fn = decoding.decode_loop.lower(model.forward, cfg, params, start(), steps).compile()
        call = lambda s: fn(params, s)  # noqa: E731
    else:
        spec = DecodeCompression(args.budget, args.interval)
        loop = decode_compression.CompressionLoop(
            model.forward, cfg, selection=SelectionSpec(rule, head_cap=spec.head_cap()),
            interval=spec.interval, capacity=spec.capacity(), **statics,
        )  # fmt: skip
        fn = decode_compression.decode_compressed.lower(loop, params, start(), budget).compile()
        call = lambda s: fn(params, s, budget)[0]  # noqa: E731
    base = rss.mark()  # peak from here: the prefill's cache, then the decode
    state = jax.block_until_ready(start())
    t0 = time.perf_counter()
    out = jax.block_until_ready(call(state))
    seconds = time.perf_counter() - t0
    return {
        "tokens": np.asarray(out.tokens)[0, :n].tolist(),
        "decode_s": seconds,
        "tok_s": (n - 1) / seconds,
        "cache_bytes": out.cache.nbytes(),
        "peak_rss_above": rss.peak_since_mark() - base,
    }


def peer_jobs(folder, prompt: list[int], n: int, eos, args) -> list[dict]:
    common = {"folder": str(folder), "prompts": [prompt], "new_tokens": n, "eos_ids": list(eos)}
    return [
        {"id": f"transformers/{n}", "system": "transformers", **common},
        {"id": f"kvpress/{n}", "system": "kvpress_decoding", "budget": args.budget,
         "interval": args.interval, **common},
    ]  # fmt: skip


def agreement(a: list[int], b: list[int]) -> str:
    """'equal' or where two token streams first differ."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"differ from token {i}"
    return "equal"


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    from benchmarks.peers.peer_client import Peers
    from benchmarks.peers.peers import RssSampler
    from dge_jax.rules.snapkv import SnapKV
    from dge_jax.rules.streamingllm import StreamingLLM

    peers = None
    if not args.no_peers and pathlib.Path(args.peer_python).exists():
        peers = Peers(pathlib.Path(args.peer_python))
    elif not args.no_peers:
        log(f"{args.peer_python} is missing (bash benchmarks/peers/setup_peers.sh): dge_jax only")
    rss = RssSampler()
    rows = []
    rules = {"FullKV": None, "StreamingLLM": StreamingLLM(), "SnapKV w8": SnapKV(window=8)}
    for name, (model, folder) in load_models(args.models.split(","), peers is not None).items():
        prompt = prompt_ids(model, args.prompt_len)
        for n in args.lengths:
            mine = {}
            for label, rule in rules.items():
                mine[label] = run_dge(model, prompt, n, rule, args, rss)
                log(f"{name} N={n} dge_jax {label}: {mine[label]['tok_s']:.1f} tok/s")
                rows.append({"model": name, "new_tokens": n, "system": "dge_jax", "cell": label,
                             **{k: v for k, v in mine[label].items() if k != "tokens"}})
            if peers is not None:
                peers.run(peer_jobs(folder, prompt, n, eos_of(model), args))
                for system, label in (("transformers", "FullKV"), ("kvpress", "StreamingLLM")):
                    r = peers.results[f"{system}/{n}"]
                    rows.append({
                        "model": name, "new_tokens": n, "system": system, "cell": label,
                        "decode_s": r["decode_s"], "tok_s": r["decode_steps"] / r["decode_s"],
                        "cache_bytes": r["cache_bytes"],
                        "peak_rss_above": r["peak_rss"] - r["rss_base"],
                        "tokens_vs_dge_jax": agreement(r["tokens"][0], mine[label]["tokens"]),
                    })  # fmt: skip
    if peers is not None:
        peers.close()
    rss.close()
    print(table(rows, args))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


def table(rows: list[dict], args) -> str:
    """Markdown: one row per (model, N, system, cell), with ratios to dge_jax FullKV."""
    head = (f"prompt {args.prompt_len} tokens, batch 1, decode budget {args.budget}, interval "
            f"{args.interval}; peak RSS above the RSS before prefill; x = dge_jax FullKV's "
            "tok/s\n\n")
    lines = ["| model | N | system | cell | cache MiB | peak RSS MiB | tok/s | x FullKV | "
             "tokens vs dge_jax |", "|---|---|---|---|---|---|---|---|---|"]
    full = {(r["model"], r["new_tokens"]): r["tok_s"] for r in rows
            if r["system"] == "dge_jax" and r["cell"] == "FullKV"}
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['new_tokens']} | {r['system']} | {r['cell']} | "
            f"{r['cache_bytes'] / 2**20:.1f} | {r['peak_rss_above'] / 2**20:.0f} | "
            f"{r['tok_s']:.1f} | {r['tok_s'] / full[(r['model'], r['new_tokens'])]:.2f} | "
            f"{r.get('tokens_vs_dge_jax', '-')} |"
        )
    return head + "\n".join(lines)


if __name__ == "__main__":
    main()
