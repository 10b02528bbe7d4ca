"""What anchoring to the first question costs the others: a shared-context run, by cell.

    python -m experiments.anchoring runs/shared

In a `--protocol shared_context` folder every context's first row is the anchor DGE and
DGE-W draft on. The later questions differ from it in content, so their accuracy alone
mixes anchoring with difficulty; here each cell's accuracy on the anchor and on the later
questions counts only the questions FullKV answers (correct = row score >= 0.5), with a
two-sided Fisher exact p of anchor against later and Holm's correction over the cells.
The folder must hold FullKV (`--rules full,...`).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from experiments.report import folder_rows, latest_rows, sample_scores
from experiments.stats import fisher_exact, format_p, holm


def anchoring(rows: list[dict], correct_at: float = 0.5) -> list[dict]:
    """Per cell (FullKV's own excluded): anchor and later accuracy on FullKV's right
    answers, the Fisher p and its Holm correction."""
    scores = sample_scores(rows)
    order = {(r["dataset"], r["sample_id"]): r["question_index"]
             for group in latest_rows(rows).values() for r in group if "question_index" in r}
    if "full" not in scores or not order:
        raise ValueError("a shared_context run folder with a FullKV cell is needed")
    known = [s for s, v in scores["full"].items() if v >= correct_at and s in order]
    out = []
    for cell, per in scores.items():
        if cell == "full":
            continue
        counts = {(q, ok): 0 for q in (True, False) for ok in (True, False)}
        for s in known:
            if s in per:
                counts[(order[s] == 0, per[s] >= correct_at)] += 1
        a, b = counts[(True, True)], counts[(True, False)]
        c, d = counts[(False, True)], counts[(False, False)]
        out.append({"cell": cell, "anchor": (a, a + b), "later": (c, c + d),
                    "p": fisher_exact(a, b, c, d)})
    for entry, adjusted in zip(out, holm([e["p"] for e in out]), strict=True):
        entry["p_holm"] = adjusted
    return out


def table(folder: pathlib.Path) -> str:
    lines = [f"{folder}: accuracy on the questions FullKV answers, anchor against later", "",
             "| cell | anchor | later | Fisher p | p (Holm) |", "|---|---|---|---|---|"]
    for e in anchoring(folder_rows(folder)):
        (a, n), (c, m) = e["anchor"], e["later"]
        pct = [f"{100 * x / y:.1f} % ({x}/{y})" if y else "-" for x, y in ((a, n), (c, m))]
        lines.append(f"| {e['cell']} | {pct[0]} | {pct[1]} | {format_p(e['p'])} | "
                     f"{format_p(e['p_holm'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.anchoring",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=pathlib.Path)
    args = p.parse_args(argv)
    try:
        print(table(args.folder), end="")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
