"""The peers' side of `benchmarks.peers.rule_agreement`: which entries kvpress's presses keep.

Runs in the peers' virtual environment (torch, transformers, kvpress and the standard library
only; never dge_jax or jax):

    benchmarks/.peers/venv/bin/python benchmarks/peers/peer_rules.py --jobs JOBS.json --out OUT.json
    benchmarks/.peers/venv/bin/python benchmarks/peers/peer_rules.py --tiny FOLDER

A job is {"id", "folder", "prompt": [ids], "budget": B, "press": spec}; a press spec is
{"name": ...} plus the press's fields, wrappers with an "inner" spec (`build_press`). Each
job's prompt (one row, float32, sdpa attention) is prefilled under ``with press(model)``
with ``compression_ratio = ratio_for(len(prompt), B)``; the jobs of one prompt share one
prefill, each press's hook compressing the full cache in turn (`run_shared`; `--separate`:
one prefill per job, the same results). Recorded per layer and kv head:

- "kept": the original positions held after the press's ``compress``. Presses that drop
  entries gather the kept key rows, so each output row is matched, by exact equality, to
  its index among the input rows of its head; AdaKV-style presses keep every row and list
  the evicted ones in ``module.masked_key_indices``, so kept is the complement.
- "gap": the smallest relative score gap (last kept - first evicted) / |last kept| over the
  decisions the press takes for that head, from the scores it computed (`boundary_gaps`):
  a differing head with a gap ~1e-6 is a float near-tie; 0 is an exact tie.

KVzip jobs (press {"name": "kvzip", "chunk_size", "layerwise", "n_sink"}, for
`benchmarks.peers.kvzip_agreement`) run one prefill each (`run_kvzip`): ``KVzipPress`` is its own
context manager, repeating the context over the cache after the block and listing the
evicted entries in ``module.masked_key_indices``. Its ratio is `kvzip_ratio` (kvpress prunes
``int(n * ratio)`` of a pool of n entries: every layer's and head's, or one layer's with
``layerwise``); the result also holds kvpress's scores [L][Hkv][S] (sinks at its max + 1).
With ``"prefix_length": 0`` in the spec, the press repeats the whole prompt even when the
tokenizer has a chat template (kvpress otherwise skips the template prefix's length).

`--tiny FOLDER` writes the seeded random Llama the benchmark uses (safetensors); with
`--tokenizer-from FOLDER`, its vocabulary is that folder's and that folder's tokenizer files
are copied beside it (a chat template and instruction ids that kvpress's KVzip can read).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

TINY_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    initializer_range=0.1,
)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def build_tiny(folder: str, seed: int = 0, tokenizer_from: str | None = None) -> None:
    """Saves a seeded random Llama (`TINY_CONFIG`) to `folder` with `save_pretrained`.

    tokenizer_from: a model folder whose vocabulary size and special token ids the tiny
    model takes, and whose tokenizer files (`TOKENIZER_FILES`, those present) are copied in.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = dict(TINY_CONFIG)
    if tokenizer_from:
        with open(os.path.join(tokenizer_from, "config.json")) as f:
            source = json.load(f)
        config["vocab_size"] = source["vocab_size"]
        config.update({k: source[k] for k in SPECIAL_IDS if source.get(k) is not None})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config)).eval()
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES if tokenizer_from else ():
        if os.path.isfile(os.path.join(tokenizer_from, name)):
            shutil.copy(os.path.join(tokenizer_from, name), os.path.join(folder, name))


_MODELS: dict[str, Any] = {}


