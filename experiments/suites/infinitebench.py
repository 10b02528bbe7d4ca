"""InfiniteBench (OpenBMB/InfiniteBench at `INFINITEBENCH_COMMIT`) read natively: `--suite
infinitebench --data_dir DIR` reads DIR/{task}.jsonl, the task files of the Hugging Face
dataset `xinrongzhang2022/InfiniteBench` (names as `src/eval_utils.py`'s DATA_NAME_TO_PATH).

Rows: `id` (an integer), `context`, `input`, `answer` (a list of strings or numbers, or one
string; no blank string: it would be found in any prediction) and `options` (a list of
strings: the four choices of the choice tasks), nothing else; checked strictly (file, line,
field). Each task's schema also checks, when the file is read, what its prompt and score
assume of a row (`task_problem`): code_run's input holds a call `func_N(x)`, math_find's a
"The ... of" phrase, a choice answer is one of four options (or [option, its letter]),
passkey and number_string labels are digits, math_find and code_run labels numbers. A row
breaking one would otherwise fail, or score 0 whatever the model says, only once the run's
folder is written. Datasets are `infbench_<task>` (InfiniteBench's `passkey` would
otherwise collide with the synthetic suite's).

Protocol, the open-model path (`src/eval_yarn_mistral.py`, also Yi-200K's and ChatGLM3's):
`create_prompt` with `yarn_mistral_templates` (`src/prompt.py`, verbatim in `TEMPLATES`),
raw text without a chat template (the templates end in their own answer cue, "The pass key
is"), greedy decoding, DATA_NAME_TO_MAX_NEW_TOKENS, middle truncation (the runner's
--max_length; InfiniteBench: 128K tokens). Scores are `src/compute_scores.py`'s
get_score_one_* per task, ported in `score_row` (choice tasks' labels are `get_answer`'s
[option text, letter]).

Not ported: longbook_sum_eng (ROUGE-Lsum of Hugging Face `evaluate`'s rouge, a library the
project does not depend on) and math_calc (30,000 new tokens per row). Numeric answers are
kept as their JSON text on the prediction lines and parsed back to int or float for
math_find and code_run, whose scores compare numbers.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
from collections.abc import Sequence
from types import MappingProxyType

from experiments import metrics, rows
from experiments.suites.base import RowSettings, Suite

INFINITEBENCH_COMMIT = "88b3daa"  # OpenBMB/InfiniteBench main, "fix math.calc compute_score"
DATA_DIR_ENV = "DGE_INFINITEBENCH_DIR"
DATASET_PREFIX = "infbench_"
FIX = "fix the line or re-download the task's file from xinrongzhang2022/InfiniteBench"

# src/prompt.py's yarn_mistral_templates at INFINITEBENCH_COMMIT, verbatim (the ported tasks).
TEMPLATES = MappingProxyType({
    "passkey": "There is an important info hidden inside a lot of irrelevant text. Find it and "
               "memorize it. I will quiz you about the important information.\n\n{context}\n\n"
               "{input}\n\nThe pass key is",
    "number_string": "There is an important info hidden inside a lot of irrelevant text. Find "
                     "it. I will quiz you about the important information there.\n\n{context}"
                     "\n\n{input}\n\nThe sequence of digits is",
    "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object "
                    "below.\n\n{context}\n\n{input}",
    "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: "
                           "{question}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. "
                           "{OPTION_D}\n\nThe letter of the correct answer is",
    "longbook_qa_eng": "Read the book and answer the question. Be very concise in your answer."
                       "\n\n{context}\n\nQuestion: {question}\nAnswer:",
    "longbook_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案：",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "code_run": "There is a function called {func} in the following Python code.\n\n{context}\n\n"
                "Please compute the exact value of {func_call}. The value of {func_call} is",
    "code_debug": "Following is a Python code where exactly one of the functions/methods has a "
                  "deliberate error that makes it crash.\n\n{context}\n\nOptions:\nA. {OPTION_A}"
                  "\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe correct option is:",
    "longdialogue_qa_eng": "Below is a dialogue script where one random occurrence of a "
                           "character name is replaced with \"$$MASK$$\", and you should try to "
                           "guess who that character is.\n\n{context}\n\nThe name that has been "
                           "replaced with $$MASK$$ is likely",
})  # fmt: skip
# src/eval_utils.py's DATA_NAME_TO_MAX_NEW_TOKENS (the ported tasks).
MAX_NEW_TOKENS = MappingProxyType({
    "passkey": 6, "number_string": 12, "kv_retrieval": 50, "longbook_choice_eng": 40,
    "longbook_qa_eng": 40, "longbook_qa_chn": 40, "longdialogue_qa_eng": 40, "math_find": 3,
    "code_run": 5, "code_debug": 5,
})  # fmt: skip
TASKS = tuple(DATASET_PREFIX + t for t in TEMPLATES)
CHOICE_TASKS = ("longbook_choice_eng", "code_debug")


def _is_label(v: object) -> bool:
    """A non-blank string or a finite number (JSON true is not a label)."""
    if isinstance(v, int | float) and not isinstance(v, bool):
        return math.isfinite(v)
    return rows.is_answer_text(v)


def _is_answer(v: object) -> bool:
    return rows.is_answer_text(v) or (isinstance(v, list) and len(v) > 0 and all(
        map(_is_label, v)))  # fmt: skip


SCHEMA_FIELDS = MappingProxyType({
    "id": rows.COUNT, "context": rows.NON_EMPTY_STR, "input": rows.STR,
    "answer": rows.Kind("a non-blank string or a non-empty list of non-blank strings / "
                        "finite numbers", _is_answer),
    "options": rows.Kind("a list of strings", lambda v: isinstance(v, list) and all(
        isinstance(x, str) for x in v)),
})  # fmt: skip
SCHEMA = rows.Schema(name="InfiniteBench", required=SCHEMA_FIELDS, id_field="id")
LETTERS = ("A", "B", "C", "D")
FUNC_CALL = re.compile(r"func_[0-9]+\(\-?[0-9]+\)")  # create_prompt's, code_run
MATH_TARGET = re.compile(r"The .+ of")  # create_prompt's, math_find


def task_of(dataset: str) -> str:
    return dataset.removeprefix(DATASET_PREFIX)


def dataset_name(name: str) -> str:
    """`passkey` or `infbench_passkey` -> `infbench_passkey`."""
    dataset = DATASET_PREFIX + task_of(name)
    if dataset not in TASKS:
        raise ValueError(f"unknown InfiniteBench task {name!r} in --datasets; known: "
                         f"{', '.join(TEMPLATES)} (not ported: longbook_sum_eng, math_calc)")
    return dataset


def _texts(answer: str | list) -> list[str]:
    """The answer as text labels (numbers by their JSON form, parsed back by `_number`)."""
    return [answer] if isinstance(answer, str) else [str(a) for a in answer]


def _is_number(text: str) -> bool:
    try:
        _number(text)
    except ValueError:
        return False
    return True


def _choice_problem(row: dict) -> str | None:
    """`get_answer`'s assumptions: four options (the prompt's A-D) and an answer naming one,
    as its text (a string or a one-element list) or [its text, its letter]."""
    options, answer = row["options"], row["answer"]
    if len(options) != 4 or not all(map(rows.is_answer_text, options)):
        return (f"field 'options' must be the four non-blank choices the prompt shows as A-D, "
                f"got {rows.preview(options)}")
    if isinstance(answer, list) and len(answer) == 2:  # [option, its letter]
        text, letter = answer
        named = letter in LETTERS and text == options[LETTERS.index(letter)]
    else:
        text = answer[0] if isinstance(answer, list) and len(answer) == 1 else answer
        named = isinstance(text, str) and text in options
    if named:
        return None
    return (f"field 'answer' must be one of the four 'options' (a string or a one-element "
            f"list) or [that option, its letter A-D], got {rows.preview(answer)}")


def task_problem(row: dict, task: str) -> str | None:
    """What `task`'s prompt and score assume of a row (its fields' kinds checked) and the row
    lacks, as a phrase naming the field; None when the row fits."""
    if task in CHOICE_TASKS:
        return _choice_problem(row)
    texts, found = _texts(row["answer"]), rows.preview(row["answer"])
    if task == "code_run" and not FUNC_CALL.search(row["input"]):
        return (f"field 'input' must hold a call func_N(x) (the prompt asks for the value of "
                f"the first), got {rows.preview(row['input'])}")
    if task == "math_find" and not MATH_TARGET.search(row["input"]):
        return (f"field 'input' must hold \"The ... of\" (the prompt asks for the thing it "
                f"names), got {rows.preview(row['input'])}")
    if task in ("math_find", "code_run") and not all(map(_is_number, texts)):
        return (f"field 'answer' must be numbers ({task} compares the number in the "
                f"prediction with them), got {found}")
    if task in ("passkey", "number_string") and not all(
            re.fullmatch(r"[0-9]+", a) for a in texts):  # fmt: skip
        return (f"field 'answer' must be runs of digits ({task} compares the prediction's "
                f"first run of digits with them), got {found}")
    return None


def row_schema(dataset: str) -> rows.Schema:
    """The row schema of a task: the fields' kinds, then `task_problem`."""
    task = task_of(dataset)
    return rows.Schema(name="InfiniteBench", required=SCHEMA_FIELDS, id_field="id",
                       check=lambda row: task_problem(row, task))


