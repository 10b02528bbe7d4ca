"""kvpress's evaluation datasets as a suite: `--suite kvpress --data_dir DIR` reads every
`*.parquet` and `*.jsonl` file of DIR as rows in kvpress's common schema.

Source: NVIDIA/kvpress (Apache-2.0) at commit `KVPRESS_COMMIT`. The schema is the one
`evaluation/README.md` gives every dataset ("a set of parquet files with the following
structure: context, question, answer_prefix, answer, max_new_tokens"), as its
`evaluation/benchmarks/*/create_huggingface_dataset.py` scripts write it, plus a `task` column
(else a row's task is its file's stem). kvpress's own LongBench files name the answers
`answers` and keep LongBench's `all_classes`, `length`, `_id`, `dataset` and `language`: those
columns are read too; any other column is refused, as the other suites refuse unknown fields.

Protocol (kvpress `evaluation/evaluate.py` with `query_aware: true`, its pipeline's
`preprocess`): the prompt is `context + question`, the chat template wraps it, the row's
`answer_prefix` follows the template, and each row generates up to its own
`max_new_tokens` (the runner batches rows of one length together). LongBench's middle
truncation to --max_length applies as in every suite (kvpress does not truncate).

Datasets: a task of this suite is whatever DIR holds, so its names cannot be in the
registry's static table of datasets, and a kvpress task is often named as a LongBench or
RULER dataset (`hotpotqa`, `niah_single_1`) while its rows, prompt and metric are kvpress's.
Datasets are therefore named `kvpress/<task>` (`Suite.dataset_prefix`): the registry routes
any `kvpress/...` name here, no name of another suite can clash, and a run folder or report
tells at a glance whose rows were scored. Resolving by the selected suite instead would
need the suite in every scoring call (the report scores a folder from its predictions'
dataset names alone). `--datasets` takes `hotpotqa` or `kvpress/hotpotqa`.

Metrics, by task name, as kvpress's `evaluation/benchmarks/*/calculate_metrics.py` and the
original benchmarks score them (one row score in [0, 1]; the runner reports 100 x the mean):

- RULER (niah_*, vt, cwe, fwe: `string_match_all`; qa_1, qa_2: `string_match_part`): RULER's
  own metric (`experiments.suites.ruler`). kvpress deletes control characters where RULER's
  evaluate.py turns them into newlines; RULER's is kept.
- LongBench v1 task names (and their LongBench-E `<task>-e`): the official metrics and
  first-line rule (`experiments.suites.longbench.score_row`, max over the row's answers).
  kvpress's copy strips leading spaces where LongBench's eval.py strips leading newlines;
  the official rule is kept.
- needle_in_haystack: ROUGE-L F of pltrdy/rouge between the needle and the prediction
  (kvpress reports rouge-1/2/l P/R/F of `get_scores(needle, prediction)`; the row score is
  its rouge-l F). The rows must hold the needle in their context already: kvpress inserts it
  at run time (`insert_needle_in_haystack`), which is not ported.
- aime25 / math500: exact match of the answer extracted from the prediction: the last
  (aime25) or first (math500) `\\boxed{...}`, as kvpress picks, read with balanced braces
  (kvpress cuts at the first "}", so `\\boxed{\\frac{1}{2}}` could never match), else the
  final number in the prediction.
- InfiniteBench (OpenBMB's compute_scores.py via kvpress): passkey and number_string (the
  first integer equals the label), kv_retrieval / kv_retrieval_prefix / kv_retrieval_both
  (the label is a word of the prediction), longbook_qa_eng (token F1), longbook_qa_chn
  (character F1), longdialogue_qa_eng (a label, upper-cased, in the prediction). Not
  ported: longbook_choice_eng, code_run, code_debug, math_find, math_calc (label types or
  extraction rules kvpress's parquet does not carry as the scorer expects) and
  longbook_sum_eng (kvpress refuses it too).
- LooGLE (shortdep_qa, longdep_qa, longdep_summarization): ROUGE-L recall, the one of
  LooGLE's automatic metrics computed here (`experiments.suites.loogle`); BLEU, METEOR and
  BERTScore are not, nor shortdep_cloze (its exact/partial match parses predictions with
  eval).

Rows are checked when the folder is read: every answer non-blank (a blank one is found in
any prediction), and, for the tasks a run scores, what the task's metric reads from a row
(`metric_problem`: LongBench's class list, retrieval's "Paragraph N", a count or pass key in
digits), so a row the metric cannot score stops the run before its folder is written.

Any other task (zero_scrolls, whose public rows have no answers; LongBench v2) is refused
with one line naming it, the known tasks and `--metric NAME`, which scores every task of a
run with one metric of `METRICS`. The metric then travels in the dataset's name,
`kvpress/<task>@<metric>`, so the report scores the folder without the command line (and
predictions under another --metric are another dataset's).
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Callable, Sequence
from types import MappingProxyType

from experiments import metrics, rows
from experiments.suites import longbench_config
from experiments.suites.base import RowSettings, Suite
from experiments.suites.longbench import ANSWER_FORMS
from experiments.suites.longbench import score_row as longbench_score_row
from experiments.suites.loogle import loogle_score
from experiments.suites.ruler import string_match_all, string_match_part

KVPRESS_COMMIT = "8bb29b9c3078452a86d692f29123fa6c793e2b05"
PREFIX = "kvpress"
FIX = (
    "fix the row, or write it in kvpress's schema (context, question, answer_prefix, "
    "answer, max_new_tokens, optional task)"
)
_TASK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _answer_ok(value: object) -> bool:
    if rows.COUNT.accepts(value):  # AIME's answers may be stored as integers (kvpress: str())
        return True
    return rows.is_answer_text(value) or rows.ANSWERS.accepts(value)


ANSWER = rows.Kind(
    "a non-blank string, a non-negative integer or a non-empty list of non-blank strings",
    _answer_ok,
)
POSITIVE = rows.Kind("a positive integer", lambda v: rows.COUNT.accepts(v) and v > 0)
TASK = rows.Kind(
    "a task name (letters, digits, '_', '.', '-')",
    lambda v: isinstance(v, str) and _TASK.fullmatch(v) is not None,
)
SCHEMA = rows.Schema(
    name="kvpress",
    required=MappingProxyType(
        {
            "context": rows.NON_EMPTY_STR,
            "question": rows.STR,
            "answer_prefix": rows.STR,
            "max_new_tokens": POSITIVE,
        }
    ),
    id_field=None,  # kvpress rows have no id: a row is named by its file and place
    optional=MappingProxyType(
        {
            "answer": ANSWER,
            "answers": ANSWER,
            "task": TASK,
            # kvpress's LongBench files keep these LongBench columns
            "all_classes": rows.OPTIONAL_STR_LIST,
            "length": rows.COUNT,
            "_id": rows.STR,
            "dataset": rows.STR,
            "language": rows.STR,
        }
    ),
)

# ---------------------------------------------------------------------------------------------
# Metrics: (prediction, answers, all_classes) -> [0, 1]

RowScorer = Callable[[str, Sequence[str], Sequence[str] | None], float]


def answer_of(prediction: str, last: bool) -> str | None:
    """The answer in a prediction: the last (or first) `\\boxed{...}`'s content, braces
    balanced; else the final number; None when there is neither."""
    found = []
    for m in re.finditer(r"boxed\{", prediction):
        depth, i = 1, m.end()
        while i < len(prediction) and depth:
            depth += {"{": 1, "}": -1}.get(prediction[i], 0)
            i += 1
        if depth == 0:
            found.append(prediction[m.end() : i - 1])
    if found:
        return (found[-1] if last else found[0]).strip()
    numbers = re.findall(r"-?\d+(?:\.\d+)?", prediction)
    return numbers[-1] if numbers else None


def _boxed(last: bool) -> RowScorer:
    def score(prediction: str, answers: Sequence[str], classes=None) -> float:
        got = answer_of(prediction, last)
        return float(got is not None and any(got == a.strip() for a in answers))

    return score


def _first_int(prediction: str) -> str:
    """InfiniteBench's first_int_match: the first run of digits ("" if none)."""
    m = re.search(r"[0-9]+", prediction)
    return m.group(0) if m else ""


