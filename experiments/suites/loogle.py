"""LooGLE's question answering (bigai-nlco/LooGLE, MIT) read natively: `--suite loogle
--data_dir DIR` reads LooGLE's own `{task}.jsonl` files (`LooGLE-testdata/`), one row per
question.

Why a suite of its own, not a task of `experiments.suites.kvpress`: LooGLE's files hold one
document per line with all of its questions (`qa_pairs`), so a row here is (document,
question) and keeps its document's id (`doc_id`; a later protocol can compress one
document's cache once for all its questions), and the prompt is LooGLE's own template,
filled here from the two fields; kvpress's schema has neither (its LooGLE export has
already split context and question apart and dropped the document).

Source: LooGLE at commit `LOOGLE_COMMIT`: the prompts of `config/task2prompt.json` and the
generation lengths of `config/task2maxlen.json` (verbatim, `TASK2PROMPT`, `TASK2MAXLEN`),
the row loop of `Prediction/pred_opensource_models.py` (`eval(qa_pairs)`, one prompt per pair,
`prompt_format.format(Q=..., input=...)`, LongBench's middle truncation), and the metrics of
`Evaluation/automatic_metrics.py`.

Tasks: shortdep_qa and longdep_qa (datasets `loogle_shortdep_qa`, `loogle_longdep_qa`; both
share the QA prompt and row schema). Not read: longdep_summarization and shortdep_cloze
(other prompts, and cloze answers are scored by parsing predictions with eval), and the
Hugging Face dataset `bigainlco/LooGLE` (another schema).

Rows: a line's fields are `input` (the document), `title`, `qa_pairs` and `output` (LooGLE's
schema, nothing else). `qa_pairs` is a Python literal string (single quotes; parsed with
`ast.literal_eval`, never eval) or already a list: each pair a dict with a non-empty string
`Q` and `A` (other keys, e.g. the evidence `S`, are kept as `evidence`). A document whose
`qa_pairs` is "none" has no question and is refused in a QA file. Row ids are
`<line>.<pair>` (1-based), `doc_id` the line number.

Protocol deviations: the chat template wraps the prompt as one user turn (LooGLE sends GPT
models the prompt as one system message and feeds open-source models the raw text); decoding
is greedy without LooGLE's `repetition_penalty=2.0` (the runner has no penalty); no answer
prefix (the prompt ends in "Answer: ").

Metric: LooGLE reports BLEU-1, BLEU-4, ROUGE-1/2/L, METEOR and BERTScore
(`automatic_metrics.py`), plus a GPT-4 judge in its paper. Reported here: ROUGE-L recall,
exactly as its `get_rouge_score(..., metric="r")` computes it with pltrdy/rouge (LooGLE's
ROUGE is recall, not F; `metrics.rouge_l_recall`). Not reported: BLEU, ROUGE-1/2, METEOR
(nltk, wordnet download), BERTScore (a model download) and the GPT-4 judge.
"""

from __future__ import annotations

import ast
import os
import pathlib
from collections.abc import Sequence
from types import MappingProxyType

from experiments import metrics, rows
from experiments.suites.base import RowSettings, Suite

LOOGLE_COMMIT = "6734382215bea3a63f055ffd7873b2967b6a2477"
DATA_DIR_ENV = "DGE_LOOGLE_DIR"
DATASET_PREFIX = "loogle_"
FIX = "fix the line or re-download LooGLE's file (LooGLE-testdata/{task}.jsonl)"

# config/task2prompt.json at LOOGLE_COMMIT (the two QA tasks), verbatim.
TASK2PROMPT = MappingProxyType(
    {
        "shortdep_qa": "Please answer the question based on the long texts below. \n{input}\n"
        "Question: {Q}\nAnswer: ",
        "longdep_qa": "Please answer the question based on the long texts below. \n{input}\n"
        "Question: {Q}\nAnswer: ",
    }
)
# config/task2maxlen.json at LOOGLE_COMMIT.
TASK2MAXLEN = MappingProxyType({"shortdep_qa": 300, "longdep_qa": 500})
TASKS = tuple(DATASET_PREFIX + t for t in TASK2PROMPT)

SCHEMA = rows.Schema(
    name="LooGLE",
    required=MappingProxyType(
        {
            "input": rows.NON_EMPTY_STR,
            "title": rows.STR,
            "qa_pairs": rows.Kind(
                "a Python-literal list of QA pairs or a list", lambda v: isinstance(v, str | list)
            ),
            "output": rows.STR,
        }
    ),
    id_field=None,  # a document has no id in LooGLE's files: its line is its id
)


def task_of(dataset: str) -> str:
    return dataset.removeprefix(DATASET_PREFIX)


def dataset_name(name: str) -> str:
    """`shortdep_qa` or `loogle_shortdep_qa` -> `loogle_shortdep_qa`."""
    dataset = DATASET_PREFIX + task_of(name)
    if dataset not in TASKS:
        raise ValueError(
            f"unknown LooGLE task {name!r} in --datasets; known: {', '.join(TASK2PROMPT)}"
        )
    return dataset


