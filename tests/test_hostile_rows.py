"""Rows that break what a suite's prompt or score assumes (issue #42, cases 1 and 7).

Case 1: an empty or whitespace-only reference answer is found in any prediction (`"" in pred`),
so FullKV scored 100 % on it. Every suite that reads answers from files refuses it when the
rows are read, naming the row and field; every scorer handed one raises instead of scoring.

Case 7: InfiniteBench rows that break a task's assumptions (code_run's `func_N(x)`,
math_find's "The ... of", a choice answer naming no option, a non-string choice answer, a
non-numeric label) failed only while prompting or scoring, after the run folder's config.json
was written. Each is now one RowError line from the suite's load. The same holds for what
kvpress's, LongBench's, LongBench v2's and RULER's prompts and scores assume.

Each test here failed before the fix (the row loaded, then scored 100 % or crashed later).
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import pytest

from experiments import protocol, rows, suites
from experiments.suites import infinitebench as ib
from experiments.suites import kvpress, loogle, niah, ruler, synthetic
from experiments.suites import longbench_v2 as lb2
from experiments.suites.base import RowSettings


def write_jsonl(path: pathlib.Path, items: list) -> pathlib.Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in items),
                    encoding="utf-8")
    return path


def load_error(suite: str, folder: pathlib.Path, dataset: str) -> str:
    """The one-line RowError of loading `dataset` from `folder` (it must raise one)."""
    with pytest.raises(rows.RowError) as err:
        suites.get(suite).load(RowSettings(data_dir=str(folder)), None, None, [dataset], None)
    message = str(err.value)
    assert "\n" not in message and err.value.__cause__ is None, message
    return message


# --- InfiniteBench -----------------------------------------------------------------------------

HAY = "The grass is green. The sky is blue. "
GOOD = {  # one valid row of every ported task, in the task files' schema
    "passkey": {"input": "What is the pass key?", "answer": ["71432"]},
    "number_string": {"input": "What is the sequence of digits?", "answer": ["3456789012"]},
    "kv_retrieval": {"input": 'Key: "e5f6"\nThe value is: ', "answer": "0a9b"},
    "longbook_choice_eng": {"input": "Where did Mara sail?", "answer": ["North"],
                            "options": ["South", "North", "East", "West"]},
    "longbook_qa_eng": {"input": "Where did Mara sail?", "answer": ["north"]},
    "longbook_qa_chn": {"input": "玛拉去了哪里？", "answer": ["北方"]},
    "math_find": {"input": "What is the largest number? The largest number of the list is: ",
                  "answer": [9]},
    "code_run": {"input": "Please give me the exact value of func_1(-3)", "answer": [-1]},
    "code_debug": {"input": "", "answer": ["func_2"],
                   "options": ["func_1", "func_2", "func_3", "func_4"]},
    "longdialogue_qa_eng": {"input": "", "answer": ["MARA"]},
}  # fmt: skip


def ib_row(task: str, **changes) -> dict:
    return {"id": 0, "context": HAY * 3, "options": [], **GOOD[task], **changes}


def ib_error(tmp_path: pathlib.Path, task: str, **changes) -> str:
    """The load error of a file whose line 2 is `task`'s good row with `changes`."""
    write_jsonl(tmp_path / f"{task}.jsonl", [ib_row(task), ib_row(task, id=1, **changes)])
    return load_error("infinitebench", tmp_path, ib.DATASET_PREFIX + task)


def test_infinitebench_good_rows_load_prompt_and_score(tmp_path):
    """The control: the checks below refuse no valid row of any task."""
    for task in GOOD:
        write_jsonl(tmp_path / f"{task}.jsonl", [ib_row(task)])
    datasets = [ib.DATASET_PREFIX + t for t in GOOD]
    loaded = ib.SUITE.load(RowSettings(data_dir=str(tmp_path)), None, None, datasets, None)
    for dataset, (row,) in loaded.items():
        assert ib.prompt(row, dataset) and ib.question(row, dataset)
        assert ib.score_row(dataset, "", row["answers"]) == 0.0