def _words(prediction: str) -> list[str]:
    """InfiniteBench's split_retrieval_answer: these characters become spaces, then split."""
    for c in "\n:\"'.,?!{}":
        prediction = prediction.replace(c, " ")
    return prediction.split()


def _char_f1(prediction: str, answers: Sequence[str], classes=None) -> float:
    """InfiniteBench's qa_f1_score_zh: F1 over the characters of the normalized texts."""
    return max(
        metrics.token_f1(
            list(metrics.normalize_zh_answer(prediction)), list(metrics.normalize_zh_answer(a))
        )
        for a in answers
    )


def _longbench_metric(name: str) -> RowScorer:
    metric = metrics.METRICS[name]
    return lambda pred, answers, classes=None: max(
        [0.0, *(metric(pred, a, classes) for a in answers)]
    )


METRICS: MappingProxyType[str, RowScorer] = MappingProxyType(
    {
        "string_match_all": lambda pred, answers, classes=None: string_match_all(pred, answers),
        "string_match_part": lambda pred, answers, classes=None: string_match_part(pred, answers),
        **{f"longbench_{name}": _longbench_metric(name) for name in metrics.METRICS},
        "needle_rouge_l": lambda pred, answers, classes=None: max(
            metrics.rouge_l(a.strip(), pred.strip()) for a in answers
        ),
        "boxed_last": _boxed(last=True),
        "boxed_first": _boxed(last=False),
        "first_int": lambda pred, answers, classes=None: float(_first_int(pred) == answers[0]),
        "retrieval_word": lambda pred, answers, classes=None: float(answers[0] in _words(pred)),
        "token_f1": lambda pred, answers, classes=None: max(
            metrics.qa_f1_score(pred, a) for a in answers
        ),
        "char_f1": _char_f1,
        "contains_upper": lambda pred, answers, classes=None: float(
            any(a.upper() in pred.strip().upper() for a in answers)
        ),
        "rouge_l_recall": lambda pred, answers, classes=None: loogle_score(pred, answers),
    }
)

