"""Strict row schemas for every suite, and the one checker that applies them.

A row that only has the right keys can still be scored wrong without any error: `answers` as a
string is scored character by character, `context: null` is prompted as the text "None", a
repeated `_id` is computed and then dropped by the resumable store. So rows are checked field by
field before anything uses them, by `check_rows` (generated rows) or `read_jsonl` (files), and
every problem is one `RowError`: a one-line message naming the source, the line or row, the
field, what was found and what to do.

Schemas: `longbench_schema(task, template)` for LongBench v1 rows and the synthetic suite (same
schema), `RULER_SCHEMA` for rows written by NVIDIA/RULER's data preparation scripts. A new suite
declares a `Schema` and reuses the checker. This module imports no other experiments module.

Reference answers are `ANSWERS` in every schema that holds them: an empty or whitespace-only
answer is found in any prediction by the substring and prefix metrics (`"" in pred`), so a row
holding one would score 100 % whatever the model says. Such a row is refused when it is read,
and a scorer handed one anyway (a prediction line written before this check) raises
(`references`) rather than score it: a number computed against a blank reference is not a
score of the model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from types import MappingProxyType

LONGBENCH_KEYS = ("input", "context", "answers", "length", "dataset", "language", "all_classes",
                  "_id")
PREVIEW_CHARS = 40


class RowError(ValueError):
    """A row that does not fit its schema; the message is one line naming where and what."""


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a field must hold: `accepts(value)`, and the phrase messages use ("must be ...")."""

    expected: str
    accepts: Callable[[object], bool]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a count


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def is_answer_text(value: object) -> bool:
    """Whether `value` can be a reference answer: a string with a non-whitespace character."""
    return isinstance(value, str) and value.strip() != ""


def _is_answer_list(value: object) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(map(is_answer_text, value))


STR = Kind("a string", lambda v: isinstance(v, str))
NON_EMPTY_STR = Kind("a non-empty string", lambda v: isinstance(v, str) and v != "")
NON_BLANK_STR = Kind("a non-blank string (not empty or whitespace only)", is_answer_text)
COUNT = Kind("a non-negative integer", lambda v: _is_int(v) and v >= 0)
OPTIONAL_COUNT = Kind("null or a non-negative integer", lambda v: v is None or COUNT.accepts(v))
STR_LIST = Kind("a non-empty list of strings", lambda v: _is_str_list(v) and len(v) > 0)
OPTIONAL_STR_LIST = Kind("null or a list of strings", lambda v: v is None or _is_str_list(v))
# Reference answers (module docstring: a blank one matches any prediction).
ANSWERS = Kind("a non-empty list of non-blank strings", _is_answer_list)


def answers_each(form: Kind) -> Kind:
    """`ANSWERS` whose every answer is also of `form` (what a metric reads out of each)."""
    return Kind(f"{ANSWERS.expected}, each {form.expected}",
                lambda v: _is_answer_list(v) and all(form.accepts(a) for a in v))


def references(answers: Sequence[str], where: str) -> Sequence[str]:
    """`answers` when they are a non-empty list of non-blank strings, else a ValueError naming
    `where` (the dataset): a scorer's guard, since a blank reference matches any prediction.

    It raises rather than skip the blank one: the loaders refuse such rows, so a scorer sees
    one only on predictions recorded from unchecked data, and no honest score exists for them.
    """
    if not isinstance(answers, list | tuple) or not _is_answer_list(list(answers)):
        raise ValueError(f"{where}: cannot score against the reference answers "
                         f"{preview(answers)}: they must be {ANSWERS.expected} (a blank one "
                         "matches any prediction); fix the row's data and predict it again")
    return answers


def equal_to(expected: str, why: str) -> Kind:
    """A string field with one allowed value, e.g. the task a file is named after."""
    return Kind(f"{json.dumps(expected)} ({why})", lambda v: v == expected)


@dataclasses.dataclass(frozen=True)
class Schema:
    """The fields of one suite's rows: all `required`, some `optional`, no others.

    `id_field` names the required field whose values must be unique within a file or suite (the
    store keys predictions by it, so a repeat would be computed and then silently dropped);
    None for rows without an id of their own (kvpress's: the suite numbers them by place).
    `check(row)`, run once every field has its kind, says what a task's prompt or score
    assumes of the row and the row lacks (a phrase naming the field, or None): a call the
    prompt asks about, an answer that must be a number, the option an answer names.
    """

    name: str
    required: Mapping[str, Kind]
    id_field: str | None
    optional: Mapping[str, Kind] = dataclasses.field(default_factory=dict)
    check: Callable[[dict], str | None] | None = None

    def __post_init__(self) -> None:
        if self.id_field is not None and self.id_field not in self.required:
            raise ValueError(f"{self.name}: id field {self.id_field!r} is not a required field")


