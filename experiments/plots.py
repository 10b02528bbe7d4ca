"""The report's figures: score against budget, DGE minus its baseline, score against k.

Every point carries a 95 % bootstrap interval over samples (`stats.bootstrap_mean_ci`), every
title names the model, the suite and n, and series that coincide are drawn side by side with
a note saying so, so a figure never shows lines hidden under each other without a word.
"""

from __future__ import annotations

import pathlib
from collections import defaultdict

from experiments.cells import Cell, parse_cell_id
from experiments.stats import bootstrap_mean_ci

Samples = dict[str, dict[tuple[str, str], float]]  # cell id -> {(dataset, sample): row score}
TIMING_COLORS = {"prefill": "tab:blue", "dge": "tab:red", "dge_w": "tab:green"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: pathlib.Path) -> pathlib.Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def title(config: dict | None, scores: dict) -> str:
    """"<model> on <suite>, n = <samples per cell>" (n as a range when cells differ)."""
    ns = sorted({a["n"] for a in scores["averages"].values()})
    n = str(ns[0]) if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"
    if config is None:
        return f"n = {n} samples per cell"
    ident = config["identity"]
    return f"{ident['model']} on {ident['suite']}, n = {n} samples per cell"


def _by_dataset(values: dict[tuple[str, str], float]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for (dataset, _), v in sorted(values.items()):
        out[dataset].append(100 * v)
    return out


def cell_interval(per_sample: Samples, cell: str) -> tuple[float, float, float]:
    """(mean score, low, high) of one cell on the 0-100 scale, mean over datasets."""
    return bootstrap_mean_ci(_by_dataset(per_sample[cell]))


def paired_interval(per_sample: Samples, cell: str, base: str) -> tuple[float, float, float]:
    """(mean of cell - base, low, high) over the samples both have, paired per sample."""
    common = set(per_sample[cell]) & set(per_sample[base])
    return bootstrap_mean_ci(_by_dataset(
        {s: per_sample[cell][s] - per_sample[base][s] for s in common}))


def _series(scores: dict) -> dict[tuple[str, str, int], dict[int, str]]:
    """(method, timing, k) -> {budget: cell id}, adaptive cells left to the paired table."""
    out: dict[tuple[str, str, int], dict[int, str]] = defaultdict(dict)
    for cell_id in scores["averages"]:
        c = parse_cell_id(cell_id)
        if c.method != "full" and not c.adaptive:
            # a cell that also compresses while decoding is a series of its own
            timing = c.timing + (f" + decode {c.decode_budget}/{c.interval}"
                                 if c.decode_budget else "")  # fmt: skip
            out[(c.method, timing, c.k)][c.budget] = cell_id
    return out


def _label(timing: str, k: int) -> str:
    return "prefill (baseline)" if timing == "prefill" else f"{timing} (k={k})"


def score_vs_budget(scores: dict, per_sample: Samples, title_text: str,
                    out_dir: pathlib.Path) -> pathlib.Path | None:
    """score_vs_budget.png: mean score per budget and timing, one panel per method, FullKV
    as a band; series with equal scores at every budget are offset and named in a note."""
    series = _series(scores)
    methods = sorted({m for m, _, _ in series})
    if not methods:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(methods), figsize=(5.2 * len(methods), 4.9),
                             squeeze=False)
    full = cell_interval(per_sample, "full") if "full" in per_sample else None
    for ax, method in zip(axes[0], methods, strict=True):
        mine = sorted((key, cells) for key, cells in series.items() if key[0] == method)
        offsets = _offsets(len(mine))
        for (key, cells), dx in zip(mine, offsets, strict=True):
            budgets = sorted(cells)
            points = [cell_interval(per_sample, cells[b]) for b in budgets]
            ax.errorbar([b * 2**dx for b in budgets], [p[0] for p in points],
                        yerr=[[p[0] - p[1] for p in points], [p[2] - p[0] for p in points]],
                        marker="o", capsize=3, color=TIMING_COLORS.get(key[1]),
                        label=_label(key[1], key[2]))
        if full is not None:
            ax.axhline(full[0], color="gray", linestyle="--", label="FullKV (band: 95 %)")
            ax.axhspan(full[1], full[2], color="gray", alpha=0.15)
        note = _coincide_note(scores, mine)
        ax.set_xscale("log", base=2)
        budgets = sorted({b for _, cells in mine for b in cells})
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_title(method + (f"\n{note}" if note else ""), fontsize=9)
        ax.set_xlabel("budget (entries kept per kv head)")
        ax.set_ylabel("mean score (95 % bootstrap interval)")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.suptitle(title_text, fontsize=10)
    return _save(plt, fig, out_dir / "score_vs_budget.png")