_RULER = {
    **{
        f"niah_{kind}": "string_match_all"
        for kind in (
            "single_1",
            "single_2",
            "single_3",
            "multikey_1",
            "multikey_2",
            "multikey_3",
            "multivalue",
            "multiquery",
        )
    },
    "vt": "string_match_all",
    "cwe": "string_match_all",
    "fwe": "string_match_all",
    "qa_1": "string_match_part",
    "qa_2": "string_match_part",
}
_INFINITEBENCH = {
    "passkey": "first_int",
    "number_string": "first_int",
    "kv_retrieval": "retrieval_word",
    "kv_retrieval_prefix": "retrieval_word",
    "kv_retrieval_both": "retrieval_word",
    "longbook_qa_eng": "token_f1",
    "longbook_qa_chn": "char_f1",
    "longdialogue_qa_eng": "contains_upper",
}
_LOOGLE = {t: "rouge_l_recall" for t in ("shortdep_qa", "longdep_qa", "longdep_summarization")}
_LONGBENCH = "longbench"  # LongBench tasks: the official row rule, not one metric
TASK_METRICS = MappingProxyType(
    {
        **_RULER,
        **{t: _LONGBENCH for t in longbench_config.DATASET2METRIC},
        **{f"{t}-e": _LONGBENCH for t in longbench_config.DATASET2METRIC},
        "needle_in_haystack": "needle_rouge_l",
        "aime25": "boxed_last",
        "math500": "boxed_first",
        **_INFINITEBENCH,
        **_LOOGLE,
    }
)


FIRST_INT = rows.Kind(
    "a run of digits (first_int matches the prediction's first one with it)",
    lambda a: re.fullmatch(r"[0-9]+", a) is not None,
)


def _answers(value: object) -> list[str]:
    """A row's `answer` / `answers` value as the runner's list of strings."""
    return list(value) if isinstance(value, list) else [str(value)]


def metric_problem(row: dict, task: str, metric: str) -> str | None:
    """What `metric` (a `METRICS` name, or the LongBench rule) reads from a row of `task` and
    the row lacks, as a phrase naming the field; None when the metric can score the row.

    LongBench's classification scores against `all_classes` (a ValueError at scoring without
    it), retrieval reads "Paragraph N" out of each answer (the same), count and first_int
    compare digits with it (any other answer can never match)."""
    lb = (
        longbench_config.DATASET2METRIC.get(task.removesuffix("-e"))
        if metric == _LONGBENCH
        else metric.removeprefix("longbench_") if metric.startswith("longbench_") else None
    )
    if lb == "classification" and not rows.STR_LIST.accepts(row.get("all_classes")):
        return (
            f"field 'all_classes' must be {rows.STR_LIST.expected} (the classification "
            f"metric scores task {task!r} against it), got {rows.preview(row.get('all_classes'))}"
        )
    form = FIRST_INT if metric == "first_int" else ANSWER_FORMS.get(lb or "")
    field = "answer" if "answer" in row else "answers"
    if form is not None and not all(form.accepts(a) for a in _answers(row[field])):
        return (
            f"field {field!r} of a {task!r} row must be answers each {form.expected}, got "
            f"{rows.preview(row[field])}"
        )
    return None


