"""Agreement with kvpress: KVzip keeps the entries kvpress 0.5.5's ``KVzipPress`` keeps.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.peers.kvzip_agreement [--peer-python PY]

dge_jax runs `KVzip` through the pipeline (`generate_grid`, ``Timing("prefill", 1)``, its
reconstruct stage included) at budget B per kv head, allocated as kvpress allocates:
``head_budget="adakv", alpha=0.0`` (one pool of Hkv·B per layer, no floor) against
``KVzipPress(layerwise=True)``, and ``head_budget="global", alpha=0.0`` (one pool of L·Hkv·B)
against ``KVzipPress()`` (layerwise False, its default); kept = `GenerationResult.kept`.
`benchmarks/peers/peer_rules.py`, in the peers' venv, prefills the same token ids under the press,
which repeats the context after the block, and records the complement of each layer's
``masked_key_indices`` and the scores it ranked (`peer_rules.run_kvzip`); its ratio prunes
exactly the pool minus L·Hkv·B (or Hkv·B per layer). Both sides in float32, one prompt per
call. The reconstruct stage's scores are taken from the pipeline's hook, so the table also
gives how far dge_jax's scores are from kvpress's.

Models: the embedded SmolLM2-135M-Instruct (HF folder `dge_jax.load` converts) and a seeded
tiny random Llama with SmolLM2's vocabulary (49152) and tokenizer files copied in
(`peer_rules.py --tiny --tokenizer-from`: same chat template, same instruction ids), loaded
by dge_jax from the same safetensors folder. Prompts (token ids, fed to both sides):

- "chat": SmolLM2's chat template around the first LongBench hotpotqa context cut to 400
  tokens: its 24-token prefix (default system turn, user turn start), the context, the turn
  end and assistant start (6 tokens); 430 tokens, one reconstruct pass (chunk_size 2048);
- "chat, chunk 64": the template around multi_news's first context cut to 380 tokens (410),
  ``chunk_size=64`` on both sides: 386 context tokens after the prefix, 7 passes, the last
  one of 2 tokens;
- "no template": hotpotqa's context, 460 tokens, without the template. kvpress skips the
  template prefix's length (24 tokens) of any prompt; dge_jax only of a prompt that starts
  with the prefix. kvpress is run twice on it: as is, and with that length set to 0
  (``"prefix_length": 0``), where both sides repeat the whole prompt.

Without the LongBench files, seeded random ids stand in for the contexts.

Per row: where each side's context starts (the first position it repeats; the ones before
score 0, the sinks aside); heads kept identically / heads; for differing heads the largest
relative distance |s - t| / t, in kvpress's scores s, from its pool's threshold t (the
lowest score kvpress kept in that pool) of any entry only one side keeps (near-tie
evidence, `swap_gap`); the largest score difference, relative to the layer's largest score
(sinks aside).
"""

from __future__ import annotations

import json
import math
import pathlib
import random
import sys
import tempfile
import time

import numpy as np

import dge_jax
from benchmarks.peers import rule_agreement as ra
from benchmarks.peers.rule_agreement import Prompt, compare, fmt_gap, notes, run_peer
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import Timing
from dge_jax.rules.kvzip import KVzip, template_parts

PREFILL = Timing("prefill", 1)
SINKS = 4
BUDGETS = (64, 128)
ALLOCATIONS = {"layerwise": "adakv", "global": "global"}  # kvpress's -> dge_jax head_budget
DEFAULT_CHUNK = KVzip().chunk_size  # 2048, kvpress's default too
PLACEHOLDER = "\x00CONTENT\x00"


def template_ids(model: dge_jax.Model, content: list[int]) -> list[int]:
    """The chat template's ids around `content` (one user turn, assistant start), the
    rendered text split at a placeholder and each side tokenized alone."""
    before, after = model.tokenizer.apply_chat_template(PLACEHOLDER).split(PLACEHOLDER)
    encode = model.tokenizer.encode
    return (
        encode(before, add_special_tokens=False) + content + encode(after, add_special_tokens=False)
    )


def context_ids(
    model: dge_jax.Model, folder: pathlib.Path, name: str, n: int, seed: int
) -> list[int]:
    """The first `n` tokens of the first `context` of LongBench's `name`.jsonl, or n seeded
    random ids when the file is absent."""
    path = folder / f"{name}.jsonl"
    if path.is_file():
        with path.open() as f:
            ids = model.tokenizer.encode(
                json.loads(f.readline())["context"], add_special_tokens=False
            )
        if len(ids) >= n:
            return ids[:n]
    rng = random.Random(seed)
    return [rng.randrange(model.config.vocab_size) for _ in range(n)]


def prompts(model: dge_jax.Model, folder: pathlib.Path) -> list[tuple[Prompt, int]]:
    """(prompt, chunk_size) per dge_jax grid."""
    return [
        (Prompt("chat", template_ids(model, context_ids(model, folder, "hotpotqa", 400, 0))),
         DEFAULT_CHUNK),
        (Prompt("chat, chunk 64",
                template_ids(model, context_ids(model, folder, "multi_news", 380, 1))), 64),
        (Prompt("no template", context_ids(model, folder, "hotpotqa", 460, 0)), DEFAULT_CHUNK),
    ]  # fmt: skip


