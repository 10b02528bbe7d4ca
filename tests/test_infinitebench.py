"""InfiniteBench read natively (`experiments.suites.infinitebench`), on hand-made rows in the
schema of the task files (`id`, `context`, `input`, `answer`, `options`: the fields
OpenBMB/InfiniteBench's `src/eval_utils.py` reads): the open-model prompts of
`create_prompt`, `compute_scores.py`'s scores per task, strict row checks, and a run end to
end on the tiny model.
"""

from __future__ import annotations

import json
import sys

import pytest
from test_runner import env, model_dir, read_rows, run_ok  # noqa: F401 (fixtures)

from experiments import context_protocols, protocol
from experiments.rows import RowError
from experiments.suites import infinitebench as ib

HAY = "The grass is green. The sky is blue. " * 4

ROWS = {
    "passkey": [{"id": 0, "context": HAY + "The pass key is 71432. " + HAY,
                 "input": "What is the pass key?", "answer": ["71432"], "options": []}],
    "kv_retrieval": [{"id": 0, "context": '{"a1b2": "c3d4", "e5f6": "0a9b"}',
                      "input": "Key: \"e5f6\"\nThe value associated with the specified key is: ",
                      "answer": "0a9b", "options": []}],
    "longbook_choice_eng": [{"id": 3, "context": "Once upon a time, Mara sailed north.",
                             "input": "Where did Mara sail?", "answer": ["North"],
                             "options": ["South", "North", "East", "West"]}],
    "code_run": [{"id": 1, "context": "def func_1(x):\n    return x + 2\n",
                  "input": "Please give me the exact value of func_1(-3)", "answer": [-1],
                  "options": []}],
    "math_find": [{"id": 2, "context": "[4, 9, 1, 7]",
                   "input": "What is the largest number in the list? The largest number of "
                            "the list is: ", "answer": [9], "options": []}],
}  # fmt: skip


@pytest.fixture
def data_dir(tmp_path):
    for task, rows in ROWS.items():
        (tmp_path / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_rows_and_labels(data_dir):
    (choice,) = ib.read_rows(data_dir / "longbook_choice_eng.jsonl", "longbook_choice_eng")
    assert choice["_id"] == "3" and choice["answers"] == ["North", "B"]  # get_answer
    (kv,) = ib.read_rows(data_dir / "kv_retrieval.jsonl", "kv_retrieval")
    assert kv["answers"] == ["0a9b"]
    (run,) = ib.read_rows(data_dir / "code_run.jsonl", "code_run")
    assert run["answers"] == ["-1"]


@pytest.mark.parametrize("field, value, needle", [
    ("id", -1, "field 'id' must be a non-negative integer"),
    ("answer", [], "field 'answer' must be a non-blank string or a non-empty list"),
    ("extra", 1, "field 'extra' is not in the InfiniteBench schema"),
])  # fmt: skip
def test_bad_rows_are_refused_by_file_line_and_field(tmp_path, field, value, needle):
    path = tmp_path / "passkey.jsonl"
    good = ROWS["passkey"][0]
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "id": 1, field: value}) + "\n")
    with pytest.raises(RowError, match="passkey.jsonl line 2: " + needle.replace("[", r"\[")):
        ib.read_rows(path, "passkey")
    path.write_text(json.dumps({**ROWS["longbook_choice_eng"][0], "answer": ["Up"]}) + "\n")
    with pytest.raises(RowError, match="one of the four 'options'"):
        ib.read_rows(path, "longbook_choice_eng")


def test_prompts_as_create_prompt_builds_them():
    run = {**ROWS["code_run"][0]}
    text = ib.prompt(run, "infbench_code_run")
    assert text.startswith("There is a function called func_1 in the following Python code.")
    assert text.endswith("Please compute the exact value of func_1(-3). The value of "
                         "func_1(-3) is")
    find = ib.prompt(ROWS["math_find"][0], "infbench_math_find")
    assert find.startswith("What is the largest number in the following list?\n\n[4, 9, 1, 7]\n\n")
    choice = ib.prompt(ROWS["longbook_choice_eng"][0], "infbench_longbook_choice_eng")
    assert "Question: Where did Mara sail?\nA. South\nB. North\nC. East\nD. West\n\n" in choice
    key = ib.prompt(ROWS["passkey"][0], "infbench_passkey")
    assert key.endswith("\n\nWhat is the pass key?\n\nThe pass key is")
    assert protocol.build_prompt(ROWS["passkey"][0], "infbench_passkey") == key
    question = context_protocols.question_text(ROWS["passkey"][0], "infbench_passkey")
    assert question == "\n\nWhat is the pass key?\n\nThe pass key is"


@pytest.mark.parametrize("dataset, pred, answers, score", [
    ("infbench_passkey", " 71432.", ["71432"], 1.0),
    ("infbench_passkey", " 7143", ["71432"], 0.0),
    ("infbench_kv_retrieval", ' "0a9b".', ["0a9b"], 1.0),
    ("infbench_longbook_choice_eng", " B. North", ["North", "B"], 1.0),
    ("infbench_longbook_choice_eng", "The answer is: C", ["North", "B"], 0.0),
    ("infbench_longbook_choice_eng", "I think the answer is B", ["North", "B"], 1.0),
    ("infbench_code_debug", "B.", ["func_2", "B"], 1.0),
    ("infbench_code_debug", "the answer is: func_2", ["func_2", "B"], 1.0),
    ("infbench_code_run", " The value is -1", ["-1"], 1.0),  # the last word, an int
    ("infbench_code_run", " 5.", ["5"], 1.0),
    ("infbench_math_find", " 9", ["9"], 1.0),
    ("infbench_math_find", " 9.5", ["9.5"], 1.0),
    ("infbench_longdialogue_qa_eng", " Mara: yes", ["MARA"], 1.0),
    ("infbench_longbook_qa_eng", "north of here", ["North"], 0.5),
])  # fmt: skip
def test_scores_as_compute_scores_gives_them(dataset, pred, answers, score):
    assert ib.score_row(dataset, pred, answers) == pytest.approx(score)


def test_a_run_end_to_end(model_dir, env, data_dir, tmp_path):  # noqa: F811
    out, run = tmp_path / "out", ("passkey", "longbook_choice_eng")  # two prompt forms
    run_ok([sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
            "--suite", "infinitebench", "--data_dir", str(data_dir), "--rules", "full,snapkv",
            "--datasets", ",".join(run),
            "--timings", "prefill", "--budgets", "16", "--window", "4",
            "--out_dir", str(out)], env)  # fmt: skip
    lines = read_rows(out)
    assert {r["dataset"] for r in lines} == {ib.DATASET_PREFIX + t for t in run}
    assert len(lines) == 2 * len(run)
    choice = [r for r in lines if r["dataset"].endswith("choice_eng")]
    assert all(r["answers"] == ["North", "B"] for r in choice)  # get_answer's labels
    scores = json.loads((out / "scores.json").read_text())
    assert set(scores["datasets"]) == {ib.DATASET_PREFIX + t for t in run}
