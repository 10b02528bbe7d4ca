"""One cell in two run folders, paired on the samples both hold: a protocol against another.

    python -m experiments.paired_folders runs/ruler_agnostic runs/ruler_aware

For every cell both folders ran (the same `rule/timing/k/budget` id), on the samples both
predicted: accuracy in each (correct = row score >= 0.5, as `experiments.report`), wins
(right only in the first folder) and losses, the exact McNemar p and Holm's correction over
the cells, and how many samples got the same answer, character for character (what a change
that should not move tokens, such as a quantized cache, moved); and by row score (the mean,
rows higher / lower, an exact sign test with Holm's correction: what tasks scored by F1 or
Rouge-L, where few rows reach 0.5, compare on). What differs between the
folders is what is compared (their run identities are printed): `--protocol query_agnostic`
against `query_aware`, one model against another.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from experiments import suites
from experiments.report import folder_rows, latest_rows, sample_scores
from experiments.run_folder import read_config
from experiments.stats import CORRECT_AT, format_p, holm, mcnemar_exact
from experiments.suites.base import RowSettings


def check_same_data(first: pathlib.Path, second: pathlib.Path) -> None:
    """Refuses two folders whose rows may differ under the same ids (a ValueError naming
    what differs): a dataset both hold read from other data (its sha256 in config.json), a
    row-making setting of the suite that differs (seed, synthetic or RULER length), or a
    sample both predicted with other reference answers."""
    configs = [read_config(f) for f in (first, second)]
    for folder, config in zip((first, second), configs, strict=True):
        if config is None:
            raise ValueError(f"{folder} has no config.json, so the data its rows come from is "
                             "unknown; pair folders the runner wrote")
    ids = [c.get("identity", {}) for c in configs]
    data = [c.get("data", {}) for c in configs]
    problems = [f"{d} (sha256 {data[0][d][:12]} vs {data[1][d][:12]})" for d in data[0]
                if d in data[1] and data[0][d] != data[1][d]]
    for suite in {i.get("suite") for i in ids} & set(suites.SUITES):
        for key in suites.get(suite).identity(RowSettings()):
            if ids[0].get(key) != ids[1].get(key):
                problems.append(f"{key} {ids[0].get(key)!r} vs {ids[1].get(key)!r}")
    if not problems:
        answers = {(r["dataset"], r["sample_id"]): r["answers"] for r in folder_rows(first)}
        problems = [f"{d} sample {s} (answers {answers[d, s]!r:.40} vs {r!r:.40})"
                    for (d, s), r in {(r["dataset"], r["sample_id"]): r["answers"]
                                      for r in folder_rows(second)}.items()
                    if (d, s) in answers and answers[d, s] != r][:3]
    if problems:
        raise ValueError(
            f"{first} and {second} were run on other data ({'; '.join(problems)}): samples of "
            "the same id are not the same sample, so pairing them would be wrong; compare "
            "folders run on the same rows")


def compare(first: pathlib.Path, second: pathlib.Path,
            correct_at: float = CORRECT_AT) -> list[dict]:
    """One entry per cell of both folders, Holm-corrected over them, in `first`'s order;
    folders run on other data are refused (`check_same_data`)."""
    check_same_data(first, second)
    rows = folder_rows(first), folder_rows(second)
    a, b = map(sample_scores, rows)
    pa, pb = map(_answers, rows)
    out = []
    for cell in [c for c in a if c in b]:
        common = sorted(set(a[cell]) & set(b[cell]))
        if not common:
            continue
        mine = [a[cell][s] >= correct_at for s in common]
        theirs = [b[cell][s] >= correct_at for s in common]
        wins = sum(m and not t for m, t in zip(mine, theirs, strict=True))
        losses = sum(t and not m for m, t in zip(mine, theirs, strict=True))
        # by row score (tasks scored by F1, Rouge-L ...): higher / lower, an exact sign test
        higher = sum(a[cell][s] > b[cell][s] for s in common)
        lower = sum(a[cell][s] < b[cell][s] for s in common)
        out.append({"cell": cell, "samples": len(common),
                    "accuracy": round(100 * sum(mine) / len(common), 2),
                    "other_accuracy": round(100 * sum(theirs) / len(common), 2),
                    "wins": wins, "losses": losses, "p": mcnemar_exact(wins, losses),
                    "same_answer": sum(pa[cell][s] == pb[cell][s] for s in common),
                    "score": round(100 * sum(a[cell][s] for s in common) / len(common), 2),
                    "other_score": round(100 * sum(b[cell][s] for s in common) / len(common), 2),
                    "higher": higher, "lower": lower, "sign_p": mcnemar_exact(higher, lower)})
    for key in ("p", "sign_p"):
        for entry, adjusted in zip(out, holm([e[key] for e in out]), strict=True):
            entry[f"{key}_holm"] = adjusted
    return out


def _answers(rows: list[dict]) -> dict[str, dict[tuple[str, str], str]]:
    """cell id -> {(dataset, sample id): the answer text} (latest line per sample)."""
    out: dict[str, dict[tuple[str, str], str]] = {}
    for (dataset, cell), group in latest_rows(rows).items():
        out.setdefault(cell, {}).update({(dataset, r["sample_id"]): r["pred"] for r in group})
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
             "", "| cell | n | acc % | other acc % | wins | losses | McNemar p | p (Holm) "
             "| same answer | mean score | other mean score | higher / lower | sign p (Holm) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in compare(first, second):
        lines.append(f"| {e['cell']} | {e['samples']} | {e['accuracy']} | "
                     f"{e['other_accuracy']} | {e['wins']} | {e['losses']} | "
                     f"{format_p(e['p'])} | {format_p(e['p_holm'])} | {e['same_answer']} | "
                     f"{e['score']} | {e['other_score']} | {e['higher']} / {e['lower']} | "
                     f"{format_p(e['sign_p_holm'])} |")
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
    try:
        text = (json.dumps(compare(args.first, args.second), indent=2) + "\n" if args.json
                else table(args.first, args.second))
    except ValueError as e:  # RunFolderError among them: a config.json that does not parse
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