def labels(row: dict, task: str) -> list[str]:
    """`get_answer`: [option text, its letter] for the choice tasks, else the answers, as
    text; `row` fits the task's schema (`row_schema`)."""
    answer = row["answer"]
    if task not in CHOICE_TASKS:
        return _texts(answer)
    if isinstance(answer, list) and len(answer) == 2:
        return [answer[0], answer[1]]
    text = answer if isinstance(answer, str) else answer[0]
    return [text, LETTERS[row["options"].index(text)]]


def read_rows(path: pathlib.Path, task: str) -> list[dict]:
    """Runner rows of one task file, every row checked by the task's schema: the row, `_id`
    (its id), `answers` (`labels`)."""
    checked = rows.read_jsonl(path, row_schema(task), FIX)
    return [{**r, "_id": str(r["id"]), "all_classes": None, "answers": labels(r, task)}
            for r in checked]  # fmt: skip


def data_dir(settings: RowSettings) -> pathlib.Path:
    folder = settings.data_dir or os.environ.get(DATA_DIR_ENV)
    if not folder:
        raise FileNotFoundError(f"--suite infinitebench reads {{task}}.jsonl files from "
                                f"--data_dir (or ${DATA_DIR_ENV})")  # fmt: skip
    return pathlib.Path(folder)