@pytest.mark.parametrize("task, answer", [
    ("passkey", ""), ("passkey", " "), ("passkey", ["\n"]), ("kv_retrieval", ""),
    ("longbook_choice_eng", ["North", ""]), ("longbook_qa_eng", ["north", " "]),
])  # fmt: skip
def test_infinitebench_refuses_a_blank_answer_when_read(tmp_path, task, answer):
    # was: passkey "" scored 100 (first_int of an answer without digits is ""); ["red", ""]
    # passed as [option, letter] ("" in "ABCD") and matched "The answer is: Z"
    message = ib_error(tmp_path, task, answer=answer)
    assert message.startswith(
        f"{tmp_path / task}.jsonl line 2: field 'answer' must be a non-blank string or a "
        f"non-empty list of non-blank strings / finite numbers, got {rows.preview(answer)}; "
    ), message
    assert message.endswith(ib.FIX)


@pytest.mark.parametrize("dataset, answers", [
    ("infbench_passkey", [""]), ("infbench_longbook_choice_eng", ["red", ""]),
    ("infbench_kv_retrieval", [" "]), ("infbench_code_debug", ["func_2", ""]),
])  # fmt: skip
def test_infinitebench_scorer_refuses_a_blank_reference(dataset, answers):
    # infinitebench.score_row("infbench_longbook_choice_eng", "The answer is: Z", ["red", ""])
    # was 1.0
    with pytest.raises(ValueError, match=re.escape(f"{dataset}: cannot score against the "
                                                   "reference answers list")):
        ib.score_row(dataset, "The answer is: Z", answers)


@pytest.mark.parametrize("task, changes, needle", [
    # IndexError in prompt() (create_prompt's re.findall(...)[0])
    ("code_run", {"input": "Please compute func_one of minus three"},
     "field 'input' must hold a call func_N(x) (the prompt asks for the value of the first), "
     'got str "Please compute func_one of minus three"'),
    ("math_find", {"input": "What is the largest number in the list?"},
     "field 'input' must hold \"The ... of\" (the prompt asks for the thing it names)"),
    # KeyError 'OPTION_C' in prompt(): [option, letter] was taken without looking at options
    ("longbook_choice_eng", {"answer": ["North", "C"], "options": ["South", "North"]},
     "field 'options' must be the four non-blank choices the prompt shows as A-D, "
     'got list ["South", "North"]'),
    ("longbook_choice_eng", {"answer": ["North", "C"]},  # C is "East"
     "field 'answer' must be one of the four 'options' (a string or a one-element list) or "
     '[that option, its letter A-D], got list ["North", "C"]'),
    ("code_debug", {"answer": ["func_2", "AB"]}, "field 'answer' must be one of the four"),
    # TypeError in labels(): 5 in "ABCD"
    ("longbook_choice_eng", {"answer": ["North", 5]},
     'field \'answer\' must be one of the four \'options\' (a string or a one-element list) or '
     '[that option, its letter A-D], got list ["North", 5]'),
    ("code_debug", {"answer": [2]}, "field 'answer' must be one of the four 'options'"),
    # ValueError of a bare int() while scoring
    ("math_find", {"answer": ["nine"]},
     "field 'answer' must be numbers (math_find compares the number in the prediction with "
     'them), got list ["nine"]'),
    ("code_run", {"answer": "minus one"}, "field 'answer' must be numbers (code_run compares"),
    # never matched: the score compares the prediction's first run of digits
    ("passkey", {"answer": ["7143two"]},
     "field 'answer' must be runs of digits (passkey compares the prediction's first run of "
     'digits with them), got list ["7143two"]'),
    ("number_string", {"answer": [-12]}, "field 'answer' must be runs of digits"),
])  # fmt: skip
def test_infinitebench_task_assumptions_are_checked_when_read(tmp_path, task, changes, needle):
    message = ib_error(tmp_path, task, **changes)
    assert message.startswith(f"{tmp_path / task}.jsonl line 2: {needle}"), message
    assert message.endswith(ib.FIX)


def test_infinitebench_non_finite_labels(tmp_path):
    # json reads NaN; str(nan) "nan" then broke math_find's int() while scoring
    message = ib_error(tmp_path, "math_find", answer=[math.nan])
    assert ("line 2: field 'answer' must be a non-blank string or a non-empty list of non-blank "
            "strings / finite numbers, got list [NaN]") in message, message


