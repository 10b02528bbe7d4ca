"""Agreement with kvpress: the 2025 scoring rules keep the entries kvpress 0.5.5 keeps.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.peers.rule_agreement [--peer-python PY]

For each rule (KeyDiff, LagKV, ExpectedAttention, CriticalKV, ChunkKV, and AdaKV head budgets
over CriticalKV and ExpectedAttention), model, prompt and per-head budget B, dge_jax evicts
right after the prefill (``Timing("prefill", 1)``) and reports the original positions each
kv head keeps (`GenerationResult.kept`); `benchmarks/peers/peer_rules.py`, in the peers' venv
(kvpress 0.5.5, torch, transformers; `bash benchmarks/peers/setup_peers.sh`), prefills the same
token ids under the matching press and records what the press keeps, with its relative score
gap at the budget boundary. Both sides run in float32, one prompt per call.

Models: a seeded tiny random Llama (2 layers, 4 query / 2 kv heads of 16, `peer_rules.py
--tiny`) and the embedded SmolLM2-135M-Instruct. Prompts: seeded random token ids of 320-500
tokens (multiples of 20, for ChunkKV's whole chunks; at most 512, so dge_jax compiles one
prompt bucket), and for SmolLM2 two LongBench contexts cut to 500 and 460 tokens.

Prints a markdown table (rule | model | prompts | heads kept identically | prompt-budget runs
with all heads identical | notes) and the differing heads; `--json PATH` writes everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import dge_jax
from benchmarks.peers.peer_client import PEERS_PYTHON, SETUP_COMMAND
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import Timing
from dge_jax.rules.chunkkv import ChunkKV
from dge_jax.rules.criticalkv import CriticalKV
from dge_jax.rules.expected_attention import ExpectedAttention
from dge_jax.rules.keydiff import KeyDiff
from dge_jax.rules.lagkv import LagKV
from dge_jax.rules.snapkv import SnapKV

HERE = pathlib.Path(__file__).resolve().parent
PEER_SCRIPT = HERE / "peer_rules.py"
LONGBENCH = pathlib.Path("/work/shared/data/longbench")  # default --longbench
PREFILL = Timing("prefill", 1)
WINDOW = 32  # SnapKV's window inside CriticalKV, ChunkKV and CriticalAdaKV
LAG = 32
SINKS = 4
CHUNK = 20
ALPHA = 0.2
TINY_LENGTHS = (320, 400, 460, 500)
SMOL_LENGTHS = (400, 500)
TEXT_CUTS = {"hotpotqa": 500, "multi_news": 460}  # LongBench file -> tokens kept
NEAR_TIE = 1e-4  # a relative boundary gap below this is float rounding's to flip


@dataclasses.dataclass(frozen=True)
class Prompt:
    """Token ids fed to both sides."""

    label: str
    ids: list[int]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One dge_jax rule and the kvpress press that should keep the same entries.

    eviction(B): dge_jax's `Eviction` at budget B; press: `peer_rules.build_press`'s spec;
    budgets(n): the budgets tried on an n-token prompt.
    """

    label: str
    eviction: Callable[[int], Eviction]
    press: dict
    budgets: Callable[[int], tuple[int, ...]]


def fixed(*budgets: int) -> Callable[[int], tuple[int, ...]]:
    """The same budgets for every prompt length."""
    return lambda n: budgets


def lagkv_tie_free(n: int, per_partition: tuple[int, ...] = (2, 6)) -> tuple[int, ...]:
    """LagKV budgets without exact ties at the boundary: sinks + tail + k per scored partition.

    LagKV's scores are ranks r / lag_size within each partition, so every scored partition
    holds the same values; a budget taking k entries from each one ends between two ranks.
    """
    full = (n - SINKS) // LAG
    tail = LAG + (n - SINKS) % LAG
    return tuple(SINKS + tail + (full - 1) * k for k in per_partition)


SNAP = SnapKV.kvpress(window=WINDOW)
SNAP_PRESS = {"name": "snapkv", "window_size": WINDOW}
EA_NO_VNORM_PRESS = {"name": "expected_attention", "use_vnorm": False}

