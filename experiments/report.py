"""Scores, a Markdown table and plots, rebuilt from a run's prediction file alone.

    python -m experiments.report OUT_DIR

Reads OUT_DIR/predictions.jsonl, scores every (dataset, cell) with the official metrics,
and writes scores.json, results.md (with paired McNemar comparisons against the prefill
baseline), score_vs_budget.png, dge_delta.png and, for runs over several k,
accuracy_vs_k.png. When a sample was
predicted under several configurations of one cell, the last line in the file wins.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
from collections import defaultdict

from experiments import metrics
from experiments.cells import parse_cell_id
from experiments.longbench_config import ENGLISH_TASKS
from experiments.predictions import PREDICTIONS_FILE, read_predictions


def latest_rows(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(dataset, cell id) -> rows, one per sample (the last line for that sample wins)."""
    by_sample: dict[tuple[str, str, str], dict] = {}
    for row in rows:
        by_sample[(row["dataset"], row["cell"], row["sample_id"])] = row
    grouped: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for (dataset, cell, _), row in by_sample.items():
        grouped[(dataset, cell)].append(row)
    return grouped


def score_rows(rows: list[dict]) -> dict:
    """{"datasets": {dataset: {cell: score}}, "averages": {cell: {...}}, "counts": ...}."""
    grouped = latest_rows(rows)
    scores: dict[str, dict[str, float]] = defaultdict(dict)
    counts: dict[str, dict[str, int]] = defaultdict(dict)
    for (dataset, cell), group in sorted(grouped.items()):
        all_classes = group[0].get("all_classes")
        scores[dataset][cell] = metrics.score_dataset(
            dataset, [r["pred"] for r in group], [r["answers"] for r in group], all_classes
        )
        counts[dataset][cell] = len(group)
    cells = sorted({c for per in scores.values() for c in per}, key=_cell_order)
    averages = {}
    for cell in cells:
        per = {d: s[cell] for d, s in scores.items() if cell in s}
        english = {d: v for d, v in per.items() if d in ENGLISH_TASKS}
        entry = {"mean": round(sum(per.values()) / len(per), 2)}
        if english:
            official = metrics.average_scores(english)
            entry["mean_en16"] = _round(official["mean_en16"])
            entry["category_mean"] = _round(official["category_mean"])
        averages[cell] = entry
    return {"datasets": dict(scores), "averages": averages, "counts": dict(counts)}


def _round(x: float) -> float | None:
    return None if x is None or math.isnan(x) else round(x, 2)


def _cell_order(cell_id: str) -> tuple:
    c = parse_cell_id(cell_id)
    timing = {"prefill": 0, "dge": 1, "dge_w": 2}.get(c.timing, 3)
    return (c.method != "full", c.method, c.budget, timing, c.k, c.adaptive)