HOSTILE = [
    {"answer": ""}, {"answer": " "}, {"answer": [""]}, {"answer": ["North", ""]},
    {"answer": [5]}, {"answer": ["North", 5]}, {"answer": ["North", "C"]},
    {"answer": ["North", "AB"]}, {"answer": ["North", "B", "C"]}, {"answer": "nine"},
    {"answer": [1.5]}, {"answer": [-3]}, {"answer": [math.nan]}, {"answer": [math.inf]},
    {"input": ""}, {"input": "no call, no phrase"}, {"options": []},
    {"options": ["South", "North"]}, {"options": ["", "North", "East", "West"]},
]  # fmt: skip


@pytest.mark.parametrize("task", list(GOOD))
def test_infinitebench_a_row_that_loads_can_be_prompted_and_scored(tmp_path, task):
    """Whatever a task file holds, load refuses it by line and field, or every later use of
    the row works: its labels are non-blank, and prompt, question, generation length and
    score run (0 for an empty prediction: no reference matches everything)."""
    dataset = ib.DATASET_PREFIX + task
    for changes in HOSTILE:
        write_jsonl(tmp_path / f"{task}.jsonl", [ib_row(task, **changes)])
        try:
            (row,) = ib.SUITE.load(RowSettings(data_dir=str(tmp_path)), None, None,
                                   [dataset], None)[dataset]
        except rows.RowError as e:
            assert re.search(r"\.jsonl line 1: field '(answer|input|options)' ", str(e)), e
            continue
        assert all(a.strip() for a in row["answers"]), changes  # case 1: a blank never loads
        assert ib.prompt(row, dataset) and ib.question(row, dataset), changes
        assert protocol.max_new_tokens(dataset, row) > 0
        for pred in (" 71432.", "The answer is: Z", "B. North", " -1", " 9", " MARA"):
            assert 0.0 <= ib.score_row(dataset, pred, row["answers"]) <= 1.0, (changes, pred)
        assert ib.score_row(dataset, "", row["answers"]) == 0.0, changes


# --- LongBench v1 ------------------------------------------------------------------------------


def lb_row(task: str, **changes) -> dict:
    row = {"input": "Which paragraph?", "context": "Paragraph 1: the Louvre is in Paris.",
           "answers": ["Paris"], "length": 9, "dataset": task, "language": "en",
           "all_classes": None, "_id": "a1"}
    return {**row, **changes}


@pytest.mark.parametrize("task, answers", [
    ("hotpotqa", ["Paris", ""]), ("hotpotqa", [" "]), ("lcc", ["\n"]),
])  # fmt: skip
def test_longbench_refuses_a_blank_answer_when_read(tmp_path, task, answers):
    # lcc's code_sim gave fuzz.ratio("", "") = 100 to an empty first code line
    write_jsonl(tmp_path / f"{task}.jsonl", [lb_row(task), lb_row(task, _id="b", answers=answers)])
    message = load_error("longbench", tmp_path, task)
    assert f"{task}.jsonl line 2: field 'answers' must be a non-empty list of non-blank " \
           f"strings, got list {json.dumps(answers)}; fix the row" in message, message


@pytest.mark.parametrize("task, answers, needle", [
    # ValueError of _paragraph_id once the run was scored
    ("passage_retrieval_en", ["19"],
     'each holding "Paragraph N" (the retrieval metric reads N from it), got list ["19"]'),
    ("passage_retrieval_zh", ["Paragraph 3"], 'each holding "段落N"'),
    # never matched: count_score compares the prediction's numbers with the answer
    ("passage_count", ["three"], "each a number in digits (the count metric matches"),
])  # fmt: skip
def test_longbench_answers_its_metric_reads_are_checked_when_read(tmp_path, task, answers,
                                                                  needle):
    good = {"passage_retrieval_en": ["Paragraph 1"], "passage_retrieval_zh": ["段落1"],
            "passage_count": ["1"]}[task]
    write_jsonl(tmp_path / f"{task}.jsonl",
                [lb_row(task, answers=good), lb_row(task, _id="b", answers=answers)])
    message = load_error("longbench", tmp_path, task)
    assert f"{task}.jsonl line 2: field 'answers' must be a non-empty list of non-blank " \
           f"strings, {needle}" in message, message