def rows_file(settings: RowSettings, dataset: str) -> pathlib.Path:
    path = data_dir(settings) / f"{task_of(dataset)}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (InfiniteBench's {task_of(dataset)}.jsonl)")
    return path


def prompt(row: dict, dataset: str) -> str:
    """`create_prompt` for the open-model templates."""
    task = task_of(dataset)
    template, context = TEMPLATES[task], row["context"]
    options = {f"OPTION_{c}": o for c, o in zip("ABCD", row["options"], strict=False)}
    if task == "code_run":
        func_call = FUNC_CALL.findall(row["input"])[0]
        return template.format(func=func_call.split("(")[0], func_call=func_call,
                               context=context)  # fmt: skip
    if task in CHOICE_TASKS:
        return template.format(context=context, question=row["input"], **options)
    if task in ("longbook_qa_eng", "longbook_qa_chn"):
        return template.format(context=context, question=row["input"])
    if task == "longdialogue_qa_eng":
        return template.format(context=context)
    if task == "math_find":
        target = MATH_TARGET.findall(row["input"])[0].lower()[:-3]
        return template.format(prefix=f"What is {target} in the following list?",
                               context=context, input=row["input"])  # fmt: skip
    return template.format(context=context, input=row["input"])


def question(row: dict, dataset: str) -> str:
    """What follows the context in the prompt (the context protocols' split)."""
    return prompt({**row, "context": "\x00"}, dataset).split("\x00", 1)[1]


def _words(pred: str, chars: str) -> list[str]:
    for c in chars:
        pred = pred.replace(c, " ")
    return pred.split()


def _first_int(pred: str) -> str:
    return next((p for p in re.split("[^0-9]", pred) if p), "")


def _number(text: str) -> int | float:
    return float(text) if any(c in text for c in ".eE") else int(text)


def _after_prefix(pred: str, prefixes: Sequence[str], targets: Sequence[str]) -> bool | None:
    """The official answer-prefix rule: at the first of `prefixes` found, whether what
    follows it (past one character) starts with a target; None when no prefix occurs."""
    for prefix in prefixes:
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:  # the prediction ends with the prefix
            return False
        return any(pred[idx + len(prefix) + 1:].startswith(s) for s in targets)
    return None