def load_model(folder: str) -> Any:
    """The folder's causal LM in float32 (cached per process)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if folder not in _MODELS:
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="sdpa"
        )
        _MODELS[folder] = model.eval()
    return _MODELS[folder]


def ratio_for(k_len: int, budget: int) -> float:
    """compression_ratio with int(k_len * (1 - ratio)) == budget (half an entry of slack)."""
    return (k_len - budget - 0.5) / k_len


def build_press(spec: dict) -> Any:
    """A kvpress press from a spec such as {"name": "chunkkv", "chunk_length": 20,
    "inner": {"name": "snapkv", "window_size": 32}}; the ratio is set by the caller."""
    import kvpress

    fields = {k: v for k, v in spec.items() if k not in ("name", "inner")}
    simple = {
        "keydiff": kvpress.KeyDiffPress,
        "lagkv": kvpress.LagKVPress,
        "expected_attention": kvpress.ExpectedAttentionPress,
        "snapkv": kvpress.SnapKVPress,
    }
    if spec["name"] in simple:
        return simple[spec["name"]](**fields)
    wrappers = {
        "criticalkv": kvpress.CriticalKVPress,
        "chunkkv": kvpress.ChunkKVPress,
        "adakv": kvpress.AdaKVPress,
        "criticaladakv": kvpress.CriticalAdaKVPress,
    }
    return wrappers[spec["name"]](press=build_press(spec["inner"]), **fields)


def rel_gap(last: torch.Tensor, first_out: torch.Tensor) -> torch.Tensor:
    """(last kept - first evicted) / |last kept|, elementwise; 0 for equal scores (+inf
    too), 1 below an infinite last kept score."""
    gap = (last - first_out) / last.abs().clamp_min(1e-30)
    gap = torch.where(torch.isinf(last), torch.ones_like(gap), gap)
    return torch.where(last == first_out, torch.zeros_like(gap), gap)


def topk_gap(scores: torch.Tensor, n: torch.Tensor | int) -> torch.Tensor:
    """[..., S] scores, keep the top n (per row, or one n): the relative boundary gap [...]."""
    ordered = scores.sort(dim=-1, descending=True).values
    n = torch.as_tensor(n).expand(scores.shape[:-1]).clamp(1, scores.shape[-1] - 1)
    last = ordered.gather(-1, (n - 1)[..., None])[..., 0]
    first_out = ordered.gather(-1, n[..., None])[..., 0]
    return rel_gap(last, first_out)


def safeguard(scores: torch.Tensor, n_kept: int, alpha: float) -> tuple[torch.Tensor, int]:
    """AdaKV's floor: each head's top int(n_kept * alpha) scores raised to the dtype's max."""
    n_safe = int(n_kept * alpha)
    if alpha > 0:
        n_safe = max(1, n_safe) if n_kept > 0 else 0
    raised = scores.clone()
    raised.scatter_(-1, raised.topk(n_safe, dim=-1).indices, torch.finfo(raised.dtype).max)
    return raised, n_safe


