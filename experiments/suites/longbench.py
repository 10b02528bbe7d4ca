"""LongBench v1 (THUDM/LongBench) as a suite: the official `{dataset}.jsonl` files, the official
prompts, generation lengths, chat-template exceptions, samsum's stop rule and metrics, all read
from `experiments.suites.longbench_config` (the official tables written down as data).

Rows come from a folder of official files (--data_dir, else $DGE_LONGBENCH_DIR), each checked
against the strict schema of `experiments.rows`, so a bad row is an error naming the file, line
and field instead of a silently wrong score. The schema holds what the task's metric reads out
of each answer (`ANSWER_FORMS`): retrieval's paragraph number would otherwise fail only when
the finished run is scored, and a count that is not a number could never be matched.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from experiments import metrics, rows
from experiments.suites import longbench_config as config
from experiments.suites.base import RowSettings, StopRule, Suite, no_stop_rule

DATA_DIR_ENV = "DGE_LONGBENCH_DIR"
ROW_KEYS = rows.LONGBENCH_KEYS
OFFICIAL_FIX = "fix the row or re-download the official file"
# What a metric reads out of each reference answer (`experiments.metrics`), by metric name:
# checked when rows are read (`row_schema`, kvpress's LongBench tasks too).
ANSWER_FORMS: Mapping[str, rows.Kind] = MappingProxyType({
    "retrieval": rows.Kind('holding "Paragraph N" (the retrieval metric reads N from it)',
                           lambda a: re.search(r"Paragraph (\d+)", a) is not None),
    "retrieval_zh": rows.Kind('holding "段落N" (the retrieval_zh metric reads N from it)',
                              lambda a: re.search(r"段落(\d+)", a) is not None),
    "count": rows.Kind("a number in digits (the count metric matches the prediction's numbers "
                       "with it)", lambda a: re.fullmatch(r"\d+", a) is not None),
})  # fmt: skip


def answers_kind(metric: str) -> rows.Kind:
    """The `answers` a LongBench metric can score: non-blank, of the metric's form if any."""
    form = ANSWER_FORMS.get(metric)
    return rows.ANSWERS if form is None else rows.answers_each(form)