@pytest.mark.parametrize("dataset, answers", [
    ("lcc", [""]), ("hotpotqa", ["Paris", " "]), ("samsum", ["\t"]),
])  # fmt: skip
def test_longbench_scorer_refuses_a_blank_reference(dataset, answers):
    # lcc: code_sim("", "") was 1.0; samsum: rouge of a whitespace-only reference matched " . "
    with pytest.raises(ValueError, match=f"{dataset}: cannot score against the reference"):
        suites.row_score(dataset, "", answers, None)


# --- RULER -------------------------------------------------------------------------------------


def ruler_row(index: int, **changes) -> dict:
    row = {"index": index, "input": "Some text. The magic number is 42.\nWhat is the number?",
           "outputs": ["42"], "length": 20, "answer_prefix": " The number is"}
    return {**row, **changes}


def ruler_error(tmp_path: pathlib.Path, **changes) -> str:
    write_jsonl(tmp_path / "niah_single_1_4096.jsonl", [ruler_row(0), ruler_row(1, **changes)])
    with pytest.raises(rows.RowError) as err:
        ruler.load_suite(None, None, ["niah_single_1"], 1, 4096, data_dir=tmp_path)
    return str(err.value)


@pytest.mark.parametrize("outputs", [[""], ["42", " "]])
def test_ruler_refuses_a_blank_output_when_read(tmp_path, outputs):
    # string_match_all: "" is in every prediction, a full score
    message = ruler_error(tmp_path, outputs=outputs)
    assert "niah_single_1_4096.jsonl line 2: field 'outputs' must be a non-empty list of " \
           f"non-blank strings, got list {json.dumps(outputs)}" in message, message


def test_ruler_refuses_a_prompt_without_its_question_line_when_read(tmp_path):
    # the suite's question() (rindex("\n")) raised once --protocol query_agnostic ran; the
    # row past --num_samples 1 is checked too, as every row of the file
    message = ruler_error(tmp_path, input="Some text. What is the number?")
    assert re.search(r"niah_single_1_4096\.jsonl index 1: field 'input' has no line break "
                     r"\(RULER's prompts end in the question on a line of its own", message)


def test_ruler_scorers_refuse_a_blank_reference():
    for score in (ruler.string_match_all, ruler.string_match_part):
        with pytest.raises(ValueError, match="cannot score against the reference answers"):
            score("anything", ["42", ""])
    with pytest.raises(ValueError, match="ruler_vt: cannot score against"):
        suites.row_score("ruler_vt", "anything", [" "], None)


# --- kvpress -----------------------------------------------------------------------------------


def kv_row(**changes) -> dict:
    row = {"context": "The pass key is 71432. ", "question": "What is the pass key?",
           "answer_prefix": " The pass key is", "answer": "71432", "max_new_tokens": 6}
    return {**row, **changes}


def kv_error(tmp_path: pathlib.Path, task: str, dataset: str | None = None, **changes) -> str:
    write_jsonl(tmp_path / f"{task}.jsonl", [kv_row(**changes)])
    return load_error("kvpress", tmp_path, dataset or f"kvpress/{task}")


@pytest.mark.parametrize("answer", [" ", ["71432", ""], ["\n"]])
def test_kvpress_refuses_a_blank_answer_when_read(tmp_path, answer):
    # "" passed as one answer of a list, " " as the answer: both matched any prediction
    message = kv_error(tmp_path, "niah_single_1", answer=answer)
    assert message.startswith(
        f"{tmp_path / 'niah_single_1.jsonl'} line 1: field 'answer' must be a non-blank "
        "string, a non-negative integer or a non-empty list of non-blank strings, got "
    ), message


@pytest.mark.parametrize("task, dataset, changes, needle", [
    # ValueError "classification needs the dataset's all_classes" once the run was scored
    ("trec", None, {"answer": ["City"]},
     "field 'all_classes' must be a non-empty list of strings (the classification metric "
     "scores task 'trec' against it), got null"),
    ("passage_retrieval_en", None, {"answer": "19"},
     "field 'answer' of a 'passage_retrieval_en' row must be answers each holding "
     '"Paragraph N" (the retrieval metric reads N from it), got str "19"'),
    ("paragraphs", "kvpress/paragraphs@longbench_retrieval", {"answer": ["19"]},
     "field 'answer' of a 'paragraphs' row must be answers each holding \"Paragraph N\""),
    ("passkey", None, {"answer": "seven"},
     "field 'answer' of a 'passkey' row must be answers each a run of digits (first_int "
     "matches the prediction's first one with it), got str \"seven\""),
])  # fmt: skip
def test_kvpress_what_a_metric_reads_is_checked_when_read(tmp_path, task, dataset, changes,
                                                          needle):
    message = kv_error(tmp_path, task, dataset, **changes)
    assert message.startswith(f"{tmp_path / task}.jsonl line 1: {needle}"), message
    assert message.endswith(kvpress.FIX)