RULES: list[Rule] = [
    Rule("KeyDiff", lambda b: Eviction(KeyDiff(), b, PREFILL), {"name": "keydiff"}, fixed(64, 128)),
    Rule(
        f"LagKV (lag {LAG}), tie-free budgets",
        lambda b: Eviction(LagKV(sinks=SINKS, lag_size=LAG), b, PREFILL),
        {"name": "lagkv", "n_sink": SINKS, "lag_size": LAG},
        lagkv_tie_free,
    ),
    Rule(
        f"LagKV (lag {LAG}), budgets 64, 128",
        lambda b: Eviction(LagKV(sinks=SINKS, lag_size=LAG), b, PREFILL),
        {"name": "lagkv", "n_sink": SINKS, "lag_size": LAG},
        fixed(64, 128),
    ),
    Rule(
        f"LagKV (lag {LAG}), budgets 64, 128, ties earlier",
        lambda b: Eviction(LagKV(sinks=SINKS, lag_size=LAG), b, PREFILL, ties="earlier"),
        {"name": "lagkv", "n_sink": SINKS, "lag_size": LAG},
        fixed(64, 128),
    ),
    Rule(
        "ExpectedAttention",
        lambda b: Eviction(ExpectedAttention(), b, PREFILL),
        {"name": "expected_attention"},
        fixed(64, 128),
    ),
    Rule(
        f"CriticalKV(SnapKV.kvpress(window={WINDOW}))",
        lambda b: Eviction(CriticalKV(inner=SNAP), b, PREFILL),
        {"name": "criticalkv", "inner": SNAP_PRESS},
        fixed(64, 128),
    ),
    Rule(
        "CriticalKV(ExpectedAttention(use_vnorm=False))",
        lambda b: Eviction(CriticalKV(inner=ExpectedAttention(use_vnorm=False)), b, PREFILL),
        {"name": "criticalkv", "inner": EA_NO_VNORM_PRESS},
        fixed(64, 128),
    ),
    Rule(
        f"ChunkKV(SnapKV.kvpress(window={WINDOW}), chunk {CHUNK})",
        lambda b: Eviction(ChunkKV(inner=SNAP, chunk_length=CHUNK), b, PREFILL),
        {"name": "chunkkv", "inner": SNAP_PRESS, "chunk_length": CHUNK},
        fixed(80, 140),
    ),
    Rule(
        f"ChunkKV(SnapKV.kvpress(), chunk {CHUNK})",
        lambda b: Eviction(ChunkKV(inner=SnapKV.kvpress(), chunk_length=CHUNK), b, PREFILL),
        {"name": "chunkkv", "inner": {"name": "snapkv"}, "chunk_length": CHUNK},
        fixed(80, 140),
    ),
    Rule(
        f"ChunkKV(ExpectedAttention(), chunk {CHUNK})",
        lambda b: Eviction(ChunkKV(inner=ExpectedAttention(), chunk_length=CHUNK), b, PREFILL),
        {"name": "chunkkv", "inner": {"name": "expected_attention"}, "chunk_length": CHUNK},
        fixed(80, 140),
    ),
    Rule(
        f"AdaKV + CriticalKV(SnapKV.kvpress(window={WINDOW})), alpha {ALPHA}",
        lambda b: Eviction(CriticalKV(inner=SNAP), b, PREFILL, head_budget="adakv", alpha=ALPHA),
        {"name": "criticaladakv", "inner": SNAP_PRESS, "alpha_safeguard": ALPHA},
        fixed(64, 128),
    ),
    Rule(
        f"AdaKV + ExpectedAttention, alpha {ALPHA}",
        lambda b: Eviction(ExpectedAttention(), b, PREFILL, head_budget="adakv", alpha=ALPHA),
        {"name": "adakv", "inner": {"name": "expected_attention"}, "alpha_safeguard": ALPHA},
        fixed(64, 128),
    ),
]  # fmt: skip


def random_prompts(vocab: int, lengths: tuple[int, ...], seed: int) -> list[Prompt]:
    """Seeded uniform random token ids, one prompt per length."""
    rng = random.Random(seed)
    return [Prompt(f"random {n}", [rng.randrange(vocab) for _ in range(n)]) for n in lengths]


def text_prompts(model: dge_jax.Model, folder: pathlib.Path, cuts: dict[str, int]) -> list[Prompt]:
    """The first row's `context` of each LongBench file in `folder`, tokenized and cut to
    `cuts[name]` tokens (none if the file is absent)."""
    prompts = []
    for name, n in cuts.items():
        path = folder / f"{name}.jsonl"
        if model.tokenizer is None or not path.is_file():
            continue
        with path.open() as f:
            context = json.loads(f.readline())["context"]
        ids = model.tokenizer.encode(context)
        if len(ids) >= n:
            prompts.append(Prompt(f"{name} {n}", ids[:n]))
    return prompts


def job_id(key: str, prompt: Prompt, rule: Rule, budget: int) -> str:
    """The peer job a (model, prompt, rule, budget) reads: rules with one press share it."""
    return f"{key}/{prompt.label}/{json.dumps(rule.press, sort_keys=True)}/{budget}"


