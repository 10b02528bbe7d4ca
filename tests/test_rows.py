"""Strict rows: every LongBench, synthetic and RULER row is checked field by field.

Each bad row below used to load silently (and be scored wrong) or fail with a traceback that
named neither the file nor the line. Real rows are read from ../shared/data/longbench beside
the checkout (or DGE_LONGBENCH_DIR); tests that need them skip without them, and fail under CI
(tests/conftest.py, shared_data_dir).
"""

import json
import pathlib
import re

import pytest

from experiments import protocol, rows
from experiments.suites import longbench_config as config
from experiments.suites import synthetic

FIX = "; fix the row or re-download the official file"


def good_row(task: str = "hotpotqa", **changes) -> dict:
    """A valid row of `task` in the official schema, with `changes` applied."""
    metric = config.DATASET2METRIC[task]
    classes = ["City", "Food"] if metric == "classification" else None
    answer = {"retrieval": "Paragraph 1", "retrieval_zh": "段落1", "count": "1"}.get(metric,
                                                                                   "Paris")
    row = {"input": "Where is the Louvre?", "context": "Passage 1: The Louvre is in Paris.",
           "answers": [answer], "length": 9, "dataset": task, "language": "en",
           "all_classes": classes, "_id": "a1"}
    return {**row, **changes}


def write_lines(folder: pathlib.Path, dataset: str, lines: list[str]) -> pathlib.Path:
    path = folder / f"{dataset}.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def rejected(folder: pathlib.Path, dataset: str, bad: dict, num_samples: int | None = None) -> str:
    """The message of loading a file whose line 2 is `bad` (line 1 is a good row)."""
    lines = [json.dumps(good_row(dataset, _id="first")), json.dumps(bad)]
    write_lines(folder, dataset, lines)
    with pytest.raises(rows.RowError) as err:
        protocol.load_rows(folder, dataset, num_samples)
    message = str(err.value)
    assert "\n" not in message and message.endswith(FIX)
    assert err.value.__context__ is None and err.value.__cause__ is None  # no chained traceback
    return message


def assert_names(message: str, dataset: str, field: str, problem: str) -> None:
    expected = f"{dataset}.jsonl line 2: field '{field}' {problem}"
    assert expected in message, message


# --- the reproduced faults ---------------------------------------------------------------------


def test_answers_as_a_string(tmp_path):
    # was scored character by character: the right answer 0, "b" 100
    message = rejected(tmp_path, "hotpotqa", good_row(answers="Paris"))
    assert_names(message, "hotpotqa", "answers",
                 'must be a non-empty list of non-blank strings, got str "Paris"')


def test_answers_empty_or_not_strings(tmp_path):
    assert_names(rejected(tmp_path, "hotpotqa", good_row(answers=[])), "hotpotqa", "answers",
                 "must be a non-empty list of non-blank strings, got list []")
    assert_names(rejected(tmp_path, "hotpotqa", good_row(answers=["Paris", 3])), "hotpotqa",
                 "answers", 'must be a non-empty list of non-blank strings, got list ["Paris", 3]')


def test_context_null(tmp_path):
    # was prompted as the text "None"
    message = rejected(tmp_path, "hotpotqa", good_row(context=None))
    assert_names(message, "hotpotqa", "context", "must be a non-empty string, got null")


def test_empty_context(tmp_path):
    message = rejected(tmp_path, "multi_news", good_row("multi_news", context=""))
    assert_names(message, "multi_news", "context", 'must be a non-empty string, got str ""')


def test_duplicate_id(tmp_path):
    # was computed and then silently dropped by the runner's store
    message = rejected(tmp_path, "hotpotqa", good_row(_id="first"))
    assert_names(message, "hotpotqa", "_id", 'str "first" repeats the id of line 1')


def test_duplicate_id_beyond_num_samples(tmp_path):
    # the whole file is checked: asking for more samples later must not reveal a repeat
    message = rejected(tmp_path, "hotpotqa", good_row(_id="first"), num_samples=1)
    assert_names(message, "hotpotqa", "_id", 'str "first" repeats the id of line 1')