def boundary_gaps(press: Any, scores: torch.Tensor, values: torch.Tensor, module: Any) -> list:
    """[Hkv] smallest relative boundary gap of the press's decisions for each head (row 0).

    scores: what the (inner) scorer returned, [1, Hkv, S]. ScorerPress (CriticalKVPress
    included: its score is the final one) keeps the top n_kept per head; ChunkKVPress the top
    chunks by score summed over heads and averaged over the chunk (one gap for the layer);
    AdaKVPress the top Hkv * n_kept of the safeguarded scores over all heads (and the
    safeguard itself, per head); CriticalAdaKVPress that head split, then per head its two
    CriticalKV stages, replayed here as kvpress computes them.
    """
    import kvpress
    from kvpress.presses.criticalkv_press import CriticalKVPress

    scores = scores.float()
    h, k_len = scores.shape[1], scores.shape[2]
    n_kept = int(k_len * (1 - press.compression_ratio))
    if isinstance(press, kvpress.ChunkKVPress):
        c = press.chunk_length
        full, rest = k_len // c, k_len % c
        chunks = scores[0, :, : full * c].sum(dim=0).view(full, c).mean(dim=-1)
        if rest:
            chunks = torch.cat([chunks, scores[0, :, -rest:].sum(dim=0).mean()[None]])
        n_chunks = max(1, int(len(chunks) * (1 - press.compression_ratio)))
        return [float(topk_gap(chunks, n_chunks))] * h
    if isinstance(press, kvpress.AdaKVPress | kvpress.CriticalAdaKVPress):
        raised, n_safe = safeguard(scores, n_kept, press.alpha_safeguard)
        top = raised.reshape(-1).topk(n_kept * h).indices // k_len
        budgets = torch.bincount(top, minlength=h)  # per head
        gaps = topk_gap(raised.reshape(1, -1), n_kept * h).expand(h)
        # The floor decides a head's entries only where the head got no more than it.
        floor = topk_gap(scores[0], n_safe)
        gaps = torch.where(budgets == n_safe, torch.minimum(gaps, floor), gaps)
        if isinstance(press, kvpress.CriticalAdaKVPress):
            first = (budgets * press.first_stage_ratio).long()
            # Stage 1 among raised entries (all kept anyway) decides nothing.
            big = torch.finfo(raised.dtype).max
            stage1_gap = topk_gap(raised[0], first)
            out_score = raised[0].sort(dim=-1, descending=True).values.gather(-1, first[:, None])
            gaps = torch.where(out_score[:, 0] >= big, gaps, torch.minimum(gaps, stage1_gap))
            stage1 = raised[0].clone()
            for head in range(h):
                stage1[head, stage1[head].topk(int(first[head])).indices] = big
            norm = CriticalKVPress.vwl1norm(values, module)[0].float()
            gaps = torch.minimum(gaps, topk_gap((stage1 + press.epsilon) * norm, budgets))
        return gaps.tolist()
    return topk_gap(scores[0], n_kept).tolist()


def kept_from_rows(keys: torch.Tensor, keys_out: torch.Tensor) -> list[list[int]]:
    """[Hkv][kept positions] of row 0: each output key row's index among the input rows of
    its head (gather copies rows exactly; each must equal exactly one input row)."""
    equal = (keys_out[0][:, :, None, :] == keys[0][:, None, :, :]).all(dim=-1)  # [H, out, S]
    if not bool((equal.sum(dim=-1) == 1).all()):
        raise ValueError("a kept key row equals no input row, or several")
    return equal.int().argmax(dim=-1).sort(dim=-1).values.tolist()


def kept_from_mask(module: Any, h: int, k_len: int) -> list[list[int]]:
    """[Hkv][kept positions] of row 0: the complement of ``module.masked_key_indices``."""
    masked = torch.zeros(h, k_len, dtype=torch.bool)
    _, heads, seqs = module.masked_key_indices
    masked[heads, seqs] = True
    return [torch.nonzero(~masked[head])[:, 0].tolist() for head in range(h)]