def resolve_data_dir(path: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder of `{dataset}.jsonl` files: `path`, else $DGE_LONGBENCH_DIR; it must exist."""
    if path is None:
        path = os.environ.get(DATA_DIR_ENV)
        if not path:
            raise FileNotFoundError(
                f"no LongBench data folder: set {DATA_DIR_ENV} (or pass the runner's data-dir "
                f"flag) to a folder of {{dataset}}.jsonl files in the official schema"
            )
    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"LongBench data folder {folder} does not exist; set {DATA_DIR_ENV} (or the runner's "
            f"data-dir flag) to a folder of {{dataset}}.jsonl files"
        )
    return folder


def row_schema(dataset: str) -> rows.Schema:
    """The official row schema of a LongBench dataset (its template's fields; the class list
    of the classification tasks; the answers its metric can read)."""
    metric = config.DATASET2METRIC[dataset]
    return rows.longbench_schema(dataset, config.DATASET2PROMPT[dataset],
                                 needs_classes=metric == "classification",
                                 answers=answers_kind(metric))


def load_rows(
    data_dir: str | os.PathLike | None, dataset: str, num_samples: int | None = None
) -> list[dict]:
    """The first `num_samples` rows (all if None) of `{data_dir}/{dataset}.jsonl`.

    `data_dir=None` reads $DGE_LONGBENCH_DIR. Every row of the file is checked against
    `row_schema(dataset)` (types of the official keys, unique `_id`s, the file's task), so a bad
    row is a `rows.RowError` naming the file, line and field, not a silently wrong score.
    """
    path = resolve_data_dir(data_dir) / f"{dataset}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: put the official {dataset}.jsonl in the folder named by "
            f"{DATA_DIR_ENV} (or the runner's data-dir flag)"
        )
    checked = rows.read_jsonl(path, row_schema(dataset), OFFICIAL_FIX)
    return checked if num_samples is None else checked[:num_samples]


def stop_rule(dataset: str) -> StopRule:
    """pred.py's: newline for samsum (at least one token first), nothing extra otherwise."""
    if dataset == "samsum":
        return StopRule(stop_strings=("\n",), min_new_tokens=1)
    return no_stop_rule(dataset)


def score_row(dataset: str, prediction: str, answers: Sequence[str],
              all_classes: Sequence[str] | None) -> float:
    """eval.py's: the first line for four tasks, then the max of the metric over the answers
    (a blank answer raises: `rows.references`)."""
    if dataset not in config.DATASET2METRIC:
        raise ValueError(f"no metric for dataset {dataset!r}")
    answers = rows.references(answers, dataset)
    metric = metrics.METRICS[config.DATASET2METRIC[dataset]]
    if dataset in config.FIRST_LINE_TASKS:
        prediction = metrics.first_line(prediction)
    return max([0.0, *(metric(prediction, gt, all_classes) for gt in answers)])


def average_scores(scores: Mapping[str, float]) -> dict:
    """The two LongBench English averages over the English tasks present in `scores` (others
    are ignored): {"mean_en16", "category_mean", "categories", "missing_en16"}; averages are
    NaN when no English task is present."""
    present = [t for t in config.ENGLISH_TASKS if t in scores]
    categories = {
        name: sum(scores[t] for t in tasks if t in scores) / n
        for name, tasks in config.CATEGORIES_EN.items()
        if (n := sum(t in scores for t in tasks))
    }
    return {
        "mean_en16": sum(scores[t] for t in present) / len(present) if present else math.nan,
        "category_mean": (
            sum(categories.values()) / len(categories) if categories else math.nan
        ),
        "categories": categories,
        "missing_en16": [t for t in config.ENGLISH_TASKS if t not in scores],
    }


def summary(scores: Mapping[str, float]) -> dict:
    """The official averages, only when all 16 English tasks ran (their definition)."""
    if not set(config.ENGLISH_TASKS) <= set(scores):
        return {}
    official = average_scores({d: scores[d] for d in config.ENGLISH_TASKS})
    return {"mean_en16": official["mean_en16"], "category_mean": official["category_mean"]}


def default_datasets(settings: RowSettings) -> list[str]:
    """Every dataset whose official file is in the data folder."""
    folder = resolve_data_dir(settings.data_dir)
    present = [d for d in config.ALL_TASKS if (folder / f"{d}.jsonl").is_file()]
    if not present:
        raise FileNotFoundError(f"{folder} holds no LongBench {{dataset}}.jsonl file")
    return present


def _checksums(settings: RowSettings, datasets: Sequence[str]) -> dict[str, str]:
    from experiments.run_folder import sha256_file

    folder = resolve_data_dir(settings.data_dir)
    return {d: sha256_file(folder / f"{d}.jsonl") for d in datasets}


SUITE = Suite(
    name="longbench", title="LongBench", tasks=config.ALL_TASKS,
    load=lambda settings, tok, chat, datasets, num_samples: {
        d: load_rows(settings.data_dir, d, num_samples) for d in datasets},
    row_schema=row_schema,
    prompt=lambda row, dataset: config.DATASET2PROMPT[dataset].format(**row),
    uses_chat_template=lambda dataset: dataset not in config.NO_CHAT_TEMPLATE,
    answer_prefix=lambda dataset, row=None: "",
    max_new_tokens=lambda dataset: config.DATASET2MAXLEN[dataset],
    score_row=score_row, checksums=_checksums, default_datasets=default_datasets,
    identity=lambda settings: {"synthetic_length": None, "seed": None},
    stop_rule=stop_rule, has_answer_prefix=False, summary=summary,
)
