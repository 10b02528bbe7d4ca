"""Side by side with kvpress on a quantized cache: does dge_jax's quantized cache
lose what kvpress's SnapKV on transformers' `QuantizedCache` loses, and no more?

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.peers.quantized_agreement \\
        [--kv_quant int8[,int4]] [--nbits 4[,2]] [--num_samples 16] [--skip 0] [--json PATH]
    python -m benchmarks.peers.quantized_agreement --merge PART.json ...  # parts' rows together
    ... --kv_quant int8,int4 --peer_from OLD_PART.json  # kvpress's cells of an earlier run

The same needle prompts (the runner's suite rows: RULER's niah tasks at `--length` tokens by
default, `experiments.runner.load_suite`, fed as `experiments.protocol.model_sample` feeds
them: chat template, then the answer prefix) go as the same token ids to both libraries, on
the same weights (the embedded SmolLM2-135M-Instruct folder `dge_jax.load` converts, read by
transformers from its config.json + model.safetensors), greedy, float32, one answer per row
up to and including the first EOS or the task's generation length. Cells:

- dge_jax (`generate_grid`, one prefill for both cells): FullKV and SnapKV at `--budget` per
  kv head evicted right after the prefill (`SnapKV.kvpress(window, kernel)`: avg-pool, the
  kvpress preset that keeps what SnapKVPress keeps, section "Agreement with kvpress" of
  benchmarks/RESULTS.md), on the plain cache ("none") and on each `--kv_quant` ("int8"; "int4"
  is accepted as soon as dge_jax has it);
- kvpress 0.5.5 in the peers' venv (`benchmarks/peers/peer_quantized.py`, one prefill per
  row shared by its jobs, the press's own hook then run on each cache): FullKV (no press)
  and ``SnapKVPress(window_size, kernel_size)`` at the ratio that keeps the same budget, on a
  DynamicCache ("none") and on ``QuantizedCache(backend="quanto", nbits=N)`` for each
  `--nbits` ("quanto-int4"; "quanto-int2" with ``--nbits 4,2``; transformers' other
  defaults: axis_key = axis_value = 0, q_group_size 64, residual_length 128).

Per cell the suite's own accuracy (a row is correct when its score is >= 0.5, as
`experiments.report`), then paired comparisons on the same rows (exact McNemar,
`experiments.stats.mcnemar_exact`, Holm over every comparison of the run): each library's
quantized cell against its own plain cell (what quantization costs it), the two libraries'
plain cells against each other (they should agree: identical tokens, same answers; SnapKV's
kept sets by head), and dge_jax's quantized cells against kvpress's. Prints a markdown table;
`--json PATH` writes every row's tokens and scores as well. `--peer_from PART.json` takes
kvpress's cells from an earlier `--json` of the same setting and rows instead of running
kvpress again (its cells do not depend on dge_jax's `--kv_quant`): a new dge_jax cache is
compared without the peer's hour on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from benchmarks.peers.peer_client import PEERS_PYTHON, SETUP_COMMAND
from experiments.stats import format_p, holm, mcnemar_exact

HERE = pathlib.Path(__file__).resolve().parent
PEER_SCRIPT = HERE / "peer_quantized.py"
CORRECT_AT = 0.5  # experiments.report's threshold
LIBRARIES = ("dge_jax", "kvpress")
METHODS = ("FullKV", "SnapKV")
PLAIN = "none"
RULER_NIAH = ("niah_single_1", "niah_single_2", "niah_multikey_1")


def cell_id(library: str, cache: str, method: str) -> str:
    """"dge_jax/int8/SnapKV", "kvpress/quanto-int4/FullKV", ..."""
    return f"{library}/{cache}/{method}"


def quanto_cache(nbits: int) -> str:
    """The cache label of kvpress's `QuantizedCache(backend="quanto", nbits=nbits)`."""
    return f"quanto-int{nbits}"


# ---------------------------------------------------------------------------------------------
# Scores and comparisons (plain data: a test checks them without the venv or a model)


def cut_at_eos(tokens: Sequence[int], eos: Sequence[int]) -> list[int]:
    """The ids up to and including the first EOS (what dge_jax's `GenerationResult.tokens`
    holds)."""
    out = []
    for t in tokens:
        out.append(int(t))
        if t in eos:
            break
    return out


def kept_identical(ours: list | None, theirs: list | None) -> tuple[int, int] | None:
    """(heads whose kept positions are the same set, heads) of one row's [L][Hkv][positions],
    None where either side has none."""
    if ours is None or theirs is None:
        return None
    pairs = [(set(x), set(y)) for a, b in zip(ours, theirs, strict=True)
             for x, y in zip(a, b, strict=True)]  # fmt: skip
    return sum(x == y for x, y in pairs), len(pairs)


