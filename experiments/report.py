"""Scores, a Markdown table and plots, rebuilt from a run's prediction file alone.

    python -m experiments.report OUT_DIR                 # rebuild one run's report
    python -m experiments.report OUT_DIR OUT_DIR [...]   # which claims replicate across suites
    python -m experiments.report OUT_DIR OUT_DIR [...] --out DIR   # and write DIR/results.md

Reads OUT_DIR/predictions.jsonl (and the per-process predictions.p<i>.jsonl of a
distributed run, merged), scores every (dataset, cell) with the official metrics,
and writes scores.json, results.md (a header naming the model, suite, n, run id, dates,
dge_jax version and commands; n for every cell, paired McNemar comparisons against the
prefill baseline with Holm-corrected p, and a plain-language summary), score_vs_budget.png,
dge_delta.png (the paired comparisons' win rates) and, for runs over several k,
accuracy_vs_k.png (`experiments.plots`), then one stderr line naming what it wrote. Lines of
several run configurations are refused, never averaged together; a sample predicted twice
under the same configuration counts once (the last line).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
from collections import defaultdict

from experiments import heatmaps, plots, suites
from experiments.cells import WITH_K, Cell, cell_order, parse_cell_id
from experiments.predictions import read_folder
from experiments.replication import (
    SIGNIFICANT,
    Evidence,
    replication,
    replication_matrix,
    replication_table,
)
from experiments.replication import summary as replication_summary
from experiments.report_header import header
from experiments.run_folder import RunFolderError, check_lines, read_config
from experiments.stats import CORRECT_AT, format_p, holm, mcnemar_exact


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
        scores[dataset][cell] = suites.score_dataset(
            dataset, [r["pred"] for r in group], [r["answers"] for r in group], all_classes
        )
        counts[dataset][cell] = len(group)
    cells = sorted({c for per in scores.values() for c in per}, key=cell_order)
    averages = {}
    for cell in cells:
        per = {d: s[cell] for d, s in scores.items() if cell in s}
        entry = {"mean": round(sum(per.values()) / len(per), 2), "tasks": len(per),
                 "n": sum(counts[d][cell] for d in per)}
        # the suites' own averages (LongBench's official two, once all 16 English tasks ran)
        entry.update({name: _round(value) for name, value in suites.summary(per).items()})
        averages[cell] = entry
    return {"datasets": dict(scores), "averages": averages, "counts": dict(counts)}


def _round(x: float) -> float | None:
    return None if x is None or math.isnan(x) else round(x, 2)


def markdown_table(scores: dict) -> str:
    """Cells as rows; n (samples scored), datasets, the mean over the tasks that ran, and
    both official LongBench averages when all 16 English tasks ran, as columns."""
    datasets = sorted(scores["datasets"])
    averages = scores["averages"]
    extra = ["mean_en16", "category_mean"] if any(
        "mean_en16" in a for a in averages.values()) else []
    tasks = max(a["tasks"] for a in averages.values())
    mean = f"mean ({tasks} task{'s' if tasks > 1 else ''})"
    decoding = any(parse_cell_id(c).decode_budget for c in averages)
    header = ["rule", "timing", "k", "budget", *(["decode"] if decoding else []), "n",
              *datasets, mean, *extra]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell in sorted(averages, key=cell_order):
        c = parse_cell_id(cell)
        drafts = c.timing in WITH_K and c.rule != "full"  # k means nothing else
        row = [c.rule, "-" if c.rule == "full" else c.timing,
               f"{c.k}{'a' if c.adaptive else ''}" if drafts else "-",
               "-" if c.rule == "full" else str(c.budget)]
        if decoding:  # decode budget / interval of cells that compress while decoding
            row.append(f"{c.decode_budget} / {c.interval}" if c.decode_budget else "-")
        row.append(str(averages[cell]["n"]))
        row += [_fmt(scores["datasets"][d].get(cell)) for d in datasets]
        row += [_fmt(averages[cell].get(name)) for name in ["mean", *extra]]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def sample_scores(rows: list[dict]) -> dict[str, dict[tuple[str, str], float]]:
    """cell id -> {(dataset, sample id): row score in [0, 1]} (latest line per sample)."""
    out: dict[str, dict[tuple[str, str], float]] = defaultdict(dict)
    for (dataset, cell), group in latest_rows(rows).items():
        for r in group:
            out[cell][(dataset, r["sample_id"])] = suites.row_score(
                dataset, r["pred"], r["answers"], r.get("all_classes"))
    return out


def paired_comparisons(rows: list[dict], correct_at: float = CORRECT_AT) -> list[dict]:
    """Each prefill cell against FullKV (what compression costs), each DGE / DGE-W cell
    against its rule's prefill cell at the same budget, then each DGE cell against the DGE-W
    cell of the same k and budget (the drafted queries' own effect, timing held fixed). A cell
    that also compresses while decoding is compared with FullKV and with its prefill-only
    form (the same cell without it; for timing "decode", the prefill cell at its budget), and
    a DGE one with its DGE-W twin; each DGE / DGE-W cell also against the `decode` timing at
    interval k and its budget (`<rule>/decode/b<B>/d<B>/i<k>`), where the run has it. All on
    the samples both have: a sample is correct when
    its row score >=
    `correct_at`; wins are samples only the cell gets right, losses those only the other.
    For graded metrics (ROUGE, the fraction of answers found), where the threshold can hide a
    difference, `higher` / `lower` count the samples whose row score is strictly above /
    below the baseline's, with an exact sign test (`p_scores`, Holm-corrected over the same
    comparisons as `p_scores_holm`)."""
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
        higher = sum(per_cell[cell][s] > base[s] for s in common)
        lower = sum(per_cell[cell][s] < base[s] for s in common)
        ks = k_used.get(cell, [])
        return {
            "cell": cell, "baseline": base_id, "samples": len(common),
            "accuracy": round(100 * sum(mine) / len(common), 2),
            "baseline_accuracy": round(100 * sum(theirs) / len(common), 2),
            "wins": wins, "losses": losses, "p": mcnemar_exact(wins, losses),
            "mean_k": round(sum(ks) / len(ks), 2) if ks else None,
            # the sign test is McNemar's exact binomial on the discordant pairs by score
            "higher": higher, "lower": lower, "p_scores": mcnemar_exact(higher, lower),
        }

    cells = [(cell, parse_cell_id(cell)) for cell in sorted(per_cell, key=cell_order)]
    decoding = [(cell, c) for cell, c in cells if c.decode_budget]
    cells = [(cell, c) for cell, c in cells if not c.decode_budget]
    drafted = [(cell, c) for cell, c in cells if c.rule != "full" and c.timing != "prefill"]
    against_prefill = [pair(cell, f"{c.rule}/prefill/b{c.budget}") for cell, c in drafted]
    against_dge_w = [pair(cell, dataclasses.replace(c, timing="dge_w").id)
                     for cell, c in drafted + decoding if c.timing in ("dge", "dge_d")]
    # DGE's observation decomposed: window and drafts (dge) against drafts alone (dge_d)
    against_dge_d = [pair(cell, dataclasses.replace(c, timing="dge_d").id)
                     for cell, c in drafted + decoding if c.timing == "dge"]  # fmt: skip
    # keeping the drafts (dge) against LAQ's thrown-away lookahead of the same k
    against_lookahead = [pair(cell, dataclasses.replace(c, timing="lookahead").id)
                         for cell, c in drafted if c.timing == "dge" and not c.adaptive]
    against_full = [pair(cell, "full") for cell, c in cells + decoding
                    if c.rule != "full" and c.timing in ("prefill", "decode")]
    prefill_only = [pair(cell, f"{c.rule}/prefill/b{c.budget}" if c.timing == "decode"
                         else c.without_decode.id) for cell, c in decoding]  # fmt: skip
    # the nearest mechanism (kvpress's DecodingPress at compression_interval = k): compress
    # after k decode steps with their queries, to the same budget, and every k after that
    against_decode = [pair(cell, Cell(c.rule, "decode", 1, c.budget, False, c.budget, c.k).id)
                      for cell, c in drafted if not c.adaptive]  # fmt: skip
    comparisons = [p for p in against_full + against_prefill + prefill_only + against_dge_w
                   + against_dge_d + against_lookahead + against_decode
                   if p is not None]  # fmt: skip
    for c, adjusted in zip(comparisons, holm([c["p"] for c in comparisons]), strict=True):
        c["p_holm"] = adjusted
    for c, adjusted in zip(comparisons, holm([c["p_scores"] for c in comparisons]), strict=True):
        c["p_scores_holm"] = adjusted
    return comparisons


def paired_table(comparisons: list[dict]) -> str:
    """Markdown table of `paired_comparisons`."""
    header = ["cell", "vs", "n", "acc %", "base acc %", "wins", "losses", "McNemar p",
              "p (Holm)", "mean k", "score higher / lower", "sign p (Holm)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in comparisons:
        lines.append("| " + " | ".join(str(x) for x in [
            c["cell"], c["baseline"], c["samples"], c["accuracy"], c["baseline_accuracy"],
            c["wins"], c["losses"], format_p(c["p"]), format_p(c["p_holm"]),
            "-" if c["mean_k"] is None else c["mean_k"],
            f"{c['higher']} / {c['lower']}", format_p(c["p_scores_holm"]),
        ]) + " |")
    return "\n".join(lines) + "\n"


def summary(scores: dict, comparisons: list[dict], config: dict | None) -> str:
    """A few plain sentences under the tables: what was compared, on what, what is significant."""
    averages = scores["averages"]
    cells = [parse_cell_id(c) for c in averages]
    budgets = sorted({c.budget for c in cells if c.rule != "full"})
    series = list(dict.fromkeys(plots.without_budget(c) for c in sorted(averages, key=cell_order)
                                if c != "full"))
    n = sorted({a["n"] for a in averages.values()})
    tasks = max(a["tasks"] for a in averages.values())
    where = ""
    if config is not None:
        ident = config["identity"]
        where = f" of {ident['model']} on the {ident['suite']} suite"
    lines = [f"**Summary.** {len(averages)} cells{where}, {_span(n)} samples each over "
             f"{tasks} task{'s' if tasks > 1 else ''}"
             + (f": {'full and ' if 'full' in averages else ''}{', '.join(series)} at budget"
                f"{'s' if len(budgets) > 1 else ''} {', '.join(map(str, budgets))} entries "
                "per kv head" if series else "") + "."]
    if "full" in averages:
        lines.append(f"full scores {averages['full']['mean']:.2f} (mean over tasks).")
    if comparisons:
        significant = [c for c in comparisons if c["p_holm"] < SIGNIFICANT]
        lines.append(
            f"Of {len(comparisons)} paired comparisons (correct = row score >= {CORRECT_AT}; "
            "exact McNemar, Holm-corrected over all of them), "
            + (f"{len(significant)} differ{'s' if len(significant) == 1 else ''} "
               f"significantly at {SIGNIFICANT}: " + "; ".join(map(_pair_text, significant))
               if significant else f"none differs significantly at {SIGNIFICANT}") + ".")
        drafted = [c for c in comparisons if c["baseline"] != "full"]
        if all(_tie(c) for c in comparisons):  # no gap to name: say that nothing differs
            lines.append(f"No comparison differs: each of the {len(comparisons)} has 0 wins "
                         "and 0 losses (p = 1), the same samples correct on both sides.")
        elif drafted and not any(c in significant for c in drafted):
            lines.append("No comparison against a baseline other than full is significant "
                         "after correction; " + (
                             "none of them differs (0 wins and 0 losses each)."
                             if all(_tie(c) for c in drafted) else
                             f"the largest gap is {_largest(drafted)}."))
        lines.append("One suite's effect is a hypothesis until it replicates on another.")
    return " ".join(lines) + "\n"


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def _pair_text(c: dict) -> str:
    return (f"{c['cell']} vs {c['baseline']}: {c['accuracy']}% vs {c['baseline_accuracy']}% "
            f"({c['wins']} wins / {c['losses']} losses, p = {format_p(c['p_holm'])})")


def _tie(c: dict) -> bool:
    """No discordant sample: both cells right on the same samples (McNemar p = 1)."""
    return c["wins"] == c["losses"] == 0


def _largest(comparisons: list[dict]) -> str:
    c = max(comparisons, key=lambda c: (abs(c["wins"] - c["losses"]), -c["p"]))
    return (f"{c['cell']} vs {c['baseline']} ({c['wins']} wins / {c['losses']} losses, "
            f"p = {format_p(c['p'])} before correction)")


PAIRED_INTRO = (
    "\nPaired comparisons on the same samples: each `<rule>/prefill/b<budget>` cell against "
    "`full`, each `dge` / `dge_w` / `dge_d` cell against the prefill cell of its rule and "
    "budget, then each `dge` and `dge_d` cell against the `dge_w` cell of the same k and "
    "budget and each `dge` cell against the `dge_d` and `lookahead` ones, each drafting "
    "cell against the `decode` timing at interval k and the same budget (kvpress's "
    "DecodingPress at compression_interval = k) where the run has it, and each cell that "
    "compresses while decoding against `full` and its prefill-only cell (correct = row score "
    f">= {CORRECT_AT}; exact McNemar test; Holm's correction over all rows; and, by row score, "
    "higher / lower with an exact sign test):\n\n")


def folder_rows(out_dir: pathlib.Path) -> list[dict]:
    """Every prediction of a folder, the files of all its processes merged (one
    configuration: checked)."""
    rows = read_folder(out_dir, warn=lambda m: print(f"warning: {m}", file=sys.stderr))
    if not rows:
        raise FileNotFoundError(f"no predictions in {out_dir} (predictions*.jsonl)")
    check_lines(rows, str(out_dir))
    return rows


def write_report(out_dir: str | pathlib.Path) -> dict:
    """Scores the run in `out_dir` and writes scores.json, the plots and results.md (which
    opens with the run's `header`); says on stderr, in one line, what it wrote."""
    out_dir = pathlib.Path(out_dir)
    rows = folder_rows(out_dir)
    config = read_config(out_dir)
    if config is not None and "identity" not in config:
        config = None  # a folder of the first runner: no identity to title the plots with
    scores = score_rows(rows)
    comparisons = paired_comparisons(rows)
    scores["paired"] = comparisons
    (out_dir / "scores.json").write_text(json.dumps(scores, indent=2) + "\n")
    title = plots.title(config, scores)
    per_sample = sample_scores(rows)
    written = [plots.score_vs_budget(scores, per_sample, title, out_dir),
               plots.dge_delta(comparisons, title, out_dir),
               plots.accuracy_vs_k(scores, title, out_dir),
               heatmaps.niah_heatmap(rows, title, out_dir)]
    plot_files = [p.name for p in written if p is not None]
    text = header(scores, config, rows, plot_files) + markdown_table(scores)
    if comparisons:
        text += PAIRED_INTRO + paired_table(comparisons)
    text += "\n" + summary(scores, comparisons, config) + question_order(rows)
    text += group_scores(rows)
    (out_dir / "results.md").write_text(text)
    print(f"wrote {out_dir / 'results.md'}, {', '.join(['scores.json', *plot_files])}",
          file=sys.stderr)
    return scores


def question_order(rows: list[dict]) -> str:
    """A shared-context run's comparisons again on the anchor questions alone (question 0 of
    each context, the one DGE drafts on) and on the later ones, Holm within each ('' for
    runs without `question_index`: `experiments.context_protocols`)."""
    text = ""
    for title, keep in (("the anchor question of each context (question_index 0)", 0),
                        ("the later questions (question_index >= 1)", 1)):  # fmt: skip
        part = [r for r in rows if "question_index" in r and min(r["question_index"], 1) == keep]
        comparisons = paired_comparisons(part)
        if comparisons:
            text += f"\nShared contexts, {title}:\n\n" + paired_table(comparisons)
    return text


def group_scores(rows: list[dict]) -> str:
    """Each cell's mean row score (%, with n) per value of each group the suite records on
    its lines (`Suite.row_groups`: LongBench v2's difficulty and length); '' without."""
    grouped = [r for group in latest_rows(rows).values() for r in group if "groups" in r]
    if not grouped:
        return ""
    cells = sorted({r["cell"] for r in grouped}, key=cell_order)
    text = ""
    for key in sorted({k for r in grouped for k in r["groups"]}):
        values = sorted({r["groups"][key] for r in grouped if key in r["groups"]})
        lines = [f"| cell | {' | '.join(f'{key} = {v}' for v in values)} |",
                 "|---|" + "---|" * len(values)]
        for cell in cells:
            cols = []
            for v in values:
                part = [suites.row_score(r["dataset"], r["pred"], r["answers"],
                                         r.get("all_classes"))
                        for r in grouped if r["cell"] == cell and r["groups"].get(key) == v]
                cols.append(f"{100 * sum(part) / len(part):.1f} (n={len(part)})" if part else "-")
            lines.append(f"| {cell} | " + " | ".join(cols) + " |")
        text += f"\nBy {key}:\n\n" + "\n".join(lines) + "\n"
    return text


def folder_comparisons(out_dir: str | pathlib.Path) -> Evidence:
    """One folder's evidence for replication: its suite, identity and paired comparisons."""
    out_dir = pathlib.Path(out_dir)
    config = read_config(out_dir)
    if config is None or "identity" not in config:
        raise RunFolderError(f"{out_dir} has no config.json of this runner: its suite is "
                             "unknown, so it cannot count as evidence for a replication")
    rows = folder_rows(out_dir)
    identity = config["identity"]
    return Evidence(str(out_dir), identity["suite"], identity, paired_comparisons(rows))


def replication_report(folders: list[str]) -> str:
    """The replication table of several run folders and its one-paragraph summary."""
    return _replication_text(_replication_entries(folders))


def _replication_entries(folders: list[str]) -> list[dict]:
    entries = replication(folder_comparisons(f) for f in folders)
    if not entries:
        raise ValueError(f"the folders {folders} hold no paired comparison")
    return entries


def _replication_text(entries: list[dict]) -> str:
    return replication_table(entries) + "\n" + replication_summary(entries)


def write_replication(folders: list[str], out_dir: str | pathlib.Path, command: str) -> str:
    """Writes out_dir/results.md (summary, one row per claim with a column per folder, then
    every entry) and out_dir/replication.json; returns the Markdown."""
    entries = _replication_entries(folders)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = (f"# Replication over {len(folders)} run folders\n\n`{command}`\n\n"
            + replication_summary(entries) + "\nOne row per claim (wins / losses against the "
            "baseline, Holm-corrected exact McNemar p within each folder):\n\n"
            + replication_matrix(entries) + "\nEvery entry:\n\n" + replication_table(entries))
    (out_dir / "results.md").write_text(text)
    (out_dir / "replication.json").write_text(json.dumps(
        {"folders": folders, "command": command, "entries": entries}, indent=2) + "\n")
    return text


USAGE = "usage: python -m experiments.report OUT_DIR [OUT_DIR ...] [--out REPLICATION_DIR]"


def main(argv: list[str] | None = None) -> int:
    """One folder: rebuild its report. Several: print which of their claims replicate (and,
    with --out DIR, write DIR/results.md and DIR/replication.json)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    out = None
    if "--out" in argv:
        at = argv.index("--out")
        if at + 1 >= len(argv):
            print(f"{USAGE}\nerror: --out needs a folder", file=sys.stderr)
            return 2
        out = argv[at + 1]
        argv = argv[:at] + argv[at + 2:]
    if not argv or any(a.startswith("-") for a in argv):
        print(USAGE, file=sys.stderr)
        return 2
    if out is not None and len(argv) < 2:
        print(f"{USAGE}\nerror: --out writes a replication: give two or more run folders",
              file=sys.stderr)
        return 2
    try:
        if len(argv) > 1:
            if out is None:
                print(replication_report(argv), end="")
            else:
                command = "python -m experiments.report " + " ".join([*argv, "--out", out])
                print(write_replication(argv, out, command), end="")
            return 0
        write_report(argv[0])
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print((pathlib.Path(argv[0]) / "results.md").read_text(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