def peer_jobs(key: str, folder: str, prompts: list[Prompt]) -> list[dict]:
    """One peer job per (prompt, press, budget)."""
    jobs = {}
    for p in prompts:
        for rule in RULES:
            for b in rule.budgets(len(p.ids)):
                jobs[job_id(key, p, rule, b)] = {
                    "id": job_id(key, p, rule, b), "folder": folder, "prompt": p.ids,
                    "budget": b, "press": rule.press,
                }  # fmt: skip
    return list(jobs.values())


def dge_kept(key: str, model: dge_jax.Model, prompts: list[Prompt]) -> dict[tuple, list]:
    """dge_jax's kept positions [L][Hkv][...] per (prompt label, rule index, budget): one grid
    call per prompt, every (rule, budget) a cell (one prefill; each cell evicts its own copy
    of the cache)."""
    kept = {}
    for p in prompts:
        cells = [
            ((p.label, r, b), rule.eviction(b))
            for r, rule in enumerate(RULES)
            for b in rule.budgets(len(p.ids))
        ]
        results = dge_jax.generate_grid(model, [p.ids], [ev for _, ev in cells], max_new_tokens=1)
        for (cell, _), res in zip(cells, results, strict=True):
            kept[cell] = res.kept[0]
        print(f"[rule_agreement] dge_jax {key} {p.label}: {len(cells)} cells", file=sys.stderr)
    return kept


def compare(ours: list, theirs: list, gaps: list | None) -> list[dict]:
    """The heads whose kept sets differ: layer, head, kvpress's gap, positions only one keeps."""
    diff = []
    for layer, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for h, (x, y) in enumerate(zip(a, b, strict=True)):
            if sorted(x) != sorted(y):
                diff.append({
                    "layer": layer,
                    "head": h,
                    "gap": gaps[layer][h] if gaps else None,
                    "only_dge_jax": sorted(set(x) - set(y))[:8],
                    "only_kvpress": sorted(set(y) - set(x))[:8],
                    "sizes": (len(x), len(y)),
                })  # fmt: skip
    return diff


def fmt_gap(g: float | None) -> str:
    """A gap for the table: two significant digits, n/a when kvpress has none."""
    return "n/a" if g is None or math.isnan(g) else f"{g:.1e}"


def notes(differing: list[dict]) -> str:
    """One line on the differing heads: exact ties, near-ties, larger gaps."""
    if not differing:
        return "all identical"
    gaps = [d["gap"] for d in differing if d["gap"] is not None]
    exact = sum(g == 0 for g in gaps)
    near = sum(0 < g < NEAR_TIE for g in gaps)
    far = [g for g in gaps if g >= NEAR_TIE]
    parts = []
    if exact:
        parts.append(f"{exact} at exact ties (gap 0)")
    if near:
        largest = max(g for g in gaps if 0 < g < NEAR_TIE)
        parts.append(f"{near} near-ties (gap <= {fmt_gap(largest)})")
    if far:
        parts.append(f"{len(far)} with gap >= {NEAR_TIE:g} (max {fmt_gap(max(far))})")
    if len(gaps) < len(differing):
        parts.append(f"{len(differing) - len(gaps)} without a gap")
    return f"{len(differing)} differing heads: " + ", ".join(parts)


def summarise(models: dict[str, list[Prompt]], kept: dict[str, dict], peer: dict) -> list[dict]:
    """One row per (rule, model): head and run counts, differing heads."""
    rows = []
    for r, rule in enumerate(RULES):
        for key, prompts in models.items():
            heads = same_heads = runs = same_runs = 0
            budgets: set[int] = set()
            differing = []
            for p in prompts:
                for b in rule.budgets(len(p.ids)):
                    ours, theirs = kept[key][p.label, r, b], peer[job_id(key, p, rule, b)]
                    diff = compare(ours, theirs["kept"], theirs["gap"])
                    n = sum(len(layer) for layer in ours)
                    heads, same_heads = heads + n, same_heads + n - len(diff)
                    runs, same_runs = runs + 1, same_runs + (not diff)
                    budgets.add(b)
                    differing += [d | {"prompt": p.label, "budget": b} for d in diff]
            rows.append({
                "rule": rule.label, "model": key, "prompts": len(prompts),
                "lengths": sorted({len(p.ids) for p in prompts}), "budgets": sorted(budgets),
                "runs": runs, "same_runs": same_runs, "heads": heads, "same_heads": same_heads,
                "differing": differing,
            })  # fmt: skip
    return rows


