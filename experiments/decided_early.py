"""Rows a drafting cell had answered before it evicted: FullKV's first k tokens already
score as a correct answer.

    python -m experiments.decided_early runs/m44/smollm2/ruler [--k 2,4,8]

`dge`, `dge_w` and `dge_d` at k generate their first k answer tokens with the full cache and
keep them (greedy: FullKV's first k tokens). Where those k tokens alone already score >= 0.5
(`experiments.report`'s threshold), the row is right whatever the eviction keeps (for a
metric that more text never lowers: the needle suites' substring matches; under F1 or ROUGE
the count only points there), so such a cell's accuracy there measures no eviction; a cell
that throws its lookahead tokens away (`lookahead`) or compresses from the first token
(`prefill`, `decode`) has no such rows.
Per dataset and k: FullKV's correct rows, and how many of them its first k tokens decide.

The generated ids are not stored, so FullKV's answer text is re-encoded with the run's
tokenizer; the rows whose re-encoding has another length than the tokens generated (EOS
not counted) are counted, so the approximation shows.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from collections.abc import Sequence

from experiments import suites
from experiments.report import folder_rows, latest_rows
from experiments.run_folder import read_config
from experiments.stats import CORRECT_AT


def drafted_ks(cells: Sequence[str]) -> list[int]:
    """The k of every drafting cell id (`<rule>/dge|dge_w|dge_d/k<k>/...`; adaptive ones,
    whose k varies per row, left out)."""
    found = {int(m.group(1)) for c in cells if (m := re.search(r"/dge(?:_w|_d)?/k(\d+)/", c))}
    return sorted(found)


def decided(full_rows: list[dict], ks: Sequence[int], tokenizer) -> dict[str, dict]:
    """dataset -> {"rows", "correct", "re_encoded_apart", k: rows decided by FullKV's first
    k tokens} over FullKV's rows (module docstring)."""
    out: dict[str, dict] = {}
    for r in full_rows:
        d = out.setdefault(r["dataset"], {"rows": 0, "correct": 0, "re_encoded_apart": 0}
                           | dict.fromkeys(ks, 0))  # fmt: skip
        score = suites.row_score(r["dataset"], r["pred"], r["answers"], r.get("all_classes"))
        d["rows"] += 1
        if score < CORRECT_AT:
            continue
        d["correct"] += 1
        ids = tokenizer.encode(r["pred"], add_special_tokens=False)
        if r.get("new_tokens") is not None and len(ids) not in (r["new_tokens"],
                                                                r["new_tokens"] - 1):
            d["re_encoded_apart"] += 1
        for k in ks:
            head = tokenizer.decode(ids[:k])
            d[k] += suites.row_score(r["dataset"], head, r["answers"],
                                     r.get("all_classes")) >= CORRECT_AT  # fmt: skip
    return out


def table(counts: dict[str, dict], ks: Sequence[int]) -> str:
    """Markdown: one row per dataset (and all of them), FullKV's correct rows and those its
    first k tokens decide, per k."""
    head = " | ".join(f"decided by k = {k}" for k in ks)
    lines = [f"| dataset | rows | FullKV correct | {head} | re-encoded apart |",
             "|---" * (4 + len(ks)) + "|"]
    total = {key: sum(c[key] for c in counts.values())
             for key in ("rows", "correct", "re_encoded_apart", *ks)}  # fmt: skip
    for name, c in [*counts.items(), ("all", total)]:
        cells = " | ".join(str(c[k]) for k in ks)
        lines.append(f"| {name} | {c['rows']} | {c['correct']} | {cells} | "
                     f"{c['re_encoded_apart']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.decided_early",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=pathlib.Path)
    p.add_argument("--k", default=None,
                   help="comma-separated k (default: the folder's drafting cells')")
    args = p.parse_args(argv)
    try:
        rows = folder_rows(args.folder)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    groups = latest_rows(rows)
    full = [r for (_, cell), group in groups.items() if cell == "full" for r in group]
    if not full:
        print(f"error: {args.folder} has no FullKV cell ('full') to read answers from; run "
              "it with --rules full,...", file=sys.stderr)
        return 2
    ks = ([int(k) for k in args.k.split(",")] if args.k
          else drafted_ks({cell for _, cell in groups}))  # fmt: skip
    if not ks:
        print("error: no drafting cell (dge, dge_w, dge_d) in the folder; give --k",
              file=sys.stderr)
        return 2
    from dge_jax.checkpoints.embedded import resolve_model_dir
    from dge_jax.checkpoints.tokenizer import Tokenizer

    model = (read_config(args.folder) or {}).get("identity", {}).get("model")
    tokenizer = Tokenizer.from_folder(resolve_model_dir(model))
    print(f"{args.folder} ({model}): FullKV's correct rows whose first k answer tokens "
          f"already score >= {CORRECT_AT}")
    print()
    print(table(decided(full, ks, tokenizer), ks), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
