"""LongBench v2 read natively (`experiments.suites.longbench_v2`), on hand-made rows in the
official schema: the twelve fields `pred.py` reads from `THUDM/LongBench-v2`
(THUDM/LongBench at commit 2e00731, `pred.py`'s `data_all`), as data.json (a JSON array)
and data.jsonl; the 0-shot prompt, the answer extraction, strict row checks and a run end
to end on the tiny model with the report's breakdown by difficulty and length.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
from test_runner import env, model_dir, read_rows, run_ok  # noqa: F401 (fixtures)

from experiments import context_protocols, protocol
from experiments.rows import RowError
from experiments.suites import longbench_v2 as lb2


def _row(i: int, difficulty="easy", length="short", answer="B") -> dict:
    return {
        "_id": f"66f36490821e116aacb2{i:04d}", "domain": "Single-Document QA",
        "sub_domain": "Academic", "difficulty": difficulty, "length": length,
        "question": f"  Which year did the survey {i} begin? ",
        "choice_A": "1998", "choice_B": " 2003", "choice_C": "2011", "choice_D": "2019",
        "answer": answer,
        "context": f"\n The survey {i} began in 2003 and ran for a decade. " * 3,
    }  # fmt: skip


ROWS = [_row(0), _row(1, "hard", "medium", "C"), _row(2, "hard", "long", "A"), _row(3)]


@pytest.fixture
def data_dir(tmp_path):
    (tmp_path / "data.json").write_text(json.dumps(ROWS))
    return tmp_path


def test_rows_from_data_json_and_jsonl(tmp_path, data_dir):
    got = lb2.read_rows(data_dir / "data.json")
    assert [r["_id"] for r in got] == [r["_id"] for r in ROWS]
    assert got[1]["answers"] == ["C"] and got[1]["all_classes"] is None
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert lb2.read_rows(tmp_path / "j" / "data.jsonl") == got


@pytest.mark.parametrize("field, value, needle", [
    ("answer", "E", "field 'answer' must be one of ['A', 'B', 'C', 'D']"),
    ("difficulty", "medium", "field 'difficulty' must be one of ['easy', 'hard']"),
    ("context", "", "field 'context' must be a non-empty string"),
    ("extra", 1, "field 'extra' is not in the LongBench v2 schema"),
])  # fmt: skip
def test_bad_rows_are_refused_by_file_row_and_field(tmp_path, field, value, needle):
    bad = [ROWS[0], {**ROWS[1], field: value}]
    (tmp_path / "data.json").write_text(json.dumps(bad))
    with pytest.raises(RowError, match="data.json row 1: " + re.escape(needle)):
        lb2.read_rows(tmp_path / "data.json")
    (tmp_path / "data.json").write_text(json.dumps([ROWS[0], ROWS[0]]))
    with pytest.raises(RowError, match="repeats the id"):
        lb2.read_rows(tmp_path / "data.json")


def test_prompt_and_question_as_pred_py_builds_them():
    row = ROWS[0]
    text = lb2.prompt(row, lb2.DATASET)
    assert text.startswith("Please read the following text and answer the question below."
                           "\n\n<text>\nThe survey 0 began")  # stripped
    assert "</text>\n\nWhat is the correct answer to this question: Which year did the " \
           "survey 0 begin?\nChoices:\n(A) 1998\n(B) 2003\n(C) 2011\n(D) 2019\n\n" in text
    assert text.endswith('Format your response as follows: "The correct answer is (insert '
                         'answer here)".')
    assert protocol.build_prompt(row, lb2.DATASET) == text
    question = context_protocols.question_text(row, lb2.DATASET)
    assert question.startswith("\n</text>\n\nWhat is the correct") and text.endswith(question)


@pytest.mark.parametrize("response, letter", [
    ("The correct answer is (B)", "B"), ("**The correct answer is (C).**", "C"),
    ("The correct answer is D, since ...", "D"), ("I think (A).", None), ("", None),
])  # fmt: skip
def test_answer_extraction(response, letter):
    assert lb2.extract_answer(response) == letter
    assert lb2.score_row(lb2.DATASET, response, ["B"], None) == float(letter == "B")


def test_a_run_end_to_end_with_the_breakdown(model_dir, env, data_dir, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    run_ok([sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
            "--suite", "longbench_v2", "--data_dir", str(data_dir), "--rules", "full,snapkv",
            "--timings", "prefill", "--budgets", "16", "--window", "4",
            "--out_dir", str(out)], env)  # fmt: skip
    lines = read_rows(out)
    assert len(lines) == 2 * len(ROWS)
    assert {r["sample_id"]: r["groups"] for r in lines} == {
        r["_id"]: {"difficulty": r["difficulty"], "length": r["length"]} for r in ROWS}
    text = (out / "results.md").read_text()
    assert "By difficulty:" in text and "| cell | difficulty = easy | difficulty = hard |" in text
    assert "| cell | length = long | length = medium | length = short |" in text
    config = json.loads((out / "config.json").read_text())
    assert config["identity"]["suite"] == "longbench_v2"
