"""The peers' side of the benchmark: transformers `generate` (FullKV) and kvpress presses.

Runs inside the peers' virtual environment (`bash benchmarks/peers/setup_peers.sh`), never in
dge_jax's own: kvpress 0.5.5 needs transformers < 5.3. `python -m benchmarks.run` starts

    benchmarks/.peers/venv/bin/python benchmarks/peers/peers.py --serve

once and exchanges JSON lines with it (a job in, its figures out); `--jobs JOBS.json --out
OUT.json` runs a file of jobs by hand. Self-contained on purpose: it imports only torch,
transformers, kvpress, psutil and the standard library, never dge_jax or jax.

Every job loads its model folder (the same config.json + model.safetensors dge_jax loads) in
float32 once per process, feeds the given token ids (no tokenizer: both sides see identical
ids, all rows of a batch the same length, so no padding) and decodes greedily for exactly
`new_tokens` tokens, EOS banned (as `min_new_tokens == max_new_tokens`).

- "transformers": `model.generate` with the default (sdpa) attention and a DynamicCache.
  The time to first token is when the first logits processor call happens (right after the
  prefill forward); the per-step logit margins (top-1 minus top-2 of the processed scores)
  come back for the agreement report.
- "kvpress": kvpress's own prefill-then-greedy path (`KVPressTextGenerationPipeline._forward`
  and `generate_answer`), except that the press compresses the whole prompt: the prompt is
  prefilled under `with press(model)`, so the observation window is the prompt's last
  `window_size` queries (dge_jax's `prefill` timing), then the loop feeds one token at a time
  with explicit positions. `compression_ratio` is set so that `int(k_len * (1 - ratio))`
  equals the per-head budget. The press's `compress` is timed (eviction overhead), and for
  ScorerPress presses the kept positions per layer and kv head are recorded (same `topk` on
  the same scores, so the same entries kvpress keeps).
- "kvpress_decoding": kvpress's `DecodingPress` around `StreamingLLMPress`: nothing evicted
  at prefill, then every `interval` decode steps each layer goes back to `budget` entries
  (`benchmarks.decode_memory`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import threading
import time

import psutil

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

RSS_INTERVAL_S = 0.005


class RssSampler:
    """Peak resident set size of this process, sampled on a thread; `peak_since_mark`."""

    def __init__(self, interval: float = RSS_INTERVAL_S):
        self._proc = psutil.Process()
        self._interval = interval
        self._peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def mark(self) -> int:
        """Starts a new peak window; returns the current RSS in bytes."""
        now = self._proc.memory_info().rss
        self._peak = now
        return now

    def peak_since_mark(self) -> int:
        return max(self._peak, self._proc.memory_info().rss)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


_MODELS: dict[str, object] = {}


def load_model(folder: str):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    if folder not in _MODELS:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model.eval()
        _MODELS[folder] = model
    return _MODELS[folder]


def cache_bytes(cache) -> int:
    """Bytes of the keys and values held by a transformers cache."""
    import torch

    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def margins(scores) -> list[float]:
    """[B] top-1 minus top-2 of processed scores (EOS banned shows as -inf, never chosen)."""
    import torch

    top = torch.topk(scores.float(), 2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def run_transformers(job: dict, rss: RssSampler) -> dict:
    """FullKV: `model.generate`, greedy, exactly `new_tokens` tokens."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    model = load_model(job["folder"])
    ids = torch.tensor(job["prompts"], dtype=torch.long)
    n = job["new_tokens"]
    eos = job["eos_ids"] or None
    first_call: list[float] = []

    class FirstCall(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not first_call:
                first_call.append(time.perf_counter())
            return scores

    base = rss.mark()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            num_beams=1,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else 0,
            logits_processor=LogitsProcessorList([FirstCall()]),
            output_scores=True,
            return_dict_in_generate=True,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    total = time.perf_counter() - start
    peak = rss.peak_since_mark()
    ttft = first_call[0] - start
    tokens = out.sequences[:, ids.shape[1] :].tolist()
    step_margins = [margins(s) for s in out.scores]  # [steps][B]
    return {
        "tokens": tokens,
        "margins": [[m[b] for m in step_margins] for b in range(ids.shape[0])],
        "e2e_s": total,
        "ttft_s": ttft,
        "prefill_s": ttft,
        "decode_s": total - ttft,
        "decode_steps": n - 1,
        "evict_s": None,
        "cache_bytes": cache_bytes(out.past_key_values),
        "peak_rss": peak,
        "rss_base": base,
    }


def make_press(name: str, ratio: float, window: int | None):
    import kvpress

    if name == "snapkv":
        return kvpress.SnapKVPress(
            compression_ratio=ratio, **({"window_size": window} if window else {})
        )
    if name == "pyramidkv":
        return kvpress.PyramidKVPress(
            compression_ratio=ratio, **({"window_size": window} if window else {})
        )
    if name == "streamingllm":
        return kvpress.StreamingLLMPress(compression_ratio=ratio)
    raise ValueError(f"unknown press {name!r}")


def ratio_for(k_len: int, budget: int) -> float:
    """compression_ratio with int(k_len * (1 - ratio)) == budget (half an entry of slack)."""
    return (k_len - budget - 0.5) / k_len


@contextlib.contextmanager
def instrumented(press, kept: dict, timer: list[float], gaps: dict | None = None):
    """Times every `compress` call and records the kept positions per layer (ScorerPress),
    and in `gaps` per layer [B][Hkv] the relative score gap at the budget boundary: (last
    kept - first evicted) / |last kept|, to tell a near-tie from a real disagreement."""
    from kvpress.presses.scorer_press import ScorerPress

    compress, score = press.compress, getattr(press, "score", None)
    last_scores: list = []  # the latest score tensor

    def timed_score(*args, **kwargs):
        out = score(*args, **kwargs)
        last_scores[:] = [out]
        return out

    def timed_compress(module, hidden_states, keys, values, attentions, kwargs):
        start = time.perf_counter()
        k_len = keys.shape[2]
        keys_out, values_out = compress(module, hidden_states, keys, values, attentions, kwargs)
        timer.append(time.perf_counter() - start)
        if isinstance(press, ScorerPress) and last_scores:
            # The same topk on the same scores as ScorerPress/PyramidKVPress.compress: the
            # same entries (kept count = what compress kept).
            n_kept = keys_out.shape[2]
            idx = last_scores[0].topk(n_kept, dim=-1).indices.sort(dim=-1).values
            kept[module.layer_idx] = idx.tolist()  # [B][Hkv][n_kept]
            assert k_len >= n_kept
            if gaps is not None and k_len > n_kept:
                top = last_scores[0].float().topk(n_kept + 1, dim=-1).values
                last, first_out = top[..., -2], top[..., -1]
                gap = (last - first_out) / last.abs().clamp_min(1e-30)
                gaps[module.layer_idx] = gap.tolist()  # [B][Hkv]
        return keys_out, values_out

    press.compress = timed_compress
    if score is not None:
        press.score = timed_score
    try:
        yield
    finally:
        press.compress = compress
        if score is not None:
            press.score = score


def greedy_picker(eos_ids: list[int]):
    """logits [B, V] -> [B] argmax ids, with `eos_ids` banned (the jobs decode exactly N)."""
    import torch

    banned = torch.tensor(eos_ids, dtype=torch.long)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float().clone()
        if len(banned):
            logits[:, banned] = -float("inf")
        return logits.argmax(dim=-1)

    return pick


def decode_greedy(model, cache, token, k_len: int, n: int, pick) -> list[list[int]]:
    """[B][n] ids: `token` [B] (from the prefill logits), then n - 1 steps feeding one token
    at a time over `cache` at explicit positions k_len, k_len + 1, ... (a compressed cache's
    length no longer gives them)."""
    import torch

    generated = [token]
    positions = torch.full((token.shape[0], 1), k_len, dtype=torch.long)
    for i in range(n - 1):
        out = model(input_ids=token[:, None], past_key_values=cache, position_ids=positions + i)
        token = pick(out.logits[:, -1])
        generated.append(token)
    return torch.stack(generated, dim=1).tolist()


def run_kvpress(job: dict, rss: RssSampler) -> dict:
    """kvpress: compress the whole prompt during prefill, then greedy decode (its pipeline)."""
    import torch
    from transformers import DynamicCache

    model = load_model(job["folder"])
    ids = torch.tensor(job["prompts"], dtype=torch.long)
    b, k_len = ids.shape
    n = job["new_tokens"]
    pick = greedy_picker(job["eos_ids"])
    ratio = ratio_for(k_len, job["budget"])
    press = make_press(job["press"], ratio, job.get("window"))
    kept: dict[int, list] = {}
    gaps: dict[int, list] = {}
    compress_times: list[float] = []

    base = rss.mark()
    start = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache()
        with instrumented(press, kept, compress_times, gaps), press(model):
            out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
        token = pick(out.logits[:, -1])
        ttft = time.perf_counter() - start
        nbytes = cache_bytes(cache)
        generated = decode_greedy(model, cache, token, k_len, n, pick)
    total = time.perf_counter() - start
    peak = rss.peak_since_mark()
    result = {
        "tokens": generated,
        "e2e_s": total,
        "ttft_s": ttft,
        "prefill_s": ttft,
        "decode_s": total - ttft,
        "decode_steps": n - 1,
        "evict_s": sum(compress_times),
        "cache_bytes": nbytes,
        "peak_rss": peak,
        "rss_base": base,
        "compression_ratio": ratio,
    }
    if job.get("record_kept") and kept:
        # [B][L][Hkv][kept positions]: positions are cache indices = original positions.
        result["kept"] = [[kept[layer][r] for layer in sorted(kept)] for r in range(b)]
        if gaps:
            result["boundary_gap"] = [[gaps[layer][r] for layer in sorted(gaps)] for r in range(b)]
    return result


def warm_up(folder: str) -> None:
    """One short generate, so that first-call costs (allocator, kernels) are not timed."""
    import torch

    model = load_model(folder)
    ids = torch.arange(1, 33, dtype=torch.long)[None, :]
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
        )


