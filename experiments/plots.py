"""The report's figures: score against budget, the paired comparisons' win rates, score
against k.

Scores carry a 95 % bootstrap interval over samples (`stats.bootstrap_mean_ci`); the paired
comparisons are drawn as the report tests them (win rate with an exact interval at the
Bonferroni level, filled where Holm p < 0.05), so the figure never contradicts the table.
Every title names the model, the suite and n, and series that coincide are drawn side by
side with a note saying so, so a figure never shows lines hidden under each other without a
word.
"""

from __future__ import annotations

import pathlib
from collections import defaultdict

from experiments.cells import Cell, parse_cell_id
from experiments.replication import SIGNIFICANT
from experiments.stats import bootstrap_mean_ci, clopper_pearson

Samples = dict[str, dict[tuple[str, str], float]]  # cell id -> {(dataset, sample): row score}
TIMING_COLORS = {"prefill": "tab:blue", "dge": "tab:red", "dge_w": "tab:green",
                 "dge_d": "tab:purple"}


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


def _series(scores: dict) -> dict[tuple[str, str, int], dict[int, str]]:
    """(rule, timing, k) -> {budget: cell id}, adaptive cells left to the paired table."""
    out: dict[tuple[str, str, int], dict[int, str]] = defaultdict(dict)
    for cell_id in scores["averages"]:
        c = parse_cell_id(cell_id)
        if c.rule != "full" and not c.adaptive:
            # a cell that also compresses while decoding is a series of its own
            timing = c.timing + (f" + decode {c.decode_budget}/{c.interval}"
                                 if c.decode_budget else "")  # fmt: skip
            out[(c.rule, timing, c.k)][c.budget] = cell_id
    return out


def _label(cells: dict[int, str]) -> str:
    """A series' legend name: its cells' id without the budget (`snapkv/dge/k2`)."""
    return without_budget(next(iter(cells.values())))


def score_vs_budget(scores: dict, per_sample: Samples, title_text: str,
                    out_dir: pathlib.Path) -> pathlib.Path | None:
    """score_vs_budget.png: mean score per budget and timing, one panel per rule, `full`
    as a band; series (named by their cell id without the budget) with equal scores at every
    budget are offset and named in a note."""
    series = _series(scores)
    rules = sorted({m for m, _, _ in series})
    if not rules:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(rules), figsize=(5.2 * len(rules), 4.9),
                             squeeze=False)
    full = cell_interval(per_sample, "full") if "full" in per_sample else None
    for ax, rule in zip(axes[0], rules, strict=True):
        mine = sorted((key, cells) for key, cells in series.items() if key[0] == rule)
        offsets = _offsets(len(mine))
        for (key, cells), dx in zip(mine, offsets, strict=True):
            budgets = sorted(cells)
            points = [cell_interval(per_sample, cells[b]) for b in budgets]
            ax.errorbar([b * 2**dx for b in budgets], [p[0] for p in points],
                        yerr=[[p[0] - p[1] for p in points], [p[2] - p[0] for p in points]],
                        marker="o", capsize=3, color=TIMING_COLORS.get(key[1]),
                        label=_label(cells))
        if full is not None:
            ax.axhline(full[0], color="gray", linestyle="--", label="full (band: 95 % interval)")
            ax.axhspan(full[1], full[2], color="gray", alpha=0.15)
        note = _coincide_note(scores, mine)
        ax.set_xscale("log", base=2)
        budgets = sorted({b for _, cells in mine for b in cells})
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_title(rule + (f"\n{note}" if note else ""), fontsize=9)
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
    means = {_label(cells): tuple(scores["averages"][cells[b]]["mean"] for b in sorted(cells))
             for _, cells in mine}
    groups: dict[tuple, list] = defaultdict(list)
    for name, m in means.items():
        groups[m].append(name)
    same = [g for g in groups.values() if len(g) > 1]
    return "; ".join(" = ".join(g) + " at every budget" for g in same)


def without_budget(cell_id: str) -> str:
    """A cell id with its budget part left out (`snapkv/dge/k2/b128` -> `snapkv/dge/k2`):
    the name of a series drawn against budget."""
    return "/".join(part for part in cell_id.split("/") if not _is_budget(part))


def _is_budget(part: str) -> bool:
    return part[:1] == "b" and part[1:].isdigit()


def comparison_name(comparison: dict) -> str:
    """`snapkv/dge/k2 vs snapkv/prefill`: a paired comparison named by its two cells."""
    return f"{without_budget(comparison['cell'])} vs {without_budget(comparison['baseline'])}"


def win_rate_points(comparisons: list[dict], alpha: float = SIGNIFICANT) -> list[dict]:
    """What dge_delta.png draws, one point per paired comparison of the report
    (`report.paired_comparisons`): the win rate wins / (wins + losses) with its exact
    Clopper-Pearson interval at level 1 - alpha / m (m = the comparisons Holm's correction runs
    over; Bonferroni-adjusted, so an interval that excludes 1/2 always comes with Holm p <
    alpha), and `filled` where Holm p < alpha. A tie (no wins, no losses) has no rate and no
    interval (`rate`, `low`, `high` None)."""
    m = len(comparisons)
    points = []
    for c in comparisons:
        interval = clopper_pearson(c["wins"], c["losses"], 1 - alpha / m)
        discordant = c["wins"] + c["losses"]
        points.append({
            "name": comparison_name(c), "rule": parse_cell_id(c["cell"]).rule,
            "budget": parse_cell_id(c["cell"]).budget, "cell": c["cell"],
            "baseline": c["baseline"], "wins": c["wins"], "losses": c["losses"],
            "rate": c["wins"] / discordant if discordant else None,
            "low": None if interval is None else interval[0],
            "high": None if interval is None else interval[1],
            "p_holm": c["p_holm"], "filled": c["p_holm"] < alpha,
        })
    return points