def split_name(dataset: str) -> tuple[str, str | None]:
    """(task, --metric or None) of a dataset name `kvpress/<task>[@<metric>]`."""
    name = dataset.removeprefix(f"{PREFIX}/")
    task, _, metric = name.partition("@")
    return task, metric or None


def check_task(task: str, metric: str | None) -> None:
    """Refuses a task no metric is known for (unless --metric names one): one line."""
    if metric is None and task not in TASK_METRICS:
        raise ValueError(
            f"kvpress task {task!r} has no known metric; known tasks: "
            f"{', '.join(sorted(TASK_METRICS))}; or score every task with --metric NAME "
            f"({', '.join(METRICS)})"
        )


def score_row(
    dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None
) -> float:
    """The row's score by its task's metric, or by the metric its name carries (blank answers
    raise: `rows.references`)."""
    task, metric = split_name(dataset)
    check_task(task, metric)
    answers = rows.references(answers, dataset)
    name = metric or TASK_METRICS[task]
    if name == _LONGBENCH:
        return longbench_score_row(task.removesuffix("-e"), prediction, answers, all_classes)
    return METRICS[name](prediction, answers, all_classes)


# ---------------------------------------------------------------------------------------------
# Rows


def data_files(data_dir: str | os.PathLike | None) -> list[pathlib.Path]:
    """The *.parquet and *.jsonl files of --data_dir, by name."""
    if data_dir is None:
        raise FileNotFoundError(
            "--suite kvpress reads its rows from --data_dir: give a folder "
            "of *.parquet / *.jsonl files in kvpress's schema"
        )
    folder = pathlib.Path(data_dir)
    files = (
        sorted(p for p in folder.iterdir() if p.suffix in (".parquet", ".jsonl"))
        if folder.is_dir()
        else []
    )
    if not files:
        raise FileNotFoundError(
            f"{folder} holds no *.parquet or *.jsonl file (--suite "
            "kvpress reads kvpress's datasets from --data_dir)"
        )
    return files


def _parquet_rows(path: pathlib.Path) -> list[tuple[str, object]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's errors for a damaged or non-parquet file
        raise rows.RowError(
            f"{path}: not a readable parquet file ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); {FIX}"
        ) from e
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist())]


def _jsonl_rows(path: pathlib.Path) -> list[tuple[str, object]]:
    with open(path, "rb") as f:
        lines = [(f"line {n}", raw) for n, raw in enumerate(f, 1) if raw.strip()]
    return [(label, rows.parse_line(raw, os.fspath(path), label, FIX)) for label, raw in lines]


RowCheck = Callable[[str, dict], str | None]


def read_file(path: str | os.PathLike, check: RowCheck | None = None) -> dict[str, list[dict]]:
    """Every row of one file, checked, as runner rows grouped by task: `_id` (file name and
    place: `name.parquet:row 3`, `name.jsonl:line 7`), `context`, `question`,
    `answer_prefix`, `answers` (a list), `all_classes`, `max_new_tokens`. `check(task, row)`
    is what the run's metrics need of a schema-checked row (`metric_problem`): a phrase or
    None."""
    path = pathlib.Path(path)
    source = os.fspath(path)
    labelled = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
    if not labelled:
        raise rows.RowError(f"{source} holds no rows; {FIX}")
    out: dict[str, list[dict]] = {}
    for label, row in labelled:
        problem = rows.field_problem(row, SCHEMA)
        if problem is None:
            given = [f for f in ("answer", "answers") if f in row]
            if len(given) != 1:
                problem = (
                    "fields 'answer' and 'answers' both given (give one)"
                    if given
                    else f"field 'answer' is missing (it must be {ANSWER.expected})"
                )
        task = row.get("task", path.stem) if isinstance(row, dict) else None
        if problem is None and not TASK.accepts(task):
            problem = (
                f"the file name's stem {path.stem!r} is not a task name; add a 'task' "
                "field or rename the file"
            )
        if problem is None and check is not None:
            problem = check(task, row)
        if problem is not None:
            raise rows.RowError(f"{source} {label}: {problem}; {FIX}")
        answer = row.get("answer", row.get("answers"))
        out.setdefault(task, []).append(
            {
                "_id": f"{path.name}:{label}",
                "context": row["context"],
                "question": row["question"],
                "answer_prefix": row["answer_prefix"],
                "answers": _answers(answer),
                "all_classes": row.get("all_classes"),
                "max_new_tokens": row["max_new_tokens"],
            }
        )
    return out