def test_torn_json_line(tmp_path):
    # was a 37-line json traceback naming neither the file nor the line
    whole = json.dumps(good_row(_id="second"))
    path = write_lines(tmp_path, "hotpotqa", [json.dumps(good_row()), whole[: len(whole) // 2]])
    for num_samples in (None, 1):  # a torn row past the samples asked for is reported too
        with pytest.raises(ValueError) as err:
            protocol.load_rows(tmp_path, "hotpotqa", num_samples)
        message = str(err.value)
        assert message.startswith(f"{path} line 2: not valid JSON (Unterminated string")
        assert "torn or truncated" in message and message.endswith(FIX) and "\n" not in message
        assert err.value.__context__ is None and err.value.__cause__ is None


def test_length_of_wrong_type(tmp_path):
    for bad, shown in [("3000", 'str "3000"'), (3000.0, "float 3000.0"), (-1, "int -1")]:
        message = rejected(tmp_path, "hotpotqa", good_row(length=bad))
        assert_names(message, "hotpotqa", "length", f"must be a non-negative integer, got {shown}")


def test_bool_is_not_an_int(tmp_path):
    message = rejected(tmp_path, "hotpotqa", good_row(length=True))
    assert_names(message, "hotpotqa", "length", "must be a non-negative integer, got bool true")


def test_all_classes_wrong_type(tmp_path):
    message = rejected(tmp_path, "hotpotqa", good_row(all_classes="Food"))
    assert_names(message, "hotpotqa", "all_classes",
                 'must be null or a list of strings, got str "Food"')
    # trec and lsht are scored against all_classes: there it must be a non-empty list
    message = rejected(tmp_path, "trec", good_row("trec", all_classes=None))
    assert_names(message, "trec", "all_classes", "must be a non-empty list of strings, got null")


# --- the rest of the schema --------------------------------------------------------------------


@pytest.mark.parametrize("field,value,problem", [
    ("input", None, "must be a string, got null"),
    ("dataset", "trec", 'must be "multi_news" (the task of the file), got str "trec"'),
    ("language", 1, "must be a string, got int 1"),
    ("_id", 7, "must be a non-empty string, got int 7"),
    ("_id", "", 'must be a non-empty string, got str ""'),
])
def test_other_fields(tmp_path, field, value, problem):
    message = rejected(tmp_path, "multi_news", good_row("multi_news", **{field: value}))
    assert_names(message, "multi_news", field, problem)


def test_empty_input_only_where_the_prompt_does_not_use_it(tmp_path):
    assert_names(rejected(tmp_path, "hotpotqa", good_row(input="")), "hotpotqa", "input",
                 'must be a non-empty string, got str ""')
    allowed = sorted(t for t, p in config.DATASET2PROMPT.items() if "{input}" not in p)
    assert allowed == ["gov_report", "lcc", "multi_news", "passage_count", "vcsum"]
    for dataset in allowed:
        write_lines(tmp_path, dataset, [json.dumps(good_row(dataset, input=""))])
        assert protocol.load_rows(tmp_path, dataset)[0]["input"] == ""


def test_missing_and_unknown_fields(tmp_path):
    row = good_row()
    del row["answers"]
    message = rejected(tmp_path, "hotpotqa", row)
    assert ("line 2: field 'answers' is missing (it must be a non-empty list of non-blank "
            "strings)") in message
    message = rejected(tmp_path, "hotpotqa", good_row(pred="Paris"))
    assert "line 2: field 'pred' is not in the LongBench schema" in message


def test_non_object_lines(tmp_path):
    for value, shown in [([1, 2], "list [1, 2]"), ("row", 'str "row"'), (None, "null")]:
        message = rejected(tmp_path, "hotpotqa", value)
        assert f"line 2: expected a JSON object (a LongBench row), got {shown}" in message


def test_not_utf8(tmp_path):
    path = tmp_path / "hotpotqa.jsonl"
    path.write_bytes(json.dumps(good_row()).encode() + b"\n" + b'{"input": "\xff"}\n')
    with pytest.raises(rows.RowError, match=re.escape(f"{path} line 2: not UTF-8 text")):
        protocol.load_rows(tmp_path, "hotpotqa")


def test_long_values_are_shortened(tmp_path):
    message = rejected(tmp_path, "hotpotqa", good_row(answers="x" * 5000))
    assert len(message) < 300 and '"xxxx' in message and "..." in message


def test_blank_lines_are_skipped_and_numbers_kept(tmp_path):
    bad = json.dumps(good_row(_id="b", length="9"))
    write_lines(tmp_path, "hotpotqa", [json.dumps(good_row()), "", "  ", bad])
    with pytest.raises(rows.RowError, match=r"hotpotqa\.jsonl line 4: field 'length'"):
        protocol.load_rows(tmp_path, "hotpotqa")


# --- real rows ---------------------------------------------------------------------------------


def test_every_shared_longbench_file_loads(data_dir):
    files = sorted(data_dir.glob("*.jsonl"))
    assert files, f"{data_dir} holds no .jsonl file"
    for path in files:
        assert path.stem in config.ALL_TASKS, path
        loaded = protocol.load_rows(data_dir, path.stem)
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        assert len(loaded) == len(lines) > 0
        assert all(row["dataset"] == path.stem for row in loaded)
        assert protocol.load_rows(data_dir, path.stem, num_samples=2) == loaded[:2]


def test_shared_ruler_rows_fit_the_ruler_schema(data_dir):
    folder = data_dir.parent / "ruler"
    if not any(folder.glob("*.jsonl")):
        pytest.skip(f"no RULER rows next to the LongBench folder ({folder})")
    for path in sorted(folder.glob("*.jsonl")):
        assert len(rows.read_jsonl(path, rows.RULER_SCHEMA, "regenerate the file")) > 0


def test_ruler_schema():
    good = {"index": 0, "input": "ctx. What is the uuid?", "outputs": ["u-1"], "length": 12}
    newer = {**good, "index": 1, "length_w_model_temp": 20, "answer_prefix": " Answer:",
             "token_position_answer": None}
    assert rows.check_rows([("line 1", good), ("line 2", newer)], rows.RULER_SCHEMA, "r.jsonl",
                           "fix it") == [good, newer]
    bad = {**good, "index": 1, "outputs": "u-1"}
    with pytest.raises(rows.RowError, match=re.escape(
            "r.jsonl line 2: field 'outputs' must be a non-empty list of non-blank strings, "
            'got str "u-1"; fix it')):
        rows.check_rows([("line 1", good), ("line 2", bad)], rows.RULER_SCHEMA, "r.jsonl",
                        "fix it")
    with pytest.raises(rows.RowError, match="field 'index' int 0 repeats the id of line 1"):
        rows.check_rows([("line 1", good), ("line 2", good)], rows.RULER_SCHEMA, "r.jsonl", "x")


# --- synthetic rows go through the same check ---------------------------------------------------


class WordCounter:
    """One id per whitespace word: all make_suite needs to measure lengths."""

    def encode(self, text):
        return [0] * len(text.split())

    def decode(self, ids):
        return ""


HAY = tuple(f"Sentence number {w} talks about the weather." for w in ("one", "two", "three"))


def test_synthetic_rows_pass_the_check():
    suite = synthetic.make_suite(WordCounter(), tuple(synthetic.TASKS), 3, 400, sentences=HAY)
    for task, task_rows in suite.items():
        schema = protocol.row_schema(task)
        located = [(f"row {i}", row) for i, row in enumerate(task_rows)]
        assert rows.check_rows(located, schema, task, "x") == task_rows


def test_a_synthetic_generator_bug_is_caught(monkeypatch):
    make_row = synthetic.make_row

    def buggy(*args, **kwargs):
        return {**make_row(*args, **kwargs), "answers": "12345"}

    monkeypatch.setattr(synthetic, "make_row", buggy)
    with pytest.raises(rows.RowError, match=re.escape(
            "synthetic task 'passkey' row 0: field 'answers' must be a non-empty list of "
            'non-blank strings, got str "12345"; a bug in experiments/suites/synthetic.py')):
        synthetic.make_suite(WordCounter(), ["passkey"], 2, 400, sentences=HAY)