def test_kvpress_checks_only_the_metrics_of_the_tasks_it_scores(tmp_path):
    write_jsonl(tmp_path / "trec.jsonl", [kv_row(answer="City")])  # no all_classes
    write_jsonl(tmp_path / "aime25.jsonl", [kv_row(answer=70)])
    settings = RowSettings(data_dir=str(tmp_path))
    loaded = kvpress.SUITE.load(settings, None, None, ["kvpress/aime25"], None)
    assert loaded["kvpress/aime25"][0]["answers"] == ["70"]
    assert load_error("kvpress", tmp_path, "kvpress/trec").startswith(
        f"{tmp_path / 'trec.jsonl'} line 1: field 'all_classes' must be")


@pytest.mark.parametrize("dataset, answers", [
    ("kvpress/niah_single_1", [""]), ("kvpress/longdialogue_qa_eng", ["MARA", " "]),
    ("kvpress/aime25", [""]), ("kvpress/x@contains_upper", [""]),
])  # fmt: skip
def test_kvpress_scorer_refuses_a_blank_reference(dataset, answers):
    with pytest.raises(ValueError, match=f"{re.escape(dataset)}: cannot score against"):
        suites.row_score(dataset, "\\boxed{}", answers, None)


# --- LongBench v2, LooGLE, synthetic, niah -----------------------------------------------------


def test_longbench_v2_refuses_a_blank_right_choice_when_read(tmp_path):
    good = {"_id": "a", "domain": "d", "sub_domain": "s", "difficulty": "easy",
            "length": "short", "question": "Which year?", "choice_A": "1998",
            "choice_B": "2003", "choice_C": "2011", "choice_D": "2019", "answer": "B",
            "context": "The survey began in 2003."}
    (tmp_path / "data.json").write_text(json.dumps([good, {**good, "_id": "b",
                                                           "choice_B": "  "}]))
    message = load_error("longbench_v2", tmp_path, lb2.DATASET)
    assert message == (f"{tmp_path / 'data.json'} row 1: field 'choice_B' (the choice field "
                       "'answer' names) must be a non-blank string (not empty or whitespace "
                       f'only), got str "  "; {lb2.FIX}')
    with pytest.raises(ValueError, match="longbench_v2: cannot score against"):
        lb2.score_row(lb2.DATASET, "The correct answer is (B)", [""], None)


def test_loogle_refuses_a_blank_answer_when_read_and_scored(tmp_path):
    doc = {"input": "A document.", "title": "T", "output": "none",
           "qa_pairs": [{"Q": "q?", "A": "a"}, {"Q": "q2?", "A": " "}]}
    write_jsonl(tmp_path / "shortdep_qa.jsonl", [doc])
    assert "line 1: field 'qa_pairs' pair 2 must be a dict with non-empty strings 'Q' and " \
           "'A'" in load_error("loogle", tmp_path, "loogle_shortdep_qa")
    # pltrdy/rouge reads " " as the word "", recalled by a prediction's blank sentence: was 1.0
    with pytest.raises(ValueError, match="LooGLE's rouge_l_recall: cannot score against"):
        loogle.loogle_score("a. .", [" "])


def test_generated_rows_and_their_scorers_refuse_blank_answers():
    bad = {"input": "What is the pass key?", "context": "The pass key is 1.", "answers": [""],
           "length": 9, "dataset": "passkey", "language": "en", "all_classes": None,
           "_id": "p0"}
    with pytest.raises(rows.RowError, match="row 0: field 'answers' must be a non-empty list "
                                            "of non-blank strings"):
        synthetic.check_rows("passkey", [bad])
    for dataset in ("passkey", niah.DATASET):  # match_any("", [""]) was 1.0
        with pytest.raises(ValueError, match=f"{dataset}: cannot score against"):
            suites.row_score(dataset, "", [""], None)