def versions() -> dict:
    import kvpress
    import torch
    import transformers

    try:
        from importlib.metadata import version

        kvpress_version = version("kvpress")
    except Exception:  # pragma: no cover - metadata missing
        kvpress_version = getattr(kvpress, "__version__", "?")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvpress": kvpress_version,
        "torch_threads": torch.get_num_threads(),
    }


def run_kvpress_decoding(job: dict, rss: RssSampler) -> dict:
    """kvpress `DecodingPress`: the prompt prefilled whole, then every `interval` decode steps
    the base press (StreamingLLMPress, 4 sinks) compresses each layer back to `budget`
    entries per head; greedy, EOS banned, explicit positions (as `run_kvpress`)."""
    import torch
    from kvpress import DecodingPress, StreamingLLMPress
    from transformers import DynamicCache

    model = load_model(job["folder"])
    ids = torch.tensor(job["prompts"], dtype=torch.long)
    k_len = ids.shape[1]
    n = job["new_tokens"]
    pick = greedy_picker(job["eos_ids"])
    press = DecodingPress(
        base_press=StreamingLLMPress(n_sink=4), compression_interval=job["interval"],
        target_size=job["budget"], hidden_states_buffer_size=0,
    )  # fmt: skip

    base = rss.mark()
    start = time.perf_counter()
    with torch.inference_mode(), press(model):
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
        token = pick(out.logits[:, -1])
        ttft = time.perf_counter() - start
        generated = decode_greedy(model, cache, token, k_len, n, pick)
    total = time.perf_counter() - start
    return {
        "tokens": generated,
        "e2e_s": total,
        "ttft_s": ttft,
        "prefill_s": ttft,
        "decode_s": total - ttft,
        "decode_steps": n - 1,
        "evict_s": None,
        "cache_bytes": cache_bytes(cache),
        "peak_rss": rss.peak_since_mark(),
        "rss_base": base,
    }


