"""The peers' side of `benchmarks.peers.quantized_agreement`: kvpress's SnapKV on transformers'
plain and quantized caches, greedy, on given token ids.

Runs in the peers' virtual environment (torch, transformers, kvpress, optimum-quanto and the
standard library only; never dge_jax or jax):

    benchmarks/.peers/venv/bin/python benchmarks/peers/peer_quantized.py \
        --jobs JOBS.json --out OUT.json [--separate]

A job is {"id", "folder", "prompt": [ids], "press": null (FullKV) or {"name": "snapkv",
"window_size", "kernel_size"}, "budget": B (per kv head), "cache": null (a DynamicCache) or
{"backend": "quanto", "nbits": 4 | 2, ...QuantizedCache's other arguments}, "max_new_tokens",
"eos_ids"}. The prompt (one row, float32, sdpa attention) is prefilled into the cache under
``with press(model)`` (kvpress's own prefill: its forward hook compresses each layer right
after the layer's attention, `ratio_for` making ``int(k_len * (1 - ratio)) == B``; on a
`QuantizedCache` the hook dequantizes the layer, compresses and requantizes, kvpress's
`base_press.forward_hook`), then one token at a time at explicit positions, greedy, until an
id of `eos_ids` (kept, as dge_jax keeps it) or `max_new_tokens` ids: the same loop as
`peers.run_kvpress`, which kvpress's pipeline runs, stopping at EOS.

transformers' `QuantizedCache` (5.2) stores the prompt's keys and values quantized at its
first `update` and hands the prefill's attention the unquantized ones; from then on every
step reads the dequantized cache, its `residual_length` most recent entries in float until
they are requantized together. With optimum-quanto, ``nbits`` 4 or 2, ``axis_key`` /
``axis_value`` 0 and ``q_group_size`` 64 (the defaults), asymmetric min-max scales
(`MaxOptimizer`) over groups of 64 consecutive elements of the last axis: for a head size of
64 (SmolLM2) one scale and zero point per token per kv head, for keys and values alike.

Recorded per job: "tokens" (up to and including the first EOS), "kept" [L][Hkv][positions]
for a press (the same topk on the same scores as ScorerPress's `compress`, `peers.instrumented`),
the cache's kind, and the seconds the job took.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import peers  # noqa: E402  (benchmarks/peers/peers.py: this script's folder is on sys.path)


def job_result(job: dict, tokens: list, cache, start: float, kept: dict, **extra) -> dict:
    """One job's JSON answer: its id, tokens, cache type and seconds since `start`, the kept
    positions [L][Hkv][positions] when the press recorded any, and `extra` fields."""
    result = {"id": job["id"], "tokens": tokens, "cache": type(cache).__name__,
              "seconds": time.perf_counter() - start, **extra}  # fmt: skip
    if kept:
        result["kept"] = [kept[layer][0] for layer in sorted(kept)]
    return result


def make_cache(model, spec: dict | None):
    """A DynamicCache, or transformers' QuantizedCache built from `spec` (its arguments)."""
    from transformers import DynamicCache, QuantizedCache

    if spec is None:
        return DynamicCache()
    return QuantizedCache(config=model.config, **spec)


def make_press(spec: dict, ratio: float):
    """kvpress's SnapKVPress with the spec's window and kernel at `ratio`."""
    import kvpress

    if spec["name"] != "snapkv":
        raise ValueError(f"unknown press {spec['name']!r}")
    args = {k: v for k, v in spec.items() if k != "name"}
    return kvpress.SnapKVPress(compression_ratio=ratio, **args)


def decode_until_eos(model, cache, token, k_len: int, n: int, eos: set[int]) -> list[int]:
    """One row's ids: `token` (from the prefill's logits), then one token at a time over
    `cache` at positions k_len, k_len + 1, ... until an id in `eos` or n ids."""
    import torch

    out_ids = [int(token)]
    for i in range(n - 1):
        if out_ids[-1] in eos:
            break
        out = model(
            input_ids=torch.tensor([[out_ids[-1]]]),
            past_key_values=cache,
            position_ids=torch.tensor([[k_len + i]]),
        )
        out_ids.append(int(out.logits[0, -1].float().argmax()))
    return out_ids