def _choice(pred: str, label: Sequence[str]) -> bool:
    """get_score_one_longbook_choice_eng."""
    pred = pred.strip()
    if pred == "":
        return False
    if pred[0] in "ABCD":
        return pred[0] in label
    if pred in label:
        return True
    pred = " ".join(_words(pred, "\n\"'.,?!{}"))
    found = _after_prefix(pred, ("answer is:", "answer:", "answer is", "option is"), label)
    if found is not None:
        return found
    return next((w in label for w in pred.split() if w in "ABCD"), False)


def _debug(pred: str, label: Sequence[str]) -> bool:
    """get_score_one_code_debug."""
    pred = pred.strip()
    fn_name, letter = label[0], label[1]
    if pred[:2] in (f"{letter}.", f"{letter}:"):
        return True
    for c in ["\n", "`", "'", '"', "-", "*", "Option", "option"]:
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    prefixes = ("answer is:", "is:", "answer:", "correct option is:")
    return bool(_after_prefix(pred, prefixes, (letter, fn_name)))


def _math_find(pred: str, label: str) -> bool:
    found = re.search(r"\d+\.\d+|\d+", pred)
    if found is None:
        return False
    value = _number(label)
    return (int if isinstance(value, int) else float)(found.group(0).strip()) == value


def _code_run(pred: str, label: str) -> bool:
    words = _words(pred.strip(), "\n.`'\":")
    try:
        return bool(words) and int(words[-1]) == _number(label)
    except ValueError:
        return False


def score_row(dataset: str, pred: str, answers: Sequence[str], classes=None) -> float:
    """`get_score_one` of the task, as a float in [0, 1]. A label the file gives as a
    one-element list is compared by its element (compute_scores.py's kv_retrieval would
    compare the list itself with the words, which never matches). A blank label raises
    (`rows.references`): it would be found in, or prefix, any prediction."""
    task = task_of(dataset)
    answers = rows.references(answers, dataset)
    if task == "kv_retrieval":
        return float(answers[0] in _words(pred, "\n:\"'.,?!{}"))
    if task in ("passkey", "number_string"):
        return float(answers[0] == _first_int(pred))
    if task == "longdialogue_qa_eng":
        return float(answers[0] in [w.upper() for w in _words(pred.strip(), "\n:\"'.,?!{}")])
    if task == "longbook_choice_eng":
        return float(_choice(pred, answers))
    if task == "code_debug":
        return float(_debug(pred, answers))
    if task == "math_find":
        return float(_math_find(pred, answers[0]))
    if task == "code_run":
        return float(_code_run(pred, answers[0]))
    if task == "longbook_qa_eng":
        return max(metrics.qa_f1_score(pred, a) for a in answers)
    if task == "longbook_qa_chn":  # one character one token
        return max(metrics.token_f1(list(metrics.normalize_zh_answer(pred)),
                                    list(metrics.normalize_zh_answer(a))) for a in answers)
    raise ValueError(f"no InfiniteBench score for {dataset!r}")


def default_datasets(settings: RowSettings) -> list[str]:
    folder = data_dir(settings)
    present = [d for d in TASKS if (folder / f"{task_of(d)}.jsonl").is_file()]
    if not present:
        raise FileNotFoundError(f"{folder} holds no InfiniteBench {{task}}.jsonl file")
    return present


def checksums(settings: RowSettings, datasets: Sequence[str]) -> dict[str, str]:
    from experiments.run_folder import sha256_file

    return {d: sha256_file(rows_file(settings, d)) for d in datasets}


SUITE = Suite(
    name="infinitebench", title="InfiniteBench", tasks=TASKS,
    load=lambda settings, tok, chat, datasets, n: {
        d: read_rows(rows_file(settings, d), task_of(d))[:n] for d in datasets},
    row_schema=row_schema, prompt=prompt,
    uses_chat_template=lambda dataset: False, answer_prefix=lambda dataset, row=None: "",
    max_new_tokens=lambda dataset: MAX_NEW_TOKENS[task_of(dataset)], score_row=score_row,
    checksums=checksums, default_datasets=default_datasets,
    identity=lambda settings: {"synthetic_length": None, "seed": None},
    dataset_name=dataset_name, has_answer_prefix=False, question=question,
)