def cells(chunk_size: int) -> list[tuple[tuple[str, int], Eviction]]:
    """((allocation, B), Eviction) per cell of one grid."""
    rule = KVzip(sinks=SINKS, chunk_size=chunk_size)
    return [
        ((alloc, b), Eviction(rule, b, PREFILL, head_budget=hb, alpha=0.0))
        for alloc, hb in ALLOCATIONS.items()
        for b in BUDGETS
    ]


def dge_run(model: dge_jax.Model, prompt: Prompt, chunk_size: int) -> tuple[dict, np.ndarray]:
    """One grid: kept [L][Hkv][...] per (allocation, B), and the reconstruct stage's scores
    [L, Hkv, n] by position (read through the hook: the last pass's output)."""
    seen = {}

    def hook(stage, fn, *args, **kwargs):
        out = fn(*args, **kwargs)
        if stage == "reconstruct":
            seen["scores"], seen["index"] = out, int(args[3].index[0])
        return out

    grid = cells(chunk_size)
    results = dge_jax.generate_grid(
        model, [prompt.ids], [ev for _, ev in grid], max_new_tokens=1, hook=hook
    )
    kept = {key: res.kept[0] for (key, _), res in zip(grid, results, strict=True)}
    n, first = len(prompt.ids), seen["index"] - len(prompt.ids)
    scores = np.asarray(seen["scores"])[:, 0, :, first : first + n]
    return kept, scores


def job_id(key: str, prompt: Prompt, chunk: int, variant: str, alloc: str, b: int) -> str:
    """The peer job of one table row."""
    return f"{key}/{prompt.label}/{chunk}/{variant}/{alloc}/{b}"


def variants(prompt: Prompt) -> dict[str, dict]:
    """kvpress runs of a prompt: as is, and for the prompt without the template, also with
    the template prefix's length set to 0."""
    out = {"kvpress": {}}
    if prompt.label == "no template":
        out["kvpress prefix 0"] = {"prefix_length": 0}
    return out


def peer_jobs(key: str, folder: str, runs: list[tuple[Prompt, int]]) -> list[dict]:
    """One peer job per (prompt, variant, allocation, B)."""
    jobs = []
    for prompt, chunk in runs:
        for variant, extra in variants(prompt).items():
            for alloc in ALLOCATIONS:
                for b in BUDGETS:
                    press = {"name": "kvzip", "chunk_size": chunk, "n_sink": SINKS,
                             "layerwise": alloc == "layerwise"} | extra  # fmt: skip
                    jobs.append({
                        "id": job_id(key, prompt, chunk, variant, alloc, b), "folder": folder,
                        "prompt": prompt.ids, "budget": b, "press": press,
                    })  # fmt: skip
    return jobs


def thresholds(scores: np.ndarray, kept: list, alloc: str) -> np.ndarray:
    """[L] kvpress's pool threshold: the lowest score it kept in each layer's pool (layerwise)
    or in the one pool (global)."""
    lowest = np.array([
        min(scores[layer, h, p] for h, head in enumerate(heads) for p in head)
        for layer, heads in enumerate(kept)
    ])  # fmt: skip
    return lowest if alloc == "layerwise" else np.full_like(lowest, lowest.min())


def swap_gap(scores: np.ndarray, t: float, d: dict) -> float:
    """max |s - t| / |t| over the entries only one side keeps of a differing head: how far
    from kvpress's threshold t (in its own scores) the disagreement reaches."""
    swapped = d["only_dge_jax_all"] + d["only_kvpress_all"]
    s = scores[d["layer"], d["head"], swapped]
    return float(np.max(np.abs(s - t)) / max(abs(t), 1e-30))


def score_diff(ours: np.ndarray, theirs: np.ndarray) -> float:
    """max over layers of max |ours - theirs| / max |theirs|, sinks aside."""
    a, b = ours[..., SINKS:], theirs[..., SINKS:]
    per_layer = np.abs(a - b).reshape(len(a), -1).max(1) / np.abs(b).reshape(len(b), -1).max(1)
    return float(per_layer.max())


def differing_heads(ours: list, theirs: list) -> list[dict]:
    """`rule_agreement.compare`, with every position only one side keeps."""
    diff = compare(ours, theirs, None)
    for d in diff:
        x, y = set(ours[d["layer"]][d["head"]]), set(theirs[d["layer"]][d["head"]])
        d["only_dge_jax_all"], d["only_kvpress_all"] = sorted(x - y), sorted(y - x)
    return diff


def dge_start(model: dge_jax.Model, ids: list[int]) -> int:
    """The first position dge_jax's KVzip repeats: after the template prefix, when the
    prompt starts with it."""
    prefix, _ = template_parts(model.tokenizer)
    return len(prefix) if prefix and ids[: len(prefix)] == prefix else 0