def run_job(job: dict) -> dict:
    """Prefill (under the press, if any) into the job's cache, then greedy until EOS."""
    import torch

    model = peers.load_model(job["folder"])
    ids = torch.tensor([job["prompt"]], dtype=torch.long)
    k_len = ids.shape[1]
    start = time.perf_counter()
    kept: dict[int, list] = {}
    with torch.inference_mode():
        cache = make_cache(model, job.get("cache"))
        if job.get("press") is None:
            out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
        else:
            press = make_press(job["press"], peers.ratio_for(k_len, job["budget"]))
            with peers.instrumented(press, kept, []), press(model):
                out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
        token = out.logits[0, -1].float().argmax()
        tokens = decode_until_eos(
            model, cache, token, k_len, job["max_new_tokens"], set(job["eos_ids"])
        )
    return job_result(job, tokens, cache, start, kept)


def run_shared(jobs: list[dict]) -> list[dict]:
    """The jobs of one prompt from one prefill: the same results as `run_job` on each.

    The prefill's forward does not depend on the cache kind or the press: transformers'
    `QuantizedCache` hands the prefill's attention the unquantized keys and values, and
    kvpress's hook only rewrites the cache after each layer's attention. So the prompt is
    prefilled once into a DynamicCache, recording each attention layer's hook arguments;
    then per job a fresh cache of its kind gets each layer's keys and values through
    ``cache.update`` (the call the attention layer makes), the press's own `forward_hook`
    runs on each layer with the recorded arguments (kvpress's dequantize, compress,
    requantize), and the job decodes from the prefill's first token. `--separate` runs
    each job on its own prefill instead (`run_job`)."""
    import torch

    first = jobs[0]
    assert all(j["prompt"] == first["prompt"] and j["folder"] == first["folder"] for j in jobs)
    model = peers.load_model(first["folder"])
    ids = torch.tensor([first["prompt"]], dtype=torch.long)
    k_len = ids.shape[1]
    language_model = model.model
    attn = [layer.self_attn for layer in language_model.layers]
    recorded: list = [None] * len(attn)

    def record(module, args, kwargs, output):
        recorded[module.layer_idx] = (dict(kwargs), output)

    start = time.perf_counter()
    hooks = [m.register_forward_hook(record, with_kwargs=True) for m in attn]
    try:
        with torch.inference_mode():
            prefill_cache = make_cache(model, None)
            out = model(input_ids=ids, past_key_values=prefill_cache, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    token = out.logits[0, -1].float().argmax()
    prefill_s = time.perf_counter() - start
    entries = [(layer.keys, layer.values) for layer in prefill_cache.layers]
    results = []
    for job in jobs:
        start = time.perf_counter()
        kept: dict[int, list] = {}
        with torch.inference_mode():
            cache = make_cache(model, job.get("cache"))
            for i, (k, v) in enumerate(entries):
                cache.update(k, v, i)
            if job.get("press") is not None:
                press = make_press(job["press"], peers.ratio_for(k_len, job["budget"]))
                with peers.instrumented(press, kept, []), press(model):
                    for module, (kwargs, output) in zip(attn, recorded, strict=True):
                        press.forward_hook(module, [], kwargs | {"past_key_values": cache},
                                           output)  # fmt: skip
            tokens = decode_until_eos(
                model, cache, token, k_len, job["max_new_tokens"], set(job["eos_ids"])
            )
        result = job_result(job, tokens, cache, start, kept, shared_prefill_s=prefill_s)
        results.append(result)
    return results


def versions() -> dict:
    from importlib.metadata import version

    return peers.versions() | {"optimum-quanto": version("optimum-quanto")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--jobs", required=True, help="JSON file: {'jobs': [...]}")
    p.add_argument("--out", required=True, help="JSON file to write the results to")
    p.add_argument("--separate", action="store_true", help="one prefill per job (`run_job`)")
    args = p.parse_args(argv)
    with open(args.jobs) as f:
        jobs = json.load(f)["jobs"]
    start = time.perf_counter()
    groups: dict[str, list[dict]] = {}
    for job in jobs:  # one group per prompt, in order (--separate: one per job)
        groups.setdefault(job["id"] if args.separate else json.dumps(job["prompt"]), []).append(job)
    results = []
    for i, group in enumerate(groups.values()):
        done = [run_job(group[0])] if args.separate else run_shared(group)
        results += done
        print(
            f"[peer_quantized] {i + 1}/{len(groups)}: {len(done)} jobs "
            f"{time.perf_counter() - start:.0f} s, tokens {[len(r['tokens']) for r in done]}",
            file=sys.stderr,
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump(
            {"versions": versions(), "results": results, "wall_s": time.perf_counter() - start},
            f,
        )


if __name__ == "__main__":
    main()
