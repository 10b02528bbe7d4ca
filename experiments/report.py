"""Scores, a Markdown table and plots, rebuilt from a run's prediction file alone.

    python -m experiments.report OUT_DIR

Reads OUT_DIR/predictions.jsonl, scores every (dataset, cell) with the official metrics,
and writes scores.json, results.md, score_vs_budget.png and dge_delta.png. When a sample was
predicted under several configurations of one cell, the last line in the file wins.
"""

from __future__ import annotations

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
    return (c.method != "full", c.method, c.budget, timing, c.k)


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
               "-" if c.method == "full" else str(c.k),
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
        if c.method != "full":
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


def write_report(out_dir: str | pathlib.Path) -> dict:
    """Scores the run in `out_dir` and writes scores.json, results.md and the plots."""
    out_dir = pathlib.Path(out_dir)
    rows = read_predictions(out_dir / PREDICTIONS_FILE)
    if not rows:
        raise FileNotFoundError(f"no predictions in {out_dir / PREDICTIONS_FILE}")
    scores = score_rows(rows)
    (out_dir / "scores.json").write_text(json.dumps(scores, indent=2) + "\n")
    (out_dir / "results.md").write_text(markdown_table(scores))
    plot(scores, out_dir)
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