def read_dir(
    data_dir: str | os.PathLike | None, check: RowCheck | None = None
) -> dict[str, tuple[list[dict], list[str]]]:
    """task -> (its rows over every file of the folder, the files they come from); `check`
    as `read_file`'s."""
    tasks: dict[str, tuple[list[dict], list[str]]] = {}
    for path in data_files(data_dir):
        for task, task_rows in read_file(path, check).items():
            found, files = tasks.setdefault(task, ([], []))
            found.extend(task_rows)
            files.append(os.fspath(path))
    return tasks


def dataset_name(name: str) -> str:
    """A --datasets name (`hotpotqa` or `kvpress/hotpotqa`) as this suite names it."""
    task = name.removeprefix(f"{PREFIX}/")
    if not _TASK.fullmatch(task):
        raise ValueError(
            f"--datasets {name!r} is not a kvpress task name (letters, digits, "
            "'_', '.', '-'; to choose the metric, use --metric)"
        )
    return f"{PREFIX}/{task}"


def load(
    settings: RowSettings, tokenizer, chat, datasets: Sequence[str], num_samples: int | None
) -> dict[str, list[dict]]:
    """Runner rows of each dataset (`kvpress/<task>[@metric]`), the first `num_samples`;
    every row of a task the run scores is checked for what its metric reads
    (`metric_problem`), so a row it cannot score stops here, not once predicted."""
    scored: dict[str, set[str]] = {}
    for task, metric in map(split_name, datasets):
        if metric is not None or task in TASK_METRICS:  # else check_task refuses it below
            scored.setdefault(task, set()).add(metric or TASK_METRICS[task])

    def check(task: str, row: dict) -> str | None:
        problems = (metric_problem(row, task, m) for m in sorted(scored.get(task, ())))
        return next((p for p in problems if p is not None), None)

    found = read_dir(settings.data_dir, check)
    out = {}
    for dataset in datasets:
        task, metric = split_name(dataset)
        if task not in found:
            raise ValueError(
                f"{settings.data_dir} holds no row of kvpress task {task!r}; "
                f"tasks there: {', '.join(sorted(found))}"
            )
        check_task(task, metric)
        out[dataset] = found[task][0][:num_samples]
    return out


def default_datasets(settings: RowSettings) -> list[str]:
    """Every task the folder holds, by name."""
    return [f"{PREFIX}/{t}" for t in sorted(read_dir(settings.data_dir))]


def checksums(settings: RowSettings, datasets: Sequence[str]) -> dict[str, str]:
    """sha256 of the one file a task's rows come from; with several, the hash of their
    {file name: sha256}."""
    from experiments.predictions import config_hash
    from experiments.run_folder import sha256_file

    found = read_dir(settings.data_dir)
    out = {}
    for dataset in datasets:
        files = found[split_name(dataset)[0]][1]
        shas = {pathlib.Path(f).name: sha256_file(f) for f in files}
        out[dataset] = next(iter(shas.values())) if len(shas) == 1 else config_hash(shas)
    return out


def _answer_prefix(dataset: str, row: dict | None = None) -> str:
    if row is None:
        raise ValueError(f"{dataset}: a kvpress answer prefix belongs to a row; pass it")
    return row["answer_prefix"]


def _max_new_tokens(dataset: str) -> int:
    raise ValueError(f"{dataset}: kvpress rows carry their own max_new_tokens; ask per row")


SUITE = Suite(
    name=PREFIX,
    title="kvpress",
    tasks=(),
    load=load,
    row_schema=lambda dataset: SCHEMA,
    prompt=lambda row, dataset: row["context"] + row["question"],
    uses_chat_template=lambda dataset: True,
    answer_prefix=_answer_prefix,
    max_new_tokens=_max_new_tokens,
    score_row=score_row,
    checksums=checksums,
    default_datasets=default_datasets,
    identity=lambda settings: {"synthetic_length": None, "seed": None},
    dataset_name=dataset_name,
    dataset_prefix=PREFIX,
    metrics=tuple(METRICS),
    with_metric=lambda dataset, metric: f"{dataset}@{metric}",
    row_max_new_tokens=lambda row: row["max_new_tokens"],
)