@contextlib.contextmanager
def recording(press: Any, kept: dict, gaps: dict) -> Iterator[None]:
    """Wraps the press's ``compress`` (and its scorer's ``score``) to fill kept and gaps per
    layer index with [Hkv] lists."""
    import kvpress

    masking = isinstance(press, kvpress.AdaKVPress | kvpress.CriticalAdaKVPress)
    scorer = press if isinstance(press, kvpress.CriticalKVPress) else getattr(press, "press", press)
    compress, score = press.compress, scorer.score
    last: list[torch.Tensor] = []

    def recorded_score(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = score(*args, **kwargs)
        last[:] = [out.detach().clone()]  # AdaKV presses raise entries in place
        return out

    def recorded_compress(module, hidden_states, keys, values, attentions, kwargs):
        module.masked_key_indices = None
        keys_out, values_out = compress(module, hidden_states, keys, values, attentions, kwargs)
        h, k_len = keys.shape[1], keys.shape[2]
        if masking:
            kept[module.layer_idx] = kept_from_mask(module, h, k_len)
        else:
            kept[module.layer_idx] = kept_from_rows(keys, keys_out)
        if last:
            gaps[module.layer_idx] = boundary_gaps(press, last[0], values, module)
        return keys_out, values_out

    press.compress, scorer.score = recorded_compress, recorded_score
    try:
        yield
    finally:
        press.compress, scorer.score = compress, score


def result(job: dict, kept: dict, gaps: dict) -> dict:
    """A job's result: kept positions and gaps [L][Hkv] (gaps None without scores)."""
    return {
        "id": job["id"],
        "kept": [kept[layer] for layer in sorted(kept)],
        "gap": [gaps[layer] for layer in sorted(gaps)] if gaps else None,
    }


def make_press(job: dict) -> Any:
    """The job's press at the ratio that keeps its budget."""
    press = build_press(job["press"])
    press.compression_ratio = ratio_for(len(job["prompt"]), job["budget"])
    return press


def run_job(job: dict) -> dict:
    """Prefills the job's prompt under its press, alone (`--separate`)."""
    from transformers import DynamicCache

    model = load_model(job["folder"])
    press, kept, gaps = make_press(job), {}, {}
    with torch.inference_mode(), recording(press, kept, gaps), press(model):
        ids = torch.tensor([job["prompt"]], dtype=torch.long)
        model(input_ids=ids, past_key_values=DynamicCache(), logits_to_keep=1)
    return result(job, kept, gaps)


def run_shared(jobs: list[dict]) -> list[dict]:
    """Jobs of one folder and prompt in one prefill: every press's own hook, in turn.

    Before each press's forward hook (registered by ``press(model)`` as usual) a hook puts
    the layer's full keys and values back into the cache, so each press compresses what a
    prefill of its own would give it: a press's hook changes only the cache, which nothing
    later in the prefill reads.
    """
    from transformers import DynamicCache

    model = load_model(jobs[0]["folder"])
    attention = [layer.self_attn for layer in model.model.layers]
    full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # A press's hook replaces the cache's tensors (never writes into them), so the full
    # ones can be put back as they are (`--separate` gives the same results).
    def save(module, args, kwargs, output) -> None:
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        full[module.layer_idx] = (layer.keys, layer.values)

    def restore(module, args, kwargs, output) -> None:
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        layer.keys, layer.values = full[module.layer_idx]

    records = []
    with torch.inference_mode(), contextlib.ExitStack() as stack:
        for i, job in enumerate(jobs):
            for module in attention:
                hook = restore if i else save
                stack.callback(module.register_forward_hook(hook, with_kwargs=True).remove)
            press, kept, gaps = make_press(job), {}, {}
            stack.enter_context(recording(press, kept, gaps))
            stack.enter_context(press(model))
            records.append((job, kept, gaps))
        ids = torch.tensor([jobs[0]["prompt"]], dtype=torch.long)
        model(input_ids=ids, past_key_values=DynamicCache(), logits_to_keep=1)
    return [result(*record) for record in records]


def kvzip_ratio(pool: int, kept: int) -> float:
    """compression_ratio with int(pool * ratio) == pool - kept (half an entry of slack):
    KVzipPress prunes int(pool * ratio) of a pool of `pool` entries."""
    ratio = (pool - kept + 0.5) / pool
    if int(pool * ratio) != pool - kept:
        raise ValueError(f"no ratio prunes exactly {pool - kept} of {pool}")
    return ratio


def pool_gaps(scores: torch.Tensor, layerwise: bool, budget: int) -> list[list[float]]:
    """[L][Hkv] kvpress's relative boundary gap of each head's pool: its layer's Hkv * B
    top scores (layerwise), or every layer's L * Hkv * B (global), one gap per pool."""
    n_layers, h = scores.shape[0], scores.shape[2]
    if layerwise:
        gaps = topk_gap(scores.reshape(n_layers, -1), h * budget)
        return [[float(g)] * h for g in gaps]
    gap = float(topk_gap(scores.reshape(1, -1), n_layers * h * budget)[0])
    return [[gap] * h for _ in range(n_layers)]


def run_kvzip(job: dict) -> dict:
    """One prefill under ``KVzipPress``, its reconstruction run after the block as kvpress
    does; kept = the complement of each layer's ``masked_key_indices``, and the scores
    ``compress_post`` ranked (kvpress's ``score_val``, sinks raised), [L][Hkv][S]."""
    from kvpress import KVzipPress
    from transformers import DynamicCache

    # Its overhead warning, once per press.
    logging.getLogger("kvpress.presses.kvzip_press").setLevel(logging.ERROR)
    model = load_model(job["folder"])
    spec = {k: v for k, v in job["press"].items() if k not in ("name", "prefix_length")}
    press = KVzipPress(**spec)
    cfg, n = model.config, len(job["prompt"])
    pool = cfg.num_key_value_heads * n * (1 if press.layerwise else cfg.num_hidden_layers)
    press.compression_ratio = kvzip_ratio(pool, pool * job["budget"] // n)
    seen: dict[str, Any] = {}
    compress_post, reconstruct = press.compress_post, press._perform_kvzip_compression

    def recorded_compress_post(model_: Any) -> None:
        compress_post(model_)
        seen["scores"] = press.score_val[:, 0].detach().clone()
        seen["prefix_length"] = press.prefix_length

    def reconstruct_from(model_: Any, tokenizer: Any) -> None:
        press.prefix_length = job["press"]["prefix_length"]
        reconstruct(model_, tokenizer)

    press.compress_post = recorded_compress_post
    if "prefix_length" in job["press"]:
        press._perform_kvzip_compression = reconstruct_from
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None
    with torch.inference_mode():
        with press(model):
            ids = torch.tensor([job["prompt"]], dtype=torch.long)
            model(input_ids=ids, past_key_values=DynamicCache(), logits_to_keep=1)
    h = cfg.num_key_value_heads
    kept = [kept_from_mask(layer.self_attn, h, n) for layer in model.model.layers]
    scores = seen["scores"]
    return {
        "id": job["id"], "kept": kept, "gap": pool_gaps(scores, press.layerwise, job["budget"]),
        "scores": scores.tolist(), "prefix_length": seen["prefix_length"],
        "ratio": press.compression_ratio,
    }  # fmt: skip


def versions() -> dict:
    """Library versions of this environment."""
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "kvpress")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--jobs", help="JSON file: {'jobs': [...]}")
    p.add_argument("--out", help="JSON file to write the results to")
    p.add_argument("--tiny", help="write the tiny random Llama to this folder and exit")
    p.add_argument(
        "--tokenizer-from", help="with --tiny: this model folder's vocabulary and tokenizer"
    )
    p.add_argument("--separate", action="store_true", help="one prefill per job, not per prompt")
    args = p.parse_args(argv)
    if args.tiny:
        build_tiny(args.tiny, tokenizer_from=args.tokenizer_from)
        return
    if not (args.jobs and args.out):
        p.error("give --tiny, or --jobs and --out")
    with open(args.jobs) as f:
        jobs = json.load(f)["jobs"]
    start = time.perf_counter()
    results = []
    for i, job in enumerate(j for j in jobs if j["press"]["name"] == "kvzip"):
        results.append(run_kvzip(job))
        print(f"[peer_rules] kvzip job {i + 1}: {job['id']}", file=sys.stderr, flush=True)
    jobs = [job for job in jobs if job["press"]["name"] != "kvzip"]
    if args.separate:
        results += [run_job(job) for job in jobs]
    else:
        groups: dict[tuple, list[dict]] = {}
        for job in jobs:
            groups.setdefault((job["folder"], tuple(job["prompt"])), []).append(job)
        for i, group in enumerate(groups.values()):
            results += run_shared(group)
            print(f"[peer_rules] prompt {i + 1}/{len(groups)}", file=sys.stderr, flush=True)
    with open(args.out, "w") as f:
        json.dump(
            {"versions": versions(), "results": results, "wall_s": time.perf_counter() - start},
            f,
        )


if __name__ == "__main__":
    main()