RUNNERS = {
    "transformers": run_transformers, "kvpress": run_kvpress,
    "kvpress_decoding": run_kvpress_decoding,
}  # fmt: skip


def run_job(job: dict, rss: RssSampler, warmed: set[str]) -> dict:
    """Loads (and warms up, once per folder) the job's model, runs it, returns its figures."""
    start = time.perf_counter()
    load_model(job["folder"])
    if job["folder"] not in warmed:
        warm_up(job["folder"])
        warmed.add(job["folder"])
    setup_s = time.perf_counter() - start
    result = RUNNERS[job["system"]](job, rss)
    result |= {"id": job["id"], "system": job["system"], "setup_s": setup_s}
    print(
        f"[peers] {job['id']}: {result['e2e_s']:.2f} s (prefill {result['prefill_s']:.2f} s)",
        file=sys.stderr,
        flush=True,
    )
    return result


def serve() -> None:
    """Worker mode: a first line {"versions": ...}, then one JSON job per stdin line answered
    by one JSON result line on stdout (everything else the libraries print goes to stderr).

    `benchmarks.run` keeps one worker for the whole run and sends it each configuration's
    jobs right after timing dge_jax on it, so both sides are measured minutes apart, under
    the same machine load, and the models load once.
    """
    out, sys.stdout = sys.stdout, sys.stderr
    rss, warmed = RssSampler(), set()
    out.write(json.dumps({"versions": versions(), "pid": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        if line.strip():
            out.write(json.dumps(run_job(json.loads(line), rss, warmed)) + "\n")
            out.flush()
    rss.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--serve", action="store_true", help="worker mode: JSON lines on stdin/out")
    p.add_argument("--jobs", help="JSON file: {'jobs': [...]}")
    p.add_argument("--out", help="JSON file to write the results to")
    args = p.parse_args(argv)
    if args.serve:
        serve()
        return
    if not (args.jobs and args.out):
        p.error("give --serve, or --jobs and --out")
    with open(args.jobs) as f:
        spec = json.load(f)
    rss, warmed = RssSampler(), set()
    start = time.perf_counter()
    results = [run_job(job, rss, warmed) for job in spec["jobs"]]
    rss.close()
    with open(args.out, "w") as f:
        json.dump(
            {
                "versions": versions(),
                "results": results,
                "wall_s": time.perf_counter() - start,
                "pid": os.getpid(),
            },
            f,
        )


if __name__ == "__main__":
    main()