def markdown_table(scores: dict) -> str:
    """Cells as rows; datasets, the mean, and (LongBench) both official averages as columns."""
    datasets = sorted(scores["datasets"])
    averages = scores["averages"]
    extra = ["mean_en16", "category_mean"] if any(
        "mean_en16" in a for a in averages.values()) else []
    header = ["method", "timing", "k", "budget", *datasets, "mean", *extra]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell in sorted(averages, key=_cell_order):
        c = parse_cell_id(cell)
        row = [c.method, "-" if c.method == "full" else c.timing,
               "-" if c.method == "full" else f"{c.k}{'a' if c.adaptive else ''}",
               "-" if c.method == "full" else str(c.budget)]
        row += [_fmt(scores["datasets"][d].get(cell)) for d in datasets]
        row += [_fmt(averages[cell].get(name)) for name in ["mean", *extra]]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot(scores: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """score_vs_budget.png (mean score per method and timing) and dge_delta.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    averages = scores["averages"]
    series: dict[tuple[str, str, int], dict[int, float]] = defaultdict(dict)
    full = averages.get("full", {}).get("mean")
    for cell, avg in averages.items():
        c = parse_cell_id(cell)
        if c.method != "full" and not c.adaptive:  # adaptive cells: see the paired table
            series[(c.method, c.timing, c.k)][c.budget] = avg["mean"]
    methods = sorted({m for m, _, _ in series})
    written = []
    if not methods:
        return written
    fig, axes = plt.subplots(1, len(methods), figsize=(4.5 * len(methods), 3.6), squeeze=False)
    for ax, method in zip(axes[0], methods, strict=True):
        for (m, timing, k), points in sorted(series.items()):
            if m != method:
                continue
            budgets = sorted(points)
            label = timing if timing == "prefill" else f"{timing} (k={k})"
            ax.plot(budgets, [points[b] for b in budgets], marker="o", label=label)
        if full is not None:
            ax.axhline(full, color="gray", linestyle="--", label="FullKV")
        ax.set_xscale("log", base=2)
        ax.set_title(method)
        ax.set_xlabel("budget (entries per kv head)")
        ax.set_ylabel("mean score")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "score_vs_budget.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    deltas = []  # (label, dge - prefill, dge_w - prefill)
    for (m, timing, k), points in sorted(series.items()):
        if timing != "dge":
            continue
        base = series.get((m, "prefill", 1), {})
        control = series.get((m, "dge_w", k), {})
        for b in sorted(points):
            if b in base:
                deltas.append((f"{m}\nk={k} b={b}", points[b] - base[b],
                               control[b] - base[b] if b in control else float("nan")))
    if deltas:
        fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(deltas)), 3.6))
        xs = range(len(deltas))
        ax.bar([x - 0.2 for x in xs], [d[1] for d in deltas], width=0.4, label="DGE - prefill")
        ax.bar([x + 0.2 for x in xs], [d[2] for d in deltas], width=0.4,
               label="DGE-W - prefill")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(list(xs), [d[0] for d in deltas], fontsize=7)
        ax.set_ylabel("mean score difference")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / "dge_delta.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def sample_scores(rows: list[dict]) -> dict[str, dict[tuple[str, str], float]]:
    """cell id -> {(dataset, sample id): row score in [0, 1]} (latest line per sample)."""
    out: dict[str, dict[tuple[str, str], float]] = defaultdict(dict)
    for (dataset, cell), group in latest_rows(rows).items():
        for r in group:
            out[cell][(dataset, r["sample_id"])] = metrics.row_score(
                dataset, r["pred"], r["answers"], r.get("all_classes"))
    return out


def mcnemar_exact(wins: int, losses: int) -> float:
    """Two-sided exact McNemar p-value: a binomial test of wins vs losses at p = 1/2."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_comparisons(rows: list[dict], correct_at: float = 0.5) -> list[dict]:
    """Each DGE / DGE-W cell against its method's prefill cell at the same budget, then each
    DGE cell against the DGE-W cell of the same k and budget (the drafted queries' own effect,
    timing held fixed), on the samples both have: a sample is correct when its row score >=
    `correct_at`; wins are samples only the cell gets right, losses those only the other."""
    per_cell = sample_scores(rows)
    k_used: dict[str, list[int]] = defaultdict(list)
    for (_, cell), group in latest_rows(rows).items():
        k_used[cell] += [r["k"] for r in group if r.get("k") is not None]

    def pair(cell: str, base_id: str) -> dict | None:
        base = per_cell.get(base_id)
        common = sorted(set(per_cell[cell]) & set(base or ()))
        if not common:
            return None
        mine = [per_cell[cell][s] >= correct_at for s in common]
        theirs = [base[s] >= correct_at for s in common]
        wins = sum(m and not t for m, t in zip(mine, theirs, strict=True))
        losses = sum(t and not m for m, t in zip(mine, theirs, strict=True))
        ks = k_used.get(cell, [])
        return {
            "cell": cell, "baseline": base_id, "samples": len(common),
            "accuracy": round(100 * sum(mine) / len(common), 2),
            "baseline_accuracy": round(100 * sum(theirs) / len(common), 2),
            "wins": wins, "losses": losses, "p": round(mcnemar_exact(wins, losses), 4),
            "mean_k": round(sum(ks) / len(ks), 2) if ks else None,
        }

    cells = [(cell, parse_cell_id(cell)) for cell in sorted(per_cell, key=_cell_order)]
    drafted = [(cell, c) for cell, c in cells if c.method != "full" and c.timing != "prefill"]
    against_prefill = [pair(cell, f"{c.method}/prefill/b{c.budget}") for cell, c in drafted]
    against_dge_w = [pair(cell, dataclasses.replace(c, timing="dge_w").id)
                     for cell, c in drafted if c.timing == "dge"]  # fmt: skip
    return [p for p in against_prefill + against_dge_w if p is not None]


def paired_table(comparisons: list[dict]) -> str:
    """Markdown table of `paired_comparisons`."""
    header = ["cell", "vs", "n", "acc %", "base acc %", "wins", "losses", "McNemar p", "mean k"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in comparisons:
        lines.append("| " + " | ".join(str(x) for x in [
            c["cell"], c["baseline"], c["samples"], c["accuracy"], c["baseline_accuracy"],
            c["wins"], c["losses"], c["p"], "-" if c["mean_k"] is None else c["mean_k"],
        ]) + " |")
    return "\n".join(lines) + "\n"


def plot_accuracy_vs_k(scores: dict, out_dir: pathlib.Path) -> pathlib.Path | None:
    """accuracy_vs_k.png: mean score against k per method and budget (DGE solid, DGE-W
    dashed, the prefill baseline at k = 1); written only when a run has several k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [parse_cell_id(c) for c in scores["averages"]]
    if len({c.k for c in cells if c.timing != "prefill" and not c.adaptive}) < 2:
        return None
    methods = sorted({c.method for c in cells if c.method != "full"})
    fig, axes = plt.subplots(1, len(methods), figsize=(4.5 * len(methods), 3.6), squeeze=False)
    for ax, method in zip(axes[0], methods, strict=True):
        for budget in sorted({c.budget for c in cells if c.method == method}):
            base = scores["averages"].get(f"{method}/prefill/b{budget}", {}).get("mean")
            for timing, style in (("dge", "-"), ("dge_w", "--")):
                pts = sorted((c.k, scores["averages"][c.id]["mean"]) for c in cells
                             if c.method == method and c.budget == budget
                             and c.timing == timing and not c.adaptive)
                if base is not None:
                    pts = [(1, base)] + [p for p in pts if p[0] != 1]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, marker="o",
                            label=f"{timing} b={budget}")
        ax.set_title(method)
        ax.set_xlabel("k (answer tokens drafted with the full cache)")
        ax.set_ylabel("mean score")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "accuracy_vs_k.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(out_dir: str | pathlib.Path) -> dict:
    """Scores the run in `out_dir` and writes scores.json, results.md and the plots."""
    out_dir = pathlib.Path(out_dir)
    rows = read_predictions(out_dir / PREDICTIONS_FILE)
    if not rows:
        raise FileNotFoundError(f"no predictions in {out_dir / PREDICTIONS_FILE}")
    scores = score_rows(rows)
    comparisons = paired_comparisons(rows)
    scores["paired"] = comparisons
    (out_dir / "scores.json").write_text(json.dumps(scores, indent=2) + "\n")
    table = markdown_table(scores)
    if comparisons:
        table += ("\nPaired comparisons on the same samples: each DGE / DGE-W cell against the "
                  "prefill baseline, then DGE against DGE-W at the same k and budget (correct = "
                  "row score >= 0.5; exact McNemar test):\n\n" + paired_table(comparisons))
    (out_dir / "results.md").write_text(table)
    plot(scores, out_dir)
    plot_accuracy_vs_k(scores, out_dir)
    return scores


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m experiments.report OUT_DIR", file=sys.stderr)
        return 2
    try:
        write_report(argv[0])
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print((pathlib.Path(argv[0]) / "results.md").read_text(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