def summarise(
    key: str, start: int, prompt: Prompt, chunk: int, ours: dict, dge_scores, peer: dict
) -> list:
    """One row per (variant, allocation, B) of a (model, prompt); start: `dge_start`."""
    rows = []
    for variant in variants(prompt):
        for alloc in ALLOCATIONS:
            for b in BUDGETS:
                res = peer[job_id(key, prompt, chunk, variant, alloc, b)]
                theirs = np.asarray(res["scores"], np.float64)
                diff = differing_heads(ours[alloc, b], res["kept"])
                t = thresholds(theirs, res["kept"], alloc)
                for d in diff:
                    d["gap"] = swap_gap(theirs, t[d["layer"]], d)
                n_ctx = len(prompt.ids) - res["prefix_length"]
                rows.append({
                    "model": key, "prompt": prompt.label, "n": len(prompt.ids),
                    "start": start, "prefix_length": res["prefix_length"], "variant": variant,
                    "chunk_size": chunk, "passes": math.ceil(n_ctx / chunk),
                    "allocation": alloc, "budget": b,
                    "heads": sum(len(layer) for layer in ours[alloc, b]),
                    "same_heads": sum(len(layer) for layer in ours[alloc, b]) - len(diff),
                    "score_diff": score_diff(np.asarray(dge_scores, np.float64), theirs),
                    "differing": [{k: v for k, v in d.items() if not k.endswith("_all")}
                                  for d in diff],
                })  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    """The markdown table."""
    lines = [
        "| model | prompt (tokens) | context from (dge_jax / kvpress) | chunk_size (kvpress "
        "passes) | allocation | B "
        "| heads identical / total | differing heads | max score diff |",
        "| --- | --- | --- | ---: | --- | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['prompt']} ({r['n']}) | {r['start']} / {r['prefix_length']} "
            f"| {r['chunk_size']} ({r['passes']}) | {r['allocation']} | {r['budget']} "
            f"| {r['same_heads']} / {r['heads']} | {notes(r['differing'])} "
            f"| {fmt_gap(r['score_diff'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = ra.parse_args(
        __doc__, argv,
        "folder of LongBench *.jsonl files (contexts; seeded random ids if absent)",
    )  # fmt: skip
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvzip_agreement_") as tmp:
        smol = dge_jax.load("smollm2-135m-instruct")
        tiny = pathlib.Path(tmp) / "tiny"
        build = ["--tiny", str(tiny), "--tokenizer-from", str(smol.path)]
        if run_peer(args.peer_python, build).wait():
            sys.exit("peer_rules.py --tiny failed")
        loaded = {"SmolLM2-135M": smol, "tiny random Llama": dge_jax.load(tiny)}
        # Both models share SmolLM2's tokenizer, so they read the same prompts.
        runs = prompts(smol, args.longbench)
        jobs = [job for key, m in loaded.items() for job in peer_jobs(key, str(m.path), runs)]
        jobs_path, out_path = pathlib.Path(tmp) / "jobs.json", pathlib.Path(tmp) / "out.json"
        jobs_path.write_text(json.dumps({"jobs": jobs}))
        ours = {}
        for key, m in loaded.items():
            for prompt, chunk in runs:
                ours[key, prompt.label] = dge_run(m, prompt, chunk)
                print(f"[kvzip_agreement] dge_jax {key} {prompt.label}", file=sys.stderr)
        dge_s = time.perf_counter() - start
        peer = run_peer(args.peer_python, ["--jobs", str(jobs_path), "--out", str(out_path)])
        if peer.wait():
            sys.exit("peer_rules.py failed")
        out = json.loads(out_path.read_text())
    results = {r["id"]: r for r in out["results"]}
    rows = [
        row
        for key in loaded
        for prompt, chunk in runs
        for row in summarise(
            key, dge_start(smol, prompt.ids), prompt, chunk, *ours[key, prompt.label], results
        )
    ]
    wall = time.perf_counter() - start
    v = out["versions"]
    print(table(rows))
    print(
        f"\nkvpress {v['kvpress']}, torch {v['torch']}, transformers {v['transformers']}; "
        f"dge_jax {len(ours)} grids of {len(cells(DEFAULT_CHUNK))} cells in {dge_s:.0f} s (loading "
        f"and compiling included), kvpress {len(jobs)} runs in {out['wall_s']:.0f} s; "
        f"{wall:.0f} s in all"
    )
    for row in rows:
        for d in row["differing"][:3]:
            print(
                f"- {row['model']}, {row['prompt']}, {row['variant']}, {row['allocation']}, "
                f"B {row['budget']}: layer {d['layer']} head {d['head']}: only dge_jax "
                f"{d['only_dge_jax']}, only kvpress {d['only_kvpress']}, sizes {d['sizes']}, "
                f"swap gap {fmt_gap(d['gap'])}"
            )
    if args.json:
        args.json.write_text(json.dumps({"versions": v, "wall_s": wall, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