def paired(a: dict, b: dict) -> dict:
    """Cell `a` against cell `b` on the rows both have ({row key: {"score", "tokens",
    "kept"?}}): wins (rows only `a` gets right), losses, exact McNemar p, rows with identical
    tokens, rows with the same correctness, and kept heads identical where both kept."""
    common = sorted(set(a) & set(b))
    ca = [a[r]["score"] >= CORRECT_AT for r in common]
    cb = [b[r]["score"] >= CORRECT_AT for r in common]
    wins = sum(x and not y for x, y in zip(ca, cb, strict=True))
    losses = sum(y and not x for x, y in zip(ca, cb, strict=True))
    heads = [kept_identical(a[r].get("kept"), b[r].get("kept")) for r in common]
    heads = [h for h in heads if h is not None]
    return {
        "rows": len(common),
        "accuracy": 100 * sum(ca) / len(common) if common else None,
        "baseline_accuracy": 100 * sum(cb) / len(common) if common else None,
        "wins": wins,
        "losses": losses,
        "p": mcnemar_exact(wins, losses),
        "same_tokens": sum(a[r]["tokens"] == b[r]["tokens"] for r in common),
        "same_correct": sum(x == y for x, y in zip(ca, cb, strict=True)),
        "kept_heads": [sum(h[0] for h in heads), sum(h[1] for h in heads)] if heads else None,
    }


def comparisons(cells: dict[str, dict], dge_quants: Sequence[str],
                peer_quants: Sequence[str]) -> list[dict]:
    """The paired comparisons of the table, in its order, Holm-corrected together:
    per method, each quantized cell against its library's plain cell, the two plain cells
    against each other, then each dge_jax quantized cell against each kvpress quantized
    one. A comparison whose cells are missing is left out."""
    specs = []
    for m in METHODS:
        specs += [("quantized vs plain", cell_id("dge_jax", q, m), cell_id("dge_jax", PLAIN, m))
                  for q in dge_quants]
        specs += [("quantized vs plain", cell_id("kvpress", q, m), cell_id("kvpress", PLAIN, m))
                  for q in peer_quants]
        specs.append(("dge_jax vs kvpress", cell_id("dge_jax", PLAIN, m),
                      cell_id("kvpress", PLAIN, m)))
        specs += [("dge_jax vs kvpress", cell_id("dge_jax", q, m), cell_id("kvpress", pq, m))
                  for q in dge_quants for pq in peer_quants]  # fmt: skip
    out = [{"kind": kind, "cell": a, "baseline": b} | paired(cells[a], cells[b])
           for kind, a, b in specs if a in cells and b in cells]
    for c, p in zip(out, holm([c["p"] for c in out]), strict=True):
        c["p_holm"] = p
    return out


def accuracy(cells: dict[str, dict]) -> dict[str, dict]:
    """Per cell: rows, correct rows and accuracy in %, mean row score in %."""
    out = {}
    for cell, rows in cells.items():
        scores = [r["score"] for r in rows.values()]
        correct = sum(s >= CORRECT_AT for s in scores)
        out[cell] = {"rows": len(scores), "correct": correct,
                     "accuracy": 100 * correct / len(scores) if scores else None,
                     "mean_score": 100 * sum(scores) / len(scores) if scores else None}
    return out


