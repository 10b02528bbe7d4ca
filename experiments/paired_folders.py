"""One cell in two run folders, paired on the samples both hold: a protocol against another.

    python -m experiments.paired_folders runs/ruler_agnostic runs/ruler_aware

For every cell both folders ran (the same `rule/timing/k/budget` id), on the samples both
predicted: accuracy in each (correct = row score >= 0.5, as `experiments.report`), wins
(right only in the first folder) and losses, the exact McNemar p and Holm's correction over
the cells. What differs between the folders is what is compared (their run identities are
printed): `--protocol query_agnostic` against `query_aware`, one model against another.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from experiments.report import folder_rows, sample_scores
from experiments.run_folder import read_config
from experiments.stats import format_p, holm, mcnemar_exact


def compare(first: pathlib.Path, second: pathlib.Path, correct_at: float = 0.5) -> list[dict]:
    """One entry per cell of both folders, Holm-corrected over them, in `first`'s order."""
    a, b = sample_scores(folder_rows(first)), sample_scores(folder_rows(second))
    out = []
    for cell in [c for c in a if c in b]:
        common = sorted(set(a[cell]) & set(b[cell]))
        if not common:
            continue
        mine = [a[cell][s] >= correct_at for s in common]
        theirs = [b[cell][s] >= correct_at for s in common]
        wins = sum(m and not t for m, t in zip(mine, theirs, strict=True))
        losses = sum(t and not m for m, t in zip(mine, theirs, strict=True))
        out.append({"cell": cell, "samples": len(common),
                    "accuracy": round(100 * sum(mine) / len(common), 2),
                    "other_accuracy": round(100 * sum(theirs) / len(common), 2),
                    "wins": wins, "losses": losses, "p": mcnemar_exact(wins, losses)})
    for entry, adjusted in zip(out, holm([e["p"] for e in out]), strict=True):
        entry["p_holm"] = adjusted
    return out


def _differences(first: pathlib.Path, second: pathlib.Path) -> str:
    """The identity entries that differ between the folders."""
    ids = [(read_config(f) or {}).get("identity", {}) for f in (first, second)]
    keys = sorted(set(ids[0]) | set(ids[1]))
    diff = [f"{k}: {ids[0].get(k)!r} vs {ids[1].get(k)!r}" for k in keys
            if ids[0].get(k) != ids[1].get(k) and k != "model_files"]
    return "; ".join(diff) or "none"


def table(first: pathlib.Path, second: pathlib.Path) -> str:
    """Markdown: the folders, what differs between their identities, one row per cell."""
    lines = [f"{first} against {second} (identities differ in: {_differences(first, second)})",
             "", "| cell | n | acc % | other acc % | wins | losses | McNemar p | p (Holm) |",
             "|---|---|---|---|---|---|---|---|"]
    for e in compare(first, second):
        lines.append(f"| {e['cell']} | {e['samples']} | {e['accuracy']} | "
                     f"{e['other_accuracy']} | {e['wins']} | {e['losses']} | "
                     f"{format_p(e['p'])} | {format_p(e['p_holm'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.paired_folders",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("first", type=pathlib.Path)
    p.add_argument("second", type=pathlib.Path)
    p.add_argument("--json", action="store_true", help="the entries as JSON")
    args = p.parse_args(argv)
    for folder in (args.first, args.second):
        if not (folder / "predictions.jsonl").is_file():
            print(f"error: {folder} holds no predictions.jsonl (not a run folder)",
                  file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(compare(args.first, args.second), indent=2))
    else:
        print(table(args.first, args.second), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