def dge_delta(comparisons: list[dict], title_text: str,
              out_dir: pathlib.Path) -> pathlib.Path | None:
    """dge_delta.png: per budget, the win rate of every paired comparison the report tests
    (`win_rate_points`), one panel per rule, with a 0.5 line (as many wins as losses),
    filled markers where Holm p < 0.05 and hollow ones otherwise; ties are drawn at 0.5
    without an interval. None when the run has no paired comparison."""
    points = win_rate_points(comparisons)
    if not points:
        return None
    m = len(points)
    rules = sorted({p["rule"] for p in points})
    names = list(dict.fromkeys(p["name"] for p in points))
    colors = {n: f"C{i % 10}" for i, n in enumerate(names)}
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(rules), figsize=(5.6 * len(rules), 5.2),
                             squeeze=False)
    for ax, rule in zip(axes[0], rules, strict=True):
        mine = [n for n in names if any(p["name"] == n and p["rule"] == rule
                                        for p in points)]
        for name, dx in zip(mine, _offsets(len(mine)), strict=True):
            drawn = [p for p in points if p["name"] == name and p["rule"] == rule]
            for i, p in enumerate(drawn):
                x = p["budget"] * 2**dx
                face = colors[name] if p["filled"] else "white"
                label = name if i == 0 else None
                if p["rate"] is None:  # a tie: no discordant sample, no rate to bound
                    ax.errorbar([x], [0.5], marker="s", color=colors[name],
                                markerfacecolor=face, linestyle="none", label=label)
                    ax.annotate("0 / 0", (x, 0.5), textcoords="offset points", xytext=(0, 6),
                                ha="center", fontsize=7, color=colors[name])
                    continue
                ax.errorbar([x], [p["rate"]], yerr=[[p["rate"] - p["low"]],
                                                    [p["high"] - p["rate"]]],
                            marker="o", capsize=3, color=colors[name], markerfacecolor=face,
                            linestyle="none", label=label)
        ax.axhline(0.5, color="black", linewidth=0.8)
        budgets = sorted({p["budget"] for p in points if p["rule"] == rule})
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(rule, fontsize=9)
        ax.set_xlabel("budget (entries kept per kv head)")
        ax.set_ylabel(f"win rate wins / (wins + losses)\nexact interval at 1 - 0.05/{m}",
                      fontsize=8)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1)
    fig.suptitle(f"{title_text}\nwin rate, exact (Clopper-Pearson) interval at level "
                 f"1 - 0.05/m, m = {m} comparisons\n(Holm's family); filled: Holm p < 0.05, "
                 "hollow: not significant; 0 / 0: a tie", fontsize=9)
    return _save(plt, fig, out_dir / "dge_delta.png")


def accuracy_vs_k(scores: dict, title_text: str, out_dir: pathlib.Path) -> pathlib.Path | None:
    """accuracy_vs_k.png: mean score against k per rule and budget (dge solid, dge_w
    dashed, dge_d dotted, the prefill cell at k = 1), each line named by its cells' id with
    k as `k*` (`snapkv/dge/k*/b128`); written only when a run has several k."""
    cells = [parse_cell_id(c) for c in scores["averages"]]
    if len({c.k for c in cells if c.timing != "prefill" and not c.adaptive}) < 2:
        return None
    plt = _pyplot()
    rules = sorted({c.rule for c in cells if c.rule != "full"})
    fig, axes = plt.subplots(1, len(rules), figsize=(4.8 * len(rules), 3.8),
                             squeeze=False)
    for ax, rule in zip(axes[0], rules, strict=True):
        for budget in sorted({c.budget for c in cells if c.rule == rule}):
            _k_lines(ax, scores, cells, rule, budget)
        ax.set_title(rule)
        ax.set_xlabel("k (answer tokens generated with the full cache)")
        ax.set_ylabel("mean score")
        ax.legend(fontsize=7)
    fig.suptitle(title_text, fontsize=10)
    return _save(plt, fig, out_dir / "accuracy_vs_k.png")


def _k_lines(ax, scores: dict, cells: list[Cell], rule: str, budget: int) -> None:
    base = scores["averages"].get(f"{rule}/prefill/b{budget}", {}).get("mean")
    for timing, style in (("dge", "-"), ("dge_w", "--"), ("dge_d", ":")):
        pts = sorted((c.k, scores["averages"][c.id]["mean"]) for c in cells
                     if c.rule == rule and c.budget == budget
                     and c.timing == timing and not c.adaptive)
        if not pts:  # no cell of this timing in the run
            continue
        if base is not None:
            pts = [(1, base)] + [p for p in pts if p[0] != 1]
        if pts:
            name = f"{rule}/{timing}/k*/b{budget}"
            if base is not None:
                name += f" (k = 1: {rule}/prefill/b{budget})"
            ax.plot(*zip(*pts, strict=True), style, marker="o", label=name)