def _offsets(n: int) -> list[float]:
    """log2 offsets that put n series side by side around each budget (+-0.06 octaves)."""
    return [0.0] if n == 1 else [0.12 * (i / (n - 1) - 0.5) for i in range(n)]


def _coincide_note(scores: dict, mine: list) -> str:
    """"a and b coincide" for series whose mean scores are equal at every budget."""
    means = {key: tuple(scores["averages"][cells[b]]["mean"] for b in sorted(cells))
             for key, cells in mine}
    groups: dict[tuple, list] = defaultdict(list)
    for key, m in means.items():
        groups[m].append(key)
    same = [g for g in groups.values() if len(g) > 1]
    return "; ".join(" = ".join(_label(t, k) for _, t, k in g) + " at every budget"
                     for g in same)


def dge_delta(scores: dict, per_sample: Samples, title_text: str,
              out_dir: pathlib.Path) -> pathlib.Path | None:
    """dge_delta.png: DGE - prefill and DGE-W - prefill per budget, paired per sample, with
    95 % intervals and a zero line; None when the run has no DGE cell with a baseline."""
    series = _series(scores)
    rows = []  # (label, [(name, interval)])
    for (method, timing, k), cells in sorted(series.items()):
        if timing != "dge":
            continue
        base = series.get((method, "prefill", 1), {})
        control = series.get((method, "dge_w", k), {})
        for b in sorted(cells):
            if b not in base:
                continue
            pairs = [("DGE - prefill", paired_interval(per_sample, cells[b], base[b]))]
            if b in control:
                pairs.append(("DGE-W - prefill",
                              paired_interval(per_sample, control[b], base[b])))
            rows.append((f"{method}\nk={k} b={b}", pairs))
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.5, 1.3 * len(rows)), 4.2))
    colors = {"DGE - prefill": TIMING_COLORS["dge"], "DGE-W - prefill": TIMING_COLORS["dge_w"]}
    for x, (_, pairs) in enumerate(rows):
        for j, (name, (mean, low, high)) in enumerate(pairs):
            ax.errorbar([x + (j - 0.5) * 0.25], [mean], yerr=[[mean - low], [high - mean]],
                        fmt="o", capsize=4, color=colors[name],
                        label=name if x == 0 else None)
            if mean == low == high == 0:  # a zero-width point: say why it has no interval
                ax.annotate("equal on\nevery sample", (x + (j - 0.5) * 0.25, 0),
                            textcoords="offset points", xytext=(0, 8), ha="center",
                            fontsize=7, color=colors[name])
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_ylabel("score difference, paired (95 % bootstrap interval)")
    if all(m == 0 and lo == 0 and hi == 0 for _, pairs in rows for _, (m, lo, hi) in pairs):
        ax.text(0.5, 0.9, "every cell equals its baseline on every sample",
                transform=ax.transAxes, ha="center", fontsize=9)
    ax.legend(fontsize=8)
    ax.set_title(title_text, fontsize=10)
    return _save(plt, fig, out_dir / "dge_delta.png")


def accuracy_vs_k(scores: dict, title_text: str, out_dir: pathlib.Path) -> pathlib.Path | None:
    """accuracy_vs_k.png: mean score against k per method and budget (DGE solid, DGE-W
    dashed, the prefill baseline at k = 1); written only when a run has several k."""
    cells = [parse_cell_id(c) for c in scores["averages"]]
    if len({c.k for c in cells if c.timing != "prefill" and not c.adaptive}) < 2:
        return None
    plt = _pyplot()
    methods = sorted({c.method for c in cells if c.method != "full"})
    fig, axes = plt.subplots(1, len(methods), figsize=(4.8 * len(methods), 3.8),
                             squeeze=False)
    for ax, method in zip(axes[0], methods, strict=True):
        for budget in sorted({c.budget for c in cells if c.method == method}):
            _k_lines(ax, scores, cells, method, budget)
        ax.set_title(method)
        ax.set_xlabel("k (answer tokens drafted with the full cache)")
        ax.set_ylabel("mean score")
        ax.legend(fontsize=7)
    fig.suptitle(title_text, fontsize=10)
    return _save(plt, fig, out_dir / "accuracy_vs_k.png")


def _k_lines(ax, scores: dict, cells: list[Cell], method: str, budget: int) -> None:
    base = scores["averages"].get(f"{method}/prefill/b{budget}", {}).get("mean")
    for timing, style in (("dge", "-"), ("dge_w", "--")):
        pts = sorted((c.k, scores["averages"][c.id]["mean"]) for c in cells
                     if c.method == method and c.budget == budget
                     and c.timing == timing and not c.adaptive)
        if base is not None:
            pts = [(1, base)] + [p for p in pts if p[0] != 1]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, marker="o", label=f"{timing} b={budget}")