def table(rows: list[dict], models: dict[str, list[Prompt]]) -> str:
    """The markdown table."""

    def prompts_cell(row: dict) -> str:
        kinds = {}
        for p in models[row["model"]]:
            kind = p.label.split()[0] if p.label.startswith("random") else "text"
            kinds[kind] = kinds.get(kind, 0) + 1
        what = " + ".join(f"{n} {k}" for k, n in kinds.items())
        budgets = row["budgets"]
        b = ", ".join(map(str, budgets)) if len(budgets) <= 3 else f"{budgets[0]}-{budgets[-1]}"
        lo, hi = row["lengths"][0], row["lengths"][-1]
        return f"{what} ({lo}-{hi} tokens) x B {b}"

    lines = [
        "| rule | model | prompts | heads kept identically / heads | prompts all heads identical "
        "| notes |",
        "| --- | --- | --- | ---: | ---: | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['rule']} | {row['model']} | {prompts_cell(row)} | "
            f"{row['same_heads']} / {row['heads']} | {row['same_runs']} / {row['runs']} | "
            f"{notes(row['differing'])} |"
        )
    return "\n".join(lines)


def run_peer(python: pathlib.Path, args: list[str]) -> subprocess.Popen:
    """Starts `peer_rules.py` in the peers' venv."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the peers' venv never imports dge_jax
    return subprocess.Popen([str(python), str(PEER_SCRIPT), *args], env=env)


def parse_args(doc: str, argv: list[str] | None, longbench_help: str) -> argparse.Namespace:
    """The agreement scripts' flags (--peer-python, --longbench, --json), the venv checked."""
    p = argparse.ArgumentParser(description=doc.split("\n", 1)[0])
    p.add_argument(
        "--peer-python",
        type=pathlib.Path,
        default=PEERS_PYTHON,
        help=f"python of the peers' venv (default {PEERS_PYTHON}; `{SETUP_COMMAND}`)",
    )
    p.add_argument("--longbench", type=pathlib.Path, default=LONGBENCH, help=longbench_help)
    p.add_argument("--json", type=pathlib.Path, help="write the rows and peer versions here")
    args = p.parse_args(argv)
    if not args.peer_python.exists():
        p.error(f"{args.peer_python} is missing; run `{SETUP_COMMAND}` or give --peer-python")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(
        __doc__, argv, "folder of LongBench *.jsonl files (text prompts; skipped if absent)"
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rule_agreement_") as tmp:
        tiny = pathlib.Path(tmp) / "tiny"
        if run_peer(args.peer_python, ["--tiny", str(tiny)]).wait():
            sys.exit("peer_rules.py --tiny failed")
        tiny_model, smol = dge_jax.load(tiny), dge_jax.load()
        loaded = {"tiny random Llama": tiny_model, "SmolLM2-135M": smol}
        models = {
            "tiny random Llama": random_prompts(tiny_model.config.vocab_size, TINY_LENGTHS, 0),
            "SmolLM2-135M": random_prompts(smol.config.vocab_size, SMOL_LENGTHS, 1)
            + text_prompts(smol, args.longbench, TEXT_CUTS),
        }
        jobs = [
            job
            for key, prompts in models.items()
            for job in peer_jobs(key, str(loaded[key].path), prompts)
        ]
        jobs_path, out_path = pathlib.Path(tmp) / "jobs.json", pathlib.Path(tmp) / "out.json"
        jobs_path.write_text(json.dumps({"jobs": jobs}))
        kept = {key: dge_kept(key, loaded[key], prompts) for key, prompts in models.items()}
        dge_s = time.perf_counter() - start
        peer = run_peer(args.peer_python, ["--jobs", str(jobs_path), "--out", str(out_path)])
        if peer.wait():
            sys.exit("peer_rules.py failed")
        out = json.loads(out_path.read_text())
    results = {r["id"]: r for r in out["results"]}
    rows = summarise(models, kept, results)
    wall = time.perf_counter() - start
    v = out["versions"]
    print(table(rows, models))
    print(
        f"\nkvpress {v['kvpress']}, torch {v['torch']}, transformers {v['transformers']}; "
        f"dge_jax {sum(r['runs'] for r in rows)} cells in {dge_s:.0f} s, kvpress {len(jobs)} "
        f"runs in {out['wall_s']:.0f} s; {wall:.0f} s in all"
    )
    for row in rows:
        for d in row["differing"][:3]:
            print(
                f"- {row['rule']}, {row['model']}, {d['prompt']}, B {d['budget']}: layer "
                f"{d['layer']} head {d['head']}: only dge_jax {d['only_dge_jax']}, only kvpress "
                f"{d['only_kvpress']}, sizes {d['sizes']}, kvpress gap {fmt_gap(d['gap'])}"
            )
    if args.json:
        args.json.write_text(json.dumps({"versions": v, "wall_s": wall, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