def fmt_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def table(cells: dict[str, dict], comps: list[dict]) -> str:
    """Two markdown tables: accuracy per cell, then the paired comparisons."""
    acc = accuracy(cells)
    lines = ["| cell | rows | correct | accuracy % | mean row score % |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {cell} | {a['rows']} | {a['correct']} | {fmt_pct(a['accuracy'])} "
              f"| {fmt_pct(a['mean_score'])} |" for cell, a in acc.items()]  # fmt: skip
    lines += ["", "| comparison | cell | against | rows | wins / losses | McNemar p (Holm) "
              "| identical tokens | same correctness | SnapKV kept heads identical |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in comps:
        kept = "n/a" if c["kept_heads"] is None else f"{c['kept_heads'][0]} / {c['kept_heads'][1]}"
        lines.append(
            f"| {c['kind']} | {c['cell']} | {c['baseline']} | {c['rows']} "
            f"| {c['wins']} / {c['losses']} | {format_p(c['p'])} ({format_p(c['p_holm'])}) "
            f"| {c['same_tokens']} / {c['rows']} | {c['same_correct']} / {c['rows']} | {kept} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The runs


def load_samples(model, args) -> list[dict]:
    """The suite's rows as token ids: {"key", "dataset", "ids", "answers", "all_classes",
    "max_new_tokens"} per row, in the runner's prompt format."""
    from experiments import protocol
    from experiments.runner import load_suite

    rows = load_suite(model, args.suite, list(args.datasets), args.skip + args.num_samples,
                      args.data_dir, args.length, args.seed)  # fmt: skip
    samples = []
    for dataset, rs in rows.items():
        for row in rs[args.skip :]:
            s = protocol.model_sample(row, dataset, model.tokenizer, 10**9)
            n = protocol.max_new_tokens(dataset, row)
            samples.append({
                "key": f"{dataset}/{row['_id']}", "dataset": dataset,
                "ids": model.tokenizer.encode(s.text), "answers": row["answers"],
                "all_classes": row["all_classes"],
                "max_new_tokens": n if args.max_new_tokens is None else min(n, args.max_new_tokens),
            })  # fmt: skip
    return samples


def dge_cells(model, samples: list[dict], args) -> dict[str, dict]:
    """dge_jax's tokens (and SnapKV's kept sets) per cell and row: `generate_grid` over FullKV
    and SnapKV, once per cache, `--batch_size` rows of one generation length at a time."""
    import dge_jax
    from dge_jax.eviction.evict import Eviction
    from dge_jax.eviction.timing import Timing
    from dge_jax.rules.snapkv import SnapKV

    rule = SnapKV.kvpress(window=args.window, kernel=args.kernel)
    grid = {"FullKV": None, "SnapKV": Eviction(rule, args.budget, Timing("prefill", 1))}
    out: dict[str, dict] = {}
    by_length: dict[int, list[dict]] = {}
    for s in samples:
        by_length.setdefault(s["max_new_tokens"], []).append(s)
    for cache in (PLAIN, *args.kv_quant):
        for n, group in by_length.items():
            group = sorted(group, key=lambda s: len(s["ids"]))  # batches of like lengths
            for i in range(0, len(group), args.batch_size):
                batch = group[i : i + args.batch_size]
                t0 = time.perf_counter()
                results = dge_jax.generate_grid(
                    model, [s["ids"] for s in batch], list(grid.values()), max_new_tokens=n,
                    kv_quant=cache,
                )  # fmt: skip
                for method, res in zip(grid, results, strict=True):
                    rows = out.setdefault(cell_id("dge_jax", cache, method), {})
                    for r, s in enumerate(batch):
                        rows[s["key"]] = {"tokens": list(map(int, res.tokens[r])),
                                          "kept": None if res.kept is None else res.kept[r]}
                print(f"[quantized_agreement] dge_jax {cache}: rows {i + 1}-{i + len(batch)} "
                      f"of {len(group)} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def peer_jobs(folder: str, samples: list[dict], args, eos: list[int]) -> list[dict]:
    """One peer job per (row, cache, method)."""
    caches = {PLAIN: None} | {quanto_cache(b): {"backend": "quanto", "nbits": b}
                              for b in args.nbits}  # fmt: skip
    press = {"name": "snapkv", "window_size": args.window, "kernel_size": args.kernel}
    jobs = []
    for s in samples:
        for cache, spec in caches.items():
            for method in METHODS:
                jobs.append({
                    "id": f"{cell_id('kvpress', cache, method)}|{s['key']}", "folder": folder,
                    "prompt": s["ids"], "press": press if method == "SnapKV" else None,
                    "budget": args.budget, "cache": spec,
                    "max_new_tokens": s["max_new_tokens"], "eos_ids": eos,
                })  # fmt: skip
    return jobs


def start_peer(python: pathlib.Path, jobs: list[dict], tmp: pathlib.Path
               ) -> tuple[subprocess.Popen, pathlib.Path]:
    """Starts `peer_quantized.py` on the jobs in the peers' venv: (the process, its output
    JSON's path). It runs while dge_jax computes (only the figures of the two are compared,
    never their times)."""
    jobs_path, out_path = tmp / "jobs.json", tmp / "out.json"
    jobs_path.write_text(json.dumps({"jobs": jobs}))
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the peers' venv never imports dge_jax
    cmd = [str(python), str(PEER_SCRIPT), "--jobs", str(jobs_path), "--out", str(out_path)]
    return subprocess.Popen(cmd, env=env), out_path


def scored(cells: dict[str, dict], samples: list[dict], decode, eos: Sequence[int]) -> None:
    """Adds each row's "text" and suite "score" to every cell, tokens cut at the first EOS."""
    from experiments import suites

    by_key = {s["key"]: s for s in samples}
    for rows in cells.values():
        for key, r in rows.items():
            s = by_key[key]
            r["tokens"] = cut_at_eos(r["tokens"], eos)
            r["text"] = decode(r["tokens"])
            r["score"] = suites.row_score(s["dataset"], r["text"], s["answers"], s["all_classes"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--peer-python", type=pathlib.Path, default=PEERS_PYTHON,
                   help=f"python of the peers' venv (default {PEERS_PYTHON}; `{SETUP_COMMAND}`)")
    p.add_argument("--suite", default="ruler", help="the runner's suite (ruler, synthetic)")
    p.add_argument("--datasets", type=lambda s: s.split(","), default=list(RULER_NIAH))
    p.add_argument("--length", type=int, default=2048,
                   help="the suite's prompt length (--ruler_length / --synthetic_length)")
    p.add_argument("--num_samples", type=int, default=16, help="rows per dataset")
    p.add_argument("--skip", type=int, default=0,
                   help="rows per dataset skipped first (a run in parts: --merge their JSON)")
    p.add_argument("--merge", type=pathlib.Path, nargs="+",
                   help="no run: the tables of these --json files' rows together")
    p.add_argument("--data_dir", default=None, help="the runner's --data_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=int, default=128, help="SnapKV's entries per kv head")
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--kernel", type=int, default=7)
    p.add_argument("--kv_quant", type=lambda s: [q for q in s.split(",") if q],
                   default=["int8"], help="dge_jax's quantized caches, beside 'none'")
    p.add_argument("--nbits", type=lambda s: [int(b) for b in s.split(",") if b],
                   default=[4], help="kvpress's QuantizedCache(backend='quanto', nbits): 4, 2")
    p.add_argument("--max_new_tokens", type=int, default=None,
                   help="cap on the task's generation length (default: the task's)")
    p.add_argument("--batch_size", type=int, default=4, help="dge_jax's rows per grid call")
    p.add_argument("--json", type=pathlib.Path, help="write everything here")
    p.add_argument("--peer_from", type=pathlib.Path,
                   help="kvpress's cells from this earlier --json of the same setting and "
                        "rows instead of running kvpress")
    args = p.parse_args(argv)
    if args.merge:
        return args
    if PLAIN in args.kv_quant:
        p.error("--kv_quant lists the quantized caches; 'none' always runs")
    if args.peer_from is None and not args.peer_python.exists():
        p.error(f"{args.peer_python} is missing; run `{SETUP_COMMAND}` or give --peer-python")
    return args


# What kvpress's cells depend on: an earlier run's are reused only when all of these agree.
PEER_SETTING = ("suite", "datasets", "length", "num_samples", "skip", "data_dir", "seed",
                "budget", "window", "kernel", "nbits", "max_new_tokens")


def peer_from(path: pathlib.Path, args, samples: list[dict]) -> tuple[dict, dict]:
    """(kvpress's cells, its versions) from an earlier `--json` run: refused (SystemExit
    naming the difference) unless its setting and rows are this run's."""
    saved = json.loads(path.read_text())
    if "cells" not in saved or "args" not in saved:
        sys.exit(f"error: {path} is not a run's --json (a --merge output holds no rows)")
    mine = vars(args)
    differ = [f"{k} {saved['args'].get(k)!r} vs {mine[k]!r}" for k in PEER_SETTING
              if saved["args"].get(k) != (str(mine[k]) if isinstance(mine[k], pathlib.Path)
                                          else mine[k])]
    rows = {s["key"]: len(s["ids"]) for s in samples}
    if not differ and {k: r["prompt_tokens"] for k, r in saved["rows"].items()} != rows:
        differ = ["its rows' keys or prompt lengths"]
    if differ:
        sys.exit(f"error: {path} was run with another setting ({'; '.join(differ)}); give "
                 "the same options, or run kvpress again without --peer_from")
    cells = {c: {k: {"tokens": r["tokens"], "kept": r.get("kept")} for k, r in rows_.items()}
             for c, rows_ in saved["cells"].items() if c.startswith("kvpress/")}
    return cells, saved["versions"]


def merged(paths: Sequence[pathlib.Path]) -> tuple[dict, list[dict], dict]:
    """(cells, comparisons, the first file's JSON) of `--json` files of one setting run in
    parts (`--skip`): their rows together."""
    saved = [json.loads(p.read_text()) for p in paths]
    cells: dict[str, dict] = {}
    for s in saved:
        for c, rows in s["cells"].items():
            overlap = set(cells.get(c, {})) & set(rows)
            if overlap:
                raise ValueError(f"{c}: rows {sorted(overlap)[:3]} are in two files")
            cells.setdefault(c, {}).update(rows)
    first = saved[0]["args"]
    comps = comparisons(cells, first["kv_quant"], [quanto_cache(b) for b in first["nbits"]])
    return cells, comps, saved[0]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        cells, comps, first = merged(args.merge)
        a, v = first["args"], first["versions"]
        n = len(next(iter(cells.values())))
        print(table(cells, comps))
        print(f"\n{n} rows from {len(args.merge)} runs ({', '.join(a['datasets'])}; "
              f"{a['suite']} at {a['length']}); SnapKV window {a['window']}, kernel "
              f"{a['kernel']}, avg-pool, budget {a['budget']} per kv head; kvpress "
              f"{v['kvpress']}, optimum-quanto {v['optimum-quanto']}, torch {v['torch']}, "
              f"transformers {v['transformers']}")
        if args.json:
            args.json.write_text(json.dumps({"merged": [str(p) for p in args.merge],
                                             "accuracy": accuracy(cells),
                                             "comparisons": comps}, indent=1))
        return
    import dge_jax

    start = time.perf_counter()
    model = dge_jax.load("smollm2-135m-instruct")
    eos = sorted(model.tokenizer.eos_ids)
    samples = load_samples(model, args)
    jobs = peer_jobs(str(model.path), samples, args, eos)
    print(f"[quantized_agreement] {len(samples)} rows "
          f"({min(len(s['ids']) for s in samples)}-{max(len(s['ids']) for s in samples)} "
          f"tokens), {len(jobs)} kvpress jobs"
          f"{f' taken from {args.peer_from}' if args.peer_from else ''}",
          file=sys.stderr)  # fmt: skip
    if args.peer_from:
        theirs, v = peer_from(args.peer_from, args, samples)
        cells = dge_cells(model, samples, args)
        dge_s = time.perf_counter() - start
        cells |= theirs
        peer_line = f"kvpress's {len(jobs)} runs taken from {args.peer_from}"
    else:
        with tempfile.TemporaryDirectory(prefix="quantized_agreement_") as tmp:
            proc, out_path = start_peer(args.peer_python, jobs, pathlib.Path(tmp))
            cells = dge_cells(model, samples, args)
            dge_s = time.perf_counter() - start
            if proc.wait():
                sys.exit("peer_quantized.py failed")
            peer = json.loads(out_path.read_text())
        for r in peer["results"]:
            cell, key = r["id"].split("|")
            cells.setdefault(cell, {})[key] = {"tokens": r["tokens"], "kept": r.get("kept")}
        v = peer["versions"]
        peer_line = f"kvpress's {len(jobs)} runs {peer['wall_s']:.0f} s"
    order = [cell_id(lib, c, m) for m in METHODS for lib, caches in
             (("dge_jax", (PLAIN, *args.kv_quant)),
              ("kvpress", (PLAIN, *map(quanto_cache, args.nbits)))) for c in caches]
    cells = {c: cells[c] for c in order if c in cells}
    scored(cells, samples, model.tokenizer.decode, eos)
    comps = comparisons(cells, args.kv_quant, [quanto_cache(b) for b in args.nbits])
    wall = time.perf_counter() - start
    lengths = [len(s["ids"]) for s in samples]
    print(table(cells, comps))
    print(
        f"\n{len(samples)} rows ({', '.join(args.datasets)}; {args.suite} at {args.length}, "
        f"prompts {min(lengths)}-{max(lengths)} tokens); SnapKV window {args.window}, kernel "
        f"{args.kernel}, avg-pool, budget {args.budget} per kv head; kvpress {v['kvpress']}, "
        f"optimum-quanto {v['optimum-quanto']}, torch {v['torch']}, transformers "
        f"{v['transformers']}; side by side: dge_jax {dge_s:.0f} s (loading and compiling "
        f"included), {peer_line}; {wall:.0f} s in all"
    )
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: (str(x) if isinstance(x, pathlib.Path) else x)
                     for k, x in vars(args).items()},
            "versions": v, "wall_s": wall, "accuracy": accuracy(cells), "comparisons": comps,
            "rows": {s["key"]: {"prompt_tokens": len(s["ids"]), "answers": s["answers"]}
                     for s in samples},
            "cells": {c: {k: {"tokens": r["tokens"], "text": r["text"], "score": r["score"],
                              "kept": r.get("kept")}
                          for k, r in rows.items()} for c, rows in cells.items()},
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
