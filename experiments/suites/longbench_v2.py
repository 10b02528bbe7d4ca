"""LongBench v2 (THUDM/LongBench, the v2 branch at `LONGBENCH_V2_COMMIT`) read natively:
`--suite longbench_v2 --data_dir DIR` reads DIR/data.json (the Hugging Face dataset
`THUDM/LongBench-v2`'s file: a JSON array) or DIR/data.jsonl (one row per line).

Rows (the dataset's twelve fields, nothing else): `_id`, `domain`, `sub_domain`,
`difficulty` ("easy" / "hard"), `length` ("short" / "medium" / "long"), `question`,
`choice_A` .. `choice_D`, `answer` (one of A-D) and `context`; checked strictly, a bad row
named by its file and line (or array index) and field. The choice the answer names must be
non-blank (a question whose right answer is an empty option asks nothing).

Protocol (`pred.py` and `prompts/0shot.txt` at `LONGBENCH_V2_COMMIT`): the 0-shot
multiple-choice prompt, every field stripped and put in by plain replacement
(`$DOC$`, `$Q$`, `$C_A$` ..), sent as one user turn (the chat template), up to 128 new
tokens; the answer letter extracted as `extract_answer` does (asterisks dropped, then
"The correct answer is (X)", else "The correct answer is X"); a row scores 1 when the
letter is the answer, else 0 (no letter: 0, result.py's uncompensated score). The report
breaks the accuracy down by difficulty and length (result.py's Easy / Hard / Short / Medium
/ Long columns) through each line's `groups`.

Deviations: greedy decoding (pred.py samples at temperature 0.1 through an API server);
middle truncation at the runner's --max_length (pred.py: 120,000 tokens of the model's
tokenizer, `config/model2maxlen.json`); the CoT, RAG and no-context variants are not run.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Sequence
from types import MappingProxyType

from experiments import rows
from experiments.suites.base import RowSettings, Suite

LONGBENCH_V2_COMMIT = "2e00731f8d0bff23dc4325161044d0ed8af94c1e"
DATA_DIR_ENV = "DGE_LONGBENCH_V2_DIR"
DATASET = "longbench_v2"
FILES = ("data.json", "data.jsonl")
FIX = "fix the row or re-download THUDM/LongBench-v2's data.json"
MAX_NEW_TOKENS = 128  # pred.py, the 0-shot (non-CoT) call

# prompts/0shot.txt at LONGBENCH_V2_COMMIT, verbatim.
TEMPLATE = (
    "Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\n"
    "What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n"
    "(C) $C_C$\n(D) $C_D$\n\nFormat your response as follows: \"The correct answer is (insert "
    "answer here)\"."
)
CHOICES = ("A", "B", "C", "D")


def _one_of(values: Sequence[str]) -> rows.Kind:
    return rows.Kind(f"one of {list(values)}", lambda v: v in values)


def _answer_choice(row: dict) -> str | None:
    """The choice `answer` names is blank: no reference answer to find."""
    field = f"choice_{row['answer']}"
    if rows.is_answer_text(row[field]):
        return None
    return (f"field {field!r} (the choice field 'answer' names) must be "
            f"{rows.NON_BLANK_STR.expected}, got {rows.preview(row[field])}")


SCHEMA = rows.Schema(
    name="LongBench v2",
    required=MappingProxyType({
        "_id": rows.NON_EMPTY_STR, "domain": rows.STR, "sub_domain": rows.STR,
        "difficulty": _one_of(("easy", "hard")), "length": _one_of(("short", "medium", "long")),
        "question": rows.NON_EMPTY_STR, **{f"choice_{c}": rows.STR for c in CHOICES},
        "answer": _one_of(CHOICES), "context": rows.NON_EMPTY_STR,
    }),  # fmt: skip
    id_field="_id",
    check=_answer_choice,
)


def data_file(settings: RowSettings) -> pathlib.Path:
    """DIR/data.json or DIR/data.jsonl, DIR from --data_dir or $DGE_LONGBENCH_V2_DIR."""
    folder = settings.data_dir or os.environ.get(DATA_DIR_ENV)
    if not folder:
        raise FileNotFoundError(f"--suite longbench_v2 reads data.json from --data_dir (or "
                                f"${DATA_DIR_ENV}): THUDM/LongBench-v2's file")  # fmt: skip
    for name in FILES:
        if (pathlib.Path(folder) / name).is_file():
            return pathlib.Path(folder) / name
    raise FileNotFoundError(f"{folder} holds neither {FILES[0]} nor {FILES[1]}")


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Runner rows of a data.json / data.jsonl: the row's fields, `answers` [its letter]."""
    path = pathlib.Path(path)
    if path.suffix == ".jsonl":
        checked = rows.read_jsonl(path, SCHEMA, FIX)
    else:
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise rows.RowError(f"{path}: not a JSON array of rows ({e}); {FIX}") from e
        if not isinstance(data, list) or not data:
            raise rows.RowError(f"{path}: expected a non-empty JSON array of rows; {FIX}")
        checked = rows.check_rows(((f"row {i}", r) for i, r in enumerate(data)), SCHEMA,
                                  os.fspath(path), FIX)  # fmt: skip
    return [{**r, "answers": [r["answer"]], "all_classes": None} for r in checked]


def prompt(row: dict, dataset: str) -> str:
    """pred.py's 0-shot prompt: plain replacements of the stripped fields."""
    text = TEMPLATE.replace("$DOC$", row["context"].strip()).replace("$Q$", row["question"].strip())
    for c in CHOICES:
        text = text.replace(f"$C_{c}$", row[f"choice_{c}"].strip())
    return text


def question(row: dict, dataset: str) -> str:
    """What follows the document: the question, the choices and the format line."""
    return prompt({**row, "context": "\x00"}, dataset).split("\x00", 1)[1]


def extract_answer(response: str) -> str | None:
    """pred.py's `extract_answer`: the letter after "The correct answer is", or None."""
    response = response.replace("*", "")
    match = re.search(r"The correct answer is \(([A-D])\)", response)
    if match is None:
        match = re.search(r"The correct answer is ([A-D])", response)
    return None if match is None else match.group(1)


def score_row(dataset: str, prediction: str, answers: Sequence[str], classes) -> float:
    """1 when the extracted letter is the answer's (a blank answer raises: `rows.references`)."""
    return float(extract_answer(prediction) == rows.references(answers, dataset)[0])


def checksums(settings: RowSettings, datasets: Sequence[str]) -> dict[str, str]:
    from experiments.run_folder import sha256_file

    return {d: sha256_file(data_file(settings)) for d in datasets}


SUITE = Suite(
    name="longbench_v2", title="LongBench v2", tasks=(DATASET,),
    load=lambda settings, tok, chat, datasets, n: {
        d: read_rows(data_file(settings))[:n] for d in datasets},
    row_schema=lambda dataset: SCHEMA, prompt=prompt,
    uses_chat_template=lambda dataset: True, answer_prefix=lambda dataset, row=None: "",
    max_new_tokens=lambda dataset: MAX_NEW_TOKENS, score_row=score_row,
    checksums=checksums, default_datasets=lambda settings: [DATASET],
    identity=lambda settings: {"synthetic_length": None, "seed": None},
    has_answer_prefix=False, question=question,
    row_groups=lambda row: {"difficulty": row["difficulty"], "length": row["length"]},
)
