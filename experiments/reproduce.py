"""The field's LongBench table for a model you have: one command, the published grid.

    python -m experiments.reproduce --model ~/Llama-3.1-8B-Instruct --data_dir ~/LongBench \\
        -- --dtype bfloat16 --batch_size 4

runs the 16 English LongBench tasks with the official protocol (`--suite longbench`) for
FullKV and SnapKV, PyramidKV, H2O and StreamingLLM, each at prefill, DGE(2) and DGE-W(2), at
the budgets KV-compression papers report (128, 256, 512, 1024, 2048 entries per kv head),
through `python -m experiments.longbench` (so a killed run resumes: rerun the command), and
writes OUT_DIR/paper_table.md:

- per budget, one row per rule and timing: every task's score, the mean over the 16 tasks
  and the mean of the six category means (LongBench's two averages; over the tasks present,
  and said so, when --datasets names fewer);
- DGE(2) - prefill, DGE-W(2) - prefill and DGE - DGE-W on both averages, per rule and budget
  (each further timing of `--timings`, e.g. dge_d and lookahead at the same k, against
  prefill too).

Arguments after `--` go to the runner unchanged (--dtype, --batch_size, --mesh,
--distributed, ...); --budgets, --datasets and --num_samples narrow the grid (a test, a
first look). `--table_only` rewrites the table from OUT_DIR's scores.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys

from experiments.cells import Cell
from experiments.suites import LONGBENCH
from experiments.suites.longbench import average_scores
from experiments.suites.longbench_config import ENGLISH_TASKS

RULES = ("full", "snapkv", "pyramidkv", "h2o", "streamingllm")
TIMINGS = ("prefill", "dge", "dge_w")  # the default; --timings adds dge_d, lookahead
K = 2
BUDGETS = (128, 256, 512, 1024, 2048)
NAMES = {"dge": "DGE", "dge_w": "DGE-W", "dge_d": "DGE-D", "lookahead": "LAQ"}
TABLE_FILE = "paper_table.md"


def runner_argv(args: argparse.Namespace) -> list[str]:
    """The `experiments.longbench` command line of the preset."""
    return [
        "--suite", LONGBENCH.name, "--model", args.model, "--data_dir", args.data_dir,
        "--datasets", ",".join(args.datasets), "--rules", ",".join(RULES),
        "--timings", ",".join(args.timings), "--k", str(K),
        "--budgets", ",".join(map(str, args.budgets)), "--out_dir", str(args.out_dir),
        *(["--num_samples", str(args.num_samples)] if args.num_samples else []), *args.runner,
    ]  # fmt: skip


def _cell(rule: str, timing: str, budget: int) -> str:
    return Cell(rule, timing, 1 if timing == "prefill" else K, budget).id


def _fmt(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}"


def _averages(per_task: dict[str, float]) -> tuple[float, float]:
    avg = average_scores(per_task)
    return avg["mean_en16"], avg["category_mean"]


def paper_table(scores: dict, budgets: tuple[int, ...], timings: tuple[str, ...] = TIMINGS) -> str:
    """Markdown: the score table per budget, then each timing - prefill (and DGE - DGE-W) on
    both averages."""
    tasks = [t for t in ENGLISH_TASKS if t in scores["datasets"]]
    by_cell = {c: {t: scores["datasets"][t][c] for t in tasks if c in scores["datasets"][t]}
               for t in tasks for c in scores["datasets"][t]}  # fmt: skip
    over = "16 tasks" if len(tasks) == 16 else f"the {len(tasks)} of 16 tasks run"
    head = ["budget", "rule", "timing", *tasks, f"mean ({over})", "category mean"]
    lines = [f"LongBench (English), official protocol; averages over {over}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    later = [t for t in timings if t != "prefill"]
    pairs = [(t, "prefill") for t in later]
    pairs += [("dge", "dge_w")] if {"dge", "dge_w"} <= set(later) else []
    names = [f"{NAMES.get(a, a)}({K}) - prefill" if b == "prefill" else "DGE - DGE-W"
             for a, b in pairs]  # fmt: skip
    deltas = ["", "DGE - baseline on both averages (mean / category mean):", "",
              "| budget | rule | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    rows = [(None, "full", "-")] + [(b, r, t) for b in budgets for r in RULES[1:]
                                    for t in timings]  # fmt: skip
    means = {}
    for budget, rule, timing in rows:
        per = by_cell.get(_cell(rule, timing, budget))
        if not per:
            continue
        means[(budget, rule, timing)] = _averages(per)
        cols = [_fmt(per.get(t)) for t in tasks] + [_fmt(x) for x in means[(budget, rule, timing)]]
        lines.append("| " + " | ".join([str(budget or "-"), rule, timing, *cols]) + " |")
    for budget in budgets:
        for rule in RULES[1:]:
            m = {t: means.get((budget, rule, t)) for t in timings}

            def diff(a, b, m=m):
                if m[a] is None or m[b] is None:
                    return "-"
                return " / ".join(_fmt(x - y) for x, y in zip(m[a], m[b], strict=True))

            deltas.append(f"| {budget} | {rule} | "
                          + " | ".join(diff(a, b) for a, b in pairs) + " |")
    return "\n".join(lines + deltas) + "\n"


def write_table(
    out_dir: pathlib.Path, budgets: tuple[int, ...], timings: tuple[str, ...] = TIMINGS
) -> str:
    """Writes OUT_DIR/paper_table.md from OUT_DIR/scores.json; returns its text."""
    scores_file = out_dir / "scores.json"
    if not scores_file.is_file():
        raise SystemExit(f"error: {scores_file} does not exist; run the preset first")
    text = paper_table(json.loads(scores_file.read_text()), budgets, timings)
    (out_dir / TABLE_FILE).write_text(text)
    return text


def parse(argv: list[str]) -> argparse.Namespace:
    runner = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m experiments.reproduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face folder (or a model name)")
    p.add_argument("--data_dir", required=True, help="the official LongBench jsonl files")
    p.add_argument("--out_dir", type=pathlib.Path, default=None,
                   help="default: runs/reproduce/<the model folder's name>")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    p.add_argument("--datasets", default=",".join(ENGLISH_TASKS))
    p.add_argument("--num_samples", type=int, default=None, help="default: every row")
    p.add_argument("--timings", default=",".join(TIMINGS),
                   help="prefill, dge, dge_w (the default), dge_d, lookahead; all at k = 2")
    p.add_argument("--table_only", action="store_true", help="rewrite the table only")
    args = p.parse_args(argv)
    args.budgets = tuple(int(b) for b in args.budgets.split(","))
    args.datasets = args.datasets.split(",")
    args.timings = tuple(args.timings.split(","))
    unknown = sorted(set(args.timings) - {"prefill", *NAMES})
    if unknown or "prefill" not in args.timings:
        p.error(f"--timings: give prefill and any of {', '.join(NAMES)} (got {args.timings})")
    args.out_dir = args.out_dir or pathlib.Path("runs/reproduce") / pathlib.Path(args.model).name
    args.runner = runner
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if not args.table_only:
        cmd = [sys.executable, "-m", "experiments.longbench", *runner_argv(args)]
        rc = subprocess.run(cmd).returncode
        if rc:
            return rc
    print(write_table(args.out_dir, args.budgets, args.timings), end="")
    print(f"wrote {args.out_dir / TABLE_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