def _pairs(value: object) -> list | str:
    """The QA pairs of a line, or what is wrong with them."""
    if isinstance(value, str):
        if value.strip().lower() == "none":
            return "field 'qa_pairs' is \"none\": the document has no question"
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
            return f"field 'qa_pairs' is not a Python literal ({type(e).__name__})"
    if not isinstance(value, list) or not value:
        return f"field 'qa_pairs' must hold a non-empty list, got {rows.preview(value)}"
    for k, pair in enumerate(value, 1):
        bad = not isinstance(pair, dict) or any(
            not isinstance(pair.get(f), str) or not pair[f].strip() for f in ("Q", "A")
        )
        if bad:
            return (
                f"field 'qa_pairs' pair {k} must be a dict with non-empty strings 'Q' and "
                f"'A', got {rows.preview(pair)}"
            )
    return value


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Runner rows of one LooGLE QA file: one per QA pair, in file order."""
    source = os.fspath(path)
    with open(path, "rb") as f:
        lines = [(n, raw) for n, raw in enumerate(f, 1) if raw.strip()]
    if not lines:
        raise rows.RowError(f"{source} holds no rows (it is empty or blank); {FIX}")
    out = []
    for n, raw in lines:
        label = f"line {n}"
        doc = rows.parse_line(raw, source, label, FIX)
        problem = rows.field_problem(doc, SCHEMA)
        pairs = _pairs(doc["qa_pairs"]) if problem is None else problem
        if isinstance(pairs, str):
            raise rows.RowError(f"{source} {label}: {pairs}; {FIX}")
        for k, pair in enumerate(pairs, 1):
            out.append(
                {
                    "_id": f"{n}.{k}",
                    "doc_id": str(n),
                    "title": doc["title"],
                    "input": doc["input"],
                    "Q": pair["Q"],
                    "answers": [pair["A"]],
                    "all_classes": None,
                    "evidence": {f: v for f, v in pair.items() if f not in ("Q", "A")},
                }
            )
    return out


def data_dir(settings: RowSettings) -> pathlib.Path:
    folder = settings.data_dir or os.environ.get(DATA_DIR_ENV)
    if not folder:
        raise FileNotFoundError(
            f"--suite loogle reads LooGLE's {{task}}.jsonl files from "
            f"--data_dir (or ${DATA_DIR_ENV})"
        )
    return pathlib.Path(folder)


def rows_file(settings: RowSettings, dataset: str) -> pathlib.Path:
    path = data_dir(settings) / f"{task_of(dataset)}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: LooGLE's QA rows are LooGLE-testdata/{{task}}.jsonl"
        )
    return path


def load(
    settings: RowSettings, tokenizer, chat, datasets: Sequence[str], num_samples: int | None
) -> dict[str, list[dict]]:
    """Each dataset's rows, the first `num_samples` QA pairs (all if None)."""
    return {d: read_rows(rows_file(settings, d))[:num_samples] for d in datasets}


def prompt(row: dict, dataset: str) -> str:
    """task2prompt's template filled as pred_opensource_models.py does."""
    return TASK2PROMPT[task_of(dataset)].format(Q=row["Q"], input=row["input"])


def loogle_score(prediction: str, answers: Sequence[str]) -> float:
    """ROUGE-L recall of the prediction against the answer (the best of several). A blank
    answer raises (`rows.references`): pltrdy/rouge would read a whitespace-only one as the
    word "", recalled by any prediction with a whitespace-only sentence."""
    return max(metrics.rouge_l_recall(prediction, a)
               for a in rows.references(answers, "LooGLE's rouge_l_recall"))


def default_datasets(settings: RowSettings) -> list[str]:
    folder = data_dir(settings)
    present = [d for d in TASKS if (folder / f"{task_of(d)}.jsonl").is_file()]
    if not present:
        raise FileNotFoundError(
            f"{folder} holds no LooGLE QA file ({', '.join(t + '.jsonl' for t in TASK2PROMPT)})"
        )
    return present


def checksums(settings: RowSettings, datasets: Sequence[str]) -> dict[str, str]:
    from experiments.run_folder import sha256_file

    return {d: sha256_file(rows_file(settings, d)) for d in datasets}


SUITE = Suite(
    name="loogle",
    title="LooGLE",
    tasks=TASKS,
    load=load,
    row_schema=lambda dataset: SCHEMA,
    prompt=prompt,
    uses_chat_template=lambda dataset: True,
    answer_prefix=lambda dataset, row=None: "",
    max_new_tokens=lambda dataset: TASK2MAXLEN[task_of(dataset)],
    score_row=lambda dataset, pred, answers, classes: loogle_score(pred, answers),
    checksums=checksums,
    default_datasets=default_datasets,
    identity=lambda settings: {"synthetic_length": None, "seed": None},
    dataset_name=dataset_name,
    has_answer_prefix=False,
    # the template's tail after the document (a document's questions share its context)
    question=lambda row, dataset: TASK2PROMPT[task_of(dataset)].split("{input}", 1)[1].format(
        Q=row["Q"]),
)