def longbench_schema(task: str, template: str, needs_classes: bool = False,
                     answers: Kind = ANSWERS) -> Schema:
    """The official LongBench v1 row of `task`, whose prompt is `template`.

    Every task's prompt shows its context, so the context must be non-empty; `input` may be ""
    only where the template does not use it (gov_report, multi_news, vcsum, passage_count and
    lcc have input "" in the official data). Classification tasks (`needs_classes`: trec, lsht)
    are scored against `all_classes`, which must then be a non-empty list. `dataset` must be
    the task the file is named after: a row of another task would get this task's prompt.
    `answers` is what the task's metric needs of them (`ANSWERS`, or `answers_each` of a form
    such as retrieval's "Paragraph N").
    """
    return Schema(
        name="LongBench",
        required=MappingProxyType({
            "input": NON_EMPTY_STR if "{input}" in template else STR,
            "context": NON_EMPTY_STR,
            "answers": answers,
            "length": COUNT,
            "dataset": equal_to(task, "the task of the file"),
            "language": STR,
            "all_classes": STR_LIST if needs_classes else OPTIONAL_STR_LIST,
            "_id": NON_EMPTY_STR,
        }),
        id_field="_id",
    )


# NVIDIA/RULER scripts/data/synthetic/*.py: `input` holds the whole prompt (context included),
# `outputs` the gold answers; newer versions add the answer prefix, the length with the model's
# template and the answer's token position.
RULER_SCHEMA = Schema(
    name="RULER",
    required=MappingProxyType({
        "index": COUNT,
        "input": NON_EMPTY_STR,
        "outputs": ANSWERS,
        "length": COUNT,
    }),
    id_field="index",
    optional=MappingProxyType({
        "length_w_model_temp": COUNT,
        "answer_prefix": STR,
        "token_position_answer": OPTIONAL_COUNT,
    }),
)


def preview(value: object) -> str:
    """A value for a message: its JSON type and a short JSON rendering (always one line)."""
    if value is None:
        return "null"
    text = json.dumps(value, ensure_ascii=False, default=repr)
    if len(text) > PREVIEW_CHARS:
        text = text[:PREVIEW_CHARS] + "..."
    return f"{type(value).__name__} {text}"


def field_problem(row: object, schema: Schema) -> str | None:
    """What is wrong with one row under `schema` (the first problem found), or None."""
    if not isinstance(row, dict):
        return f"expected a JSON object (a {schema.name} row), got {preview(row)}"
    for name, kind in schema.required.items():
        if name not in row:
            return f"field {name!r} is missing (it must be {kind.expected})"
    kinds = {**schema.required, **schema.optional}
    for name, value in row.items():
        if name not in kinds:
            return f"field {name!r} is not in the {schema.name} schema ({sorted(kinds)})"
        if not kinds[name].accepts(value):
            return f"field {name!r} must be {kinds[name].expected}, got {preview(value)}"
    return None if schema.check is None else schema.check(row)


def check_rows(
    rows: Iterable[tuple[str, object]], schema: Schema, source: str, fix: str
) -> list[dict]:
    """Every (label, row) of `source` checked, ids unique; the rows, or the first RowError.

    `label` locates a row in its source ("line 7", "row 3"); `fix` says what to do about a bad
    row and ends every message, e.g. "fix the row or re-download the official file".
    """
    seen: dict[Hashable, str] = {}
    checked = []
    for label, row in rows:
        problem = field_problem(row, schema)
        row_id = None if problem or schema.id_field is None else row[schema.id_field]
        if row_id is not None and row_id in seen:
            problem = (f"field {schema.id_field!r} {preview(row_id)} repeats the id of "
                       f"{seen[row_id]} (ids must be unique)")
        if problem is not None:
            raise RowError(f"{source} {label}: {problem}; {fix}")
        if row_id is not None:
            seen[row_id] = label
        checked.append(row)
    return checked


def parse_line(raw: bytes, source: str, label: str, fix: str) -> object:
    """One JSON value from one line's bytes, or a RowError naming the line (torn, not UTF-8)."""
    try:
        return json.loads(raw.decode("utf-8").rstrip("\r\n"))  # a torn string ends at the line
    except UnicodeDecodeError as err:
        problem = f"not UTF-8 text (byte {err.start + 1})"
    except json.JSONDecodeError as err:
        problem = f"not valid JSON ({err.msg} at column {err.colno}: a torn or truncated row)"
    raise RowError(f"{source} {label}: {problem}; {fix}")


def read_jsonl(path: str | os.PathLike, schema: Schema, fix: str) -> list[dict]:
    """Every row of a JSONL file, parsed and checked against `schema` (blank lines skipped).

    The whole file is checked even when the caller uses only its first rows: a bad row or a
    repeated id further down would otherwise appear only when more samples are asked for. A
    file with no row (empty or blank) is a RowError too: there is nothing to evaluate, and a
    run would otherwise record the empty file's checksum and fail later.
    """
    source = os.fspath(path)
    with open(path, "rb") as f:
        lines = [(f"line {n}", raw) for n, raw in enumerate(f, 1) if raw.strip()]
    if not lines:
        raise RowError(f"{source} holds no rows (it is empty or blank); {fix}")
    return check_rows(((label, parse_line(raw, source, label, fix)) for label, raw in lines),
                      schema, source, fix)
