"""Greedy tokens and kept positions of the documented calls, recorded at one commit and
compared at another: a change of shape must not change a single token.

    python -m benchmarks.same_tokens record before.json     # at the old commit
    python -m benchmarks.same_tokens compare before.json    # at the new one: exit 1 on a diff

What it records, on the embedded SmolLM2-135M-Instruct:

- readme: the README's `generate` call and its five-cell `generate_grid`;
- notebook: the notebook's three cells on its 980-token pass-key prompt;
- grid: the benchmark's research grid (3 rules x 3 timings x 3 budgets, the quick suite's
  budgets) on a 1k-token synthetic prompt, batch 2, 16 new tokens (EOS banned);
- masked: the same SnapKV, PyramidKV and AdaKV cells masked (compact=False) and compacted to
  per-layer capacities.

The 20-sample main-job run is compared the same way from its `predictions.jsonl`
(`compare --predictions OLD NEW`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import dge_jax
from dge_jax.checkpoints.tokenizer import prompt_renderer
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import Timing
from dge_jax.rules.pyramidkv import PyramidKV
from dge_jax.rules.snapkv import SnapKV
from dge_jax.rules.streamingllm import StreamingLLM
from experiments import protocol
from experiments.suites import synthetic

PREFILL, DGE2, DGE_W2 = Timing("prefill", 1), Timing("dge", 2), Timing("dge_w", 2)


def _cells(results) -> list[dict]:
    return [{"tokens": r.tokens, "kept": r.kept, "k": r.k} for r in results]


def _prompt(tok, task: str, length: int, seed: int = 0, index: int = 0) -> str:
    row = synthetic.make_suite(tok, [task], index + 1, length, seed=seed)[task][index]
    return protocol.prepare_sample(row, task, tok, length, prompt_renderer(tok)).text


def record() -> dict:
    """Every documented call's tokens, kept positions and draft lengths."""
    model = dge_jax.load("smollm2-135m-instruct")
    tok = model.tokenizer
    out: dict[str, list[dict]] = {}
    one = dge_jax.generate(
        model, ["What is the capital of France?"], chat=True, max_new_tokens=16,
        eviction=Eviction(SnapKV(window=8), budget=128, timing=DGE2),
    )  # fmt: skip
    snap = SnapKV(window=8)
    readme_cells = [
        None,
        Eviction(snap, budget=32, timing=PREFILL),
        Eviction(snap, budget=32, timing=DGE2),
        Eviction(snap, budget=32, timing=DGE_W2),
        Eviction(snap, budget=32, timing=DGE2, head_budget="adakv"),
    ]
    out["readme"] = _cells([one]) + _cells(
        dge_jax.generate_grid(model, [_prompt(tok, "passkey", 400)], readme_cells, max_new_tokens=8)
    )
    notebook_cells = [None, Eviction(snap, 64, PREFILL), Eviction(snap, 64, DGE2)]
    nb_prompt = tok.encode(_prompt(tok, "passkey", 980))
    out["notebook"] = _cells(
        dge_jax.generate_grid(model, [nb_prompt], notebook_cells, max_new_tokens=8)
    )
    rules = (
        SnapKV.kvpress(),
        PyramidKV(window=64, kernel=5, pooling="avg"),
        StreamingLLM(sinks=4),
    )
    grid = [Eviction(p, b, t) for p in rules for t in (PREFILL, DGE2, DGE_W2)
            for b in (96, 128, 192)]  # fmt: skip
    prompts = [_prompt(tok, "passkey", 1000, index=i) for i in range(2)]
    out["grid"] = _cells(
        dge_jax.generate_grid(model, prompts, grid, max_new_tokens=16, min_new_tokens=16)
    )
    masked = [
        Eviction(p, 96, t, head_budget=h, compact=c)
        for p, h in ((PyramidKV(window=8), "uniform"), (snap, "adakv"), (snap, "uniform"))
        for t in (PREFILL, DGE2)
        for c in (False, True)
    ]
    out["masked"] = _cells(dge_jax.generate_grid(model, prompts, masked, max_new_tokens=12))
    return out


def _predictions(path: str) -> dict:
    """A prediction file's lines, or a run folder's (every process's file, merged)."""
    if pathlib.Path(path).is_dir():
        from experiments.predictions import read_folder

        rows = read_folder(path)
    else:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return {(r["dataset"], r["cell"], r["sample_id"]): (r["pred"], r.get("k")) for r in rows}


def compare(before: dict, after: dict) -> list[str]:
    """One line per cell whose tokens, kept positions or k differ."""
    diffs = []
    for name, cells in before.items():
        got = after.get(name, [])
        if len(got) != len(cells):
            diffs.append(f"{name}: {len(cells)} cells before, {len(got)} after")
            continue
        for i, (a, b) in enumerate(zip(cells, got, strict=True)):
            for field in ("tokens", "kept", "k"):
                if a[field] != b[field]:
                    diffs.append(f"{name} cell {i}: {field} differ")
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["record", "compare"])
    parser.add_argument("path", nargs="?", help="the JSON of `record`")
    parser.add_argument("--predictions", nargs=2, metavar=("OLD", "NEW"),
                        help="compare two runs' predictions.jsonl (or run folders) "
                        "instead")  # fmt: skip
    args = parser.parse_args(argv)
    if args.predictions:
        old, new = map(_predictions, args.predictions)
        diffs = [
            f"{key}: {old[key]!r} -> {new.get(key)!r}" for key in old if new.get(key) != old[key]
        ]
        diffs += [f"{key}: only in the new run" for key in new.keys() - old.keys()]
        print(f"{len(old)} predictions before, {len(new)} after, {len(diffs)} differ")
    elif args.action == "record":
        with open(args.path, "w") as f:
            json.dump(record(), f)
        print(f"wrote {args.path}")
        return 0
    else:
        with open(args.path) as f:
            before = json.load(f)
        after = record()
        diffs = compare(before, after)
        cells = sum(len(c) for c in before.values())
        print(f"{cells} cells compared, {len(diffs)} differ")
    for line in diffs:
        print("  " + line)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
