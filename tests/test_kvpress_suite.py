"""The kvpress suite (`experiments.suites.kvpress`) and the LooGLE suite
(`experiments.suites.loogle`).

- kvpress: a folder with a hand-made parquet file and a jsonl file in kvpress's schema
  (NVIDIA/kvpress `evaluation/README.md`: "context, question, answer_prefix, answer,
  max_new_tokens", plus `task`, as `evaluation/benchmarks/ruler/create_huggingface_dataset.py`
  writes it) runs end to end through the runner on the tiny random Llama; each metric family
  gives a hand-checked score for a known prediction; bad rows are refused naming file, line
  or row, and field; an unknown task is one error line naming --metric.
- LooGLE: the shared rows (../shared/data/loogle, or $DGE_LOOGLE_DIR; skipped without them,
  failing under CI) give 80 QA pairs over 5 documents, and the prompt is LooGLE's template.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from experiments import protocol, rows, suites
from experiments.predictions import PREDICTIONS_FILE
from experiments.run_folder import sha256_file
from experiments.suites import kvpress, loogle
from experiments.suites.base import RowSettings

REPO = pathlib.Path(__file__).resolve().parents[1]
CONTEXT = (
    "Some special magic numbers are hidden within the following text. The grass is "
    "green and the sky is blue. One of the special magic numbers for alpha is: 4821. "
    "The sun is yellow and the river flows. "
)
PARQUET_ROWS = [  # RULER-like rows, the task in a column; two generation lengths
    {
        "context": CONTEXT,
        "question": "What is the special magic number for alpha?",
        "answer_prefix": " The special magic number for alpha is",
        "answer": ["4821"],
        "task": "niah_single_1",
        "max_new_tokens": 4,
    },
    {
        "context": CONTEXT + "Another one for beta is: 77.",
        "question": "And for beta?",
        "answer_prefix": " It is",
        "answer": ["77"],
        "task": "niah_single_1",
        "max_new_tokens": 6,
    },
    {
        "context": CONTEXT,
        "question": "Again, for alpha?",
        "answer_prefix": " It is",
        "answer": ["4821"],
        "task": "niah_single_1",
        "max_new_tokens": 4,
    },
]
JSONL_ROWS = [  # aime25.jsonl: the task is the file's stem; `answer` a string
    {
        "context": "Compute 7 times 10. ",
        "question": "Put the answer in \\boxed{}.",
        "answer_prefix": "",
        "answer": "70",
        "max_new_tokens": 3,
    },
]


def write_jsonl(path: pathlib.Path, items: list) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in items), encoding="utf-8")
    return path


def write_parquet(path: pathlib.Path, items: list[dict]) -> pathlib.Path:
    pq.write_table(pa.Table.from_pylist(items), path)
    return path


@pytest.fixture
def kvpress_dir(tmp_path) -> pathlib.Path:
    folder = tmp_path / "kvpress_data"
    folder.mkdir()
    write_parquet(folder / "ruler.parquet", PARQUET_ROWS)
    write_jsonl(folder / "aime25.jsonl", JSONL_ROWS)
    return folder


# --- reading ----------------------------------------------------------------------------------


def test_rows_of_both_files(kvpress_dir):
    suite = suites.get("kvpress")
    settings = RowSettings(data_dir=str(kvpress_dir))
    assert suite.default_datasets(settings) == ["kvpress/aime25", "kvpress/niah_single_1"]
    loaded = suite.load(settings, None, None, ["kvpress/niah_single_1", "kvpress/aime25"], None)
    niah, aime = loaded["kvpress/niah_single_1"], loaded["kvpress/aime25"]
    assert [r["_id"] for r in niah] == [f"ruler.parquet:row {i}" for i in range(3)]
    assert [r["_id"] for r in aime] == ["aime25.jsonl:line 1"]
    assert aime[0]["answers"] == ["70"] and niah[1]["answers"] == ["77"]
    # query-aware: context + question, the chat template around it, the row's prefix after
    row = niah[0]
    assert protocol.build_prompt(row, "kvpress/niah_single_1") == (
        PARQUET_ROWS[0]["context"] + PARQUET_ROWS[0]["question"]
    )
    sample = protocol.prepare_sample(
        row, "kvpress/niah_single_1", _Chars(), 10_000, lambda p: f"<user>{p}</user>"
    )
    assert sample.text == (
        f"<user>{CONTEXT}What is the special magic number for alpha?</user>"
        " The special magic number for alpha is"
    )
    assert [protocol.max_new_tokens("kvpress/niah_single_1", r) for r in niah] == [4, 6, 4]
    assert (
        suite.load(settings, None, None, ["kvpress/niah_single_1"], 2)["kvpress/niah_single_1"]
        == niah[:2]
    )
    assert suite.checksums(settings, ["kvpress/niah_single_1", "kvpress/aime25"]) == {
        "kvpress/niah_single_1": sha256_file(kvpress_dir / "ruler.parquet"),
        "kvpress/aime25": sha256_file(kvpress_dir / "aime25.jsonl"),
    }


class _Chars:
    """A tokenizer of characters (enough for the protocol's truncation)."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_names_do_not_clash_with_other_suites():
    assert suites.for_dataset("kvpress/hotpotqa").name == "kvpress"
    assert suites.for_dataset("hotpotqa").name == "longbench"
    assert suites.for_dataset("kvpress/niah_single_1@string_match_all").name == "kvpress"
    suite = suites.get("kvpress")
    assert suite.resolve(["hotpotqa", "kvpress/vt"]) == ["kvpress/hotpotqa", "kvpress/vt"]
    assert suite.resolve(["aime25"], "string_match_all") == ["kvpress/aime25@string_match_all"]
    with pytest.raises(ValueError, match="not a kvpress task name"):
        suite.resolve(["vt@string_match_all"])
    with pytest.raises(ValueError, match=r"--metric 'nope' is not a kvpress metric; known: "):
        suite.resolve(["vt"], "nope")
    with pytest.raises(ValueError, match="LongBench tasks have fixed metrics"):
        suites.get("longbench").resolve(["hotpotqa"], "string_match_all")
    with pytest.raises(ValueError, match="unknown dataset 'other/vt'"):
        suites.for_dataset("other/vt")


# --- metrics (hand-checked) -------------------------------------------------------------------


@pytest.mark.parametrize(
    "task, prediction, answers, expected",
    [
        # RULER: string_match_all (1 of 2 found), string_match_part (any)
        ("niah_multivalue", "The numbers are 1234 and 9999.", ["1234", "5678"], 0.5),
        ("qa_1", "PARIS, I think", ["Paris", "London"], 1.0),
        # LongBench hotpotqa: token F1 of "bob dylan" vs "dylan": P 1/2, R 1 -> 2/3
        ("hotpotqa", "Bob Dylan", ["Dylan"], 2 / 3),
        ("hotpotqa-e", "Bob Dylan", ["Dylan"], 2 / 3),
        # LongBench trec: first line only, then the class match
        ("trec", "Location\nCountry", ["Location"], 1.0),
        # needle: pltrdy ROUGE-L F, hyps=needle (12 words), refs=prediction (3 words), LCS 3:
        # P 3/12, R 3/3 -> 2 * 0.25 / 1.25 = 0.4
        (
            "needle_in_haystack",
            "eat a sandwich.",
            ["The best thing to do in San Francisco is eat a sandwich."],
            0.4,
        ),
        # aime25: the last \boxed{}; math500: the first; braces balanced; else the final number
        ("aime25", "first \\boxed{12}, then \\boxed{70}", ["70"], 1.0),
        ("math500", "first \\boxed{12}, then \\boxed{70}", ["70"], 0.0),
        ("math500", "so \\boxed{\\frac{1}{2}}.", ["\\frac{1}{2}"], 1.0),
        ("aime25", "The answer is 42.", ["42"], 1.0),
        ("aime25", "no number here", ["42"], 0.0),
        # InfiniteBench
        ("passkey", "The pass key is 71432. Remember it.", ["71432"], 1.0),
        ("number_string", "It is 12 then 71432", ["71432"], 0.0),
        ("kv_retrieval", 'The value is "abc-123".', ["abc-123"], 1.0),
        ("longdialogue_qa_eng", "it was JOHN", ["John"], 1.0),
        ("longbook_qa_eng", "Bob Dylan", ["Dylan"], 2 / 3),
        # LooGLE: ROUGE-L recall, LCS "He was born in" = 4 of the answer's 5 words
        ("shortdep_qa", "He was born in Madrid.", ["He was born in Jerez."], 0.8),
    ],
)
def test_metric_per_task_family(task, prediction, answers, expected):
    classes = ["Location", "Country"] if task == "trec" else None
    got = suites.row_score(f"kvpress/{task}", prediction, answers, classes)
    assert got == pytest.approx(expected, abs=1e-6)


def test_metric_option_scores_every_task_with_one_metric():
    assert suites.row_score("kvpress/aime25@string_match_all", "x 70 y", ["70"], None) == 1.0
    assert suites.row_score("kvpress/aime25", "x 70 y", ["70"], None) == 1.0  # final number
    assert suites.row_score("kvpress/custom@string_match_part", "a b", ["b", "c"], None) == 1.0
    assert suites.score_dataset("kvpress/niah_single_1", ["4821", "no"], [["4821"], ["77"]]) == 50.0


def test_unknown_task_is_one_line_naming_the_option(kvpress_dir):
    write_jsonl(kvpress_dir / "zero_scrolls_gov.jsonl", JSONL_ROWS)
    suite = suites.get("kvpress")
    settings = RowSettings(data_dir=str(kvpress_dir))
    with pytest.raises(ValueError) as e:
        suite.load(settings, None, None, suite.default_datasets(settings), None)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("kvpress task 'zero_scrolls_gov' has no known metric; known tasks: ")
    assert "niah_single_1" in message and "aime25" in message
    assert "--metric NAME (string_match_all, string_match_part" in message
    # with --metric the same task loads
    loaded = suite.load(settings, None, None, ["kvpress/zero_scrolls_gov@string_match_all"], 1)
    assert len(loaded["kvpress/zero_scrolls_gov@string_match_all"]) == 1
    with pytest.raises(ValueError, match="holds no row of kvpress task 'missing'"):
        suite.load(settings, None, None, ["kvpress/missing"], None)


# --- bad rows ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, where",
    [
        ({"max_new_tokens": "4"}, "field 'max_new_tokens' must be a positive integer, got str"),
        ({"max_new_tokens": 0}, "field 'max_new_tokens' must be a positive integer, got int 0"),
        ({"answer": None}, "field 'answer' must be a non-blank string, a non-negative integer"),
        ({"answer": []}, "field 'answer' must be a non-blank string, a non-negative integer"),
        ({"answer": True}, "field 'answer' must be a non-blank string, a non-negative integer"),
        ({"context": ""}, "field 'context' must be a non-empty string"),
        ({"answers": ["x"]}, "fields 'answer' and 'answers' both given"),
        ({"colour": "red"}, "field 'colour' is not in the kvpress schema"),
        ({"task": "a b"}, "field 'task' must be a task name"),
    ],
)
def test_bad_jsonl_row_names_file_line_and_field(tmp_path, change, where):
    good = dict(JSONL_ROWS[0])
    path = write_jsonl(tmp_path / "aime25.jsonl", [good, {**good, **change}])
    with pytest.raises(rows.RowError) as e:
        kvpress.read_file(path)
    assert str(e.value).startswith(f"{path} line 2: {where}"), str(e.value)
    assert str(e.value).endswith(kvpress.FIX)


def test_an_integer_answer_is_read_as_its_text(tmp_path):
    """kvpress scores AIME with `str(true_answer)`: an integer answer is its decimal text."""
    path = write_jsonl(tmp_path / "aime25.jsonl", [{**JSONL_ROWS[0], "answer": 70}])
    (row,) = kvpress.read_file(path)["aime25"]
    assert row["answers"] == ["70"]
    assert suites.row_score("kvpress/aime25", "\\boxed{70}", row["answers"], None) == 1.0


def test_other_bad_files(tmp_path):
    good = dict(JSONL_ROWS[0])
    missing = {k: v for k, v in good.items() if k != "answer"}
    path = write_jsonl(tmp_path / "a.jsonl", [missing])
    with pytest.raises(rows.RowError, match=r"a\.jsonl line 1: field 'answer' is missing"):
        kvpress.read_file(path)
    path = tmp_path / "b.jsonl"
    path.write_text(json.dumps(good) + "\n" + '{"context": "torn\n', encoding="utf-8")
    with pytest.raises(rows.RowError, match=r"b\.jsonl line 2: not valid JSON"):
        kvpress.read_file(path)
    path = write_jsonl(tmp_path / "bad name.jsonl", [good])
    with pytest.raises(rows.RowError, match="stem 'bad name' is not a task name"):
        kvpress.read_file(path)
    path = tmp_path / "c.parquet"
    path.write_bytes(b"not parquet")
    with pytest.raises(rows.RowError, match=r"c\.parquet: not a readable parquet file"):
        kvpress.read_file(path)
    with pytest.raises(FileNotFoundError, match="holds no"):
        kvpress.data_files(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="--data_dir"):
        kvpress.data_files(None)


def test_bad_parquet_row_is_named_by_its_index(tmp_path):
    bad = [dict(r) for r in PARQUET_ROWS]
    bad[2]["max_new_tokens"] = -1
    path = write_parquet(tmp_path / "ruler.parquet", bad)
    with pytest.raises(rows.RowError) as e:
        kvpress.read_file(path)
    assert str(e.value).startswith(
        f"{path} row 2: field 'max_new_tokens' must be a positive integer, got int -1"
    )


# --- the runner, end to end -------------------------------------------------------------------


def test_runner_end_to_end(kvpress_dir, tmp_path):
    """Both files through `python -m experiments.longbench --suite kvpress` on the tiny
    random Llama: every (row, cell) predicted within its row's max_new_tokens, the folder's
    checksums, scores by each task's metric; then an unknown task is refused in one line."""
    from tiny_model import build_tiny_llama

    from dge_jax.checkpoints.tokenizer import Tokenizer

    model_dir = build_tiny_llama(tmp_path / "tiny")
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        TQDM_DISABLE="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    )
    out = tmp_path / "out"
    args = [
        sys.executable,
        "-m",
        "experiments.longbench",
        "--model",
        str(model_dir),
        "--suite",
        "kvpress",
        "--data_dir",
        str(kvpress_dir),
        "--rules",
        "full,snapkv",
        "--timings",
        "prefill",
        "--budgets",
        "16",
        "--window",
        "4",
        "--batch_size",
        "2",
    ]
    proc = subprocess.run(
        [*args, "--out_dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (out / PREDICTIONS_FILE).read_text().splitlines()]
    ids = {
        "kvpress/niah_single_1": [f"ruler.parquet:row {i}" for i in range(3)],
        "kvpress/aime25": ["aime25.jsonl:line 1"],
    }
    assert sorted((r["dataset"], r["sample_id"], r["cell"]) for r in lines) == sorted(
        (d, i, c) for d, found in ids.items() for i in found for c in ("full", "snapkv/prefill/b16")
    )
    limits = {
        **{f"ruler.parquet:row {i}": r["max_new_tokens"] for i, r in enumerate(PARQUET_ROWS)},
        "aime25.jsonl:line 1": 3,
    }
    tok = Tokenizer.from_folder(model_dir)
    for r in lines:
        assert 1 <= r["new_tokens"] <= limits[r["sample_id"]], r
        source = (
            PARQUET_ROWS[int(r["sample_id"][-1])]
            if r["sample_id"].startswith("ruler")
            else JSONL_ROWS[0]
        )
        text = tok.apply_chat_template(source["context"] + source["question"])
        assert r["prompt_tokens"] == len(tok.encode(text + source["answer_prefix"]))
    config = json.loads((out / "config.json").read_text())
    assert config["identity"]["suite"] == "kvpress"
    assert config["data"] == {
        "kvpress/niah_single_1": sha256_file(kvpress_dir / "ruler.parquet"),
        "kvpress/aime25": sha256_file(kvpress_dir / "aime25.jsonl"),
    }
    scores = json.loads((out / "scores.json").read_text())["datasets"]
    for dataset in ids:
        for cell in ("full", "snapkv/prefill/b16"):
            done = [r for r in lines if r["dataset"] == dataset and r["cell"] == cell]
            assert scores[dataset][cell] == suites.score_dataset(
                dataset, [r["pred"] for r in done], [r["answers"] for r in done]
            )

    write_jsonl(kvpress_dir / "zero_scrolls_gov.jsonl", JSONL_ROWS)
    proc = subprocess.run(
        [*args, "--out_dir", str(tmp_path / "x")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last.startswith("error: kvpress task 'zero_scrolls_gov' has no known metric;")
    assert "--metric NAME" in last
    assert not (tmp_path / "x").exists()


# --- LooGLE -----------------------------------------------------------------------------------

# bigai-nlco/LooGLE config/task2prompt.json at commit 6734382 (the QA entries), as published.
LOOGLE_TASK2PROMPT = json.loads(r"""{
    "shortdep_qa": "Please answer the question based on the long texts below. \n{input}\nQuestion: {Q}\nAnswer: ",
    "longdep_qa": "Please answer the question based on the long texts below. \n{input}\nQuestion: {Q}\nAnswer: "
}""")  # noqa: E501
LOOGLE_SHA256 = "af1d37d12b7f8056aea812af65e8ff1099beb377bc0693f5609688d75eee7c18"


def test_loogle_prompts_are_the_official_templates():
    assert dict(loogle.TASK2PROMPT) == LOOGLE_TASK2PROMPT
    assert dict(loogle.TASK2MAXLEN) == {"shortdep_qa": 300, "longdep_qa": 500}


def test_loogle_shared_rows(loogle_dir):
    path = loogle_dir / "shortdep_qa.jsonl"
    assert sha256_file(path) == LOOGLE_SHA256
    suite = suites.get("loogle")
    settings = RowSettings(data_dir=str(loogle_dir))
    assert suite.default_datasets(settings) == ["loogle_shortdep_qa"]
    assert suite.resolve(["shortdep_qa"]) == ["loogle_shortdep_qa"]
    found = suite.load(settings, None, None, ["loogle_shortdep_qa"], None)["loogle_shortdep_qa"]
    assert len(found) == 80  # the data README: 80 QA pairs over 5 documents
    per_doc: dict[str, int] = {}
    for row in found:
        per_doc[row["doc_id"]] = per_doc.get(row["doc_id"], 0) + 1
    assert per_doc == {"1": 11, "2": 12, "3": 16, "4": 25, "5": 16}
    assert len({r["_id"] for r in found}) == 80
    first = found[0]
    assert first["_id"] == "1.1" and first["title"] == "José Luis Picardo"
    assert first["answers"] == [
        "He was born in Jerez de la Frontera, in the Province of Cádiz "
        "in Andalucía, Spain. He later moved to Madrid with his family."
    ]
    document = json.loads(path.read_text(encoding="utf-8").splitlines()[0])["input"]
    assert protocol.build_prompt(first, "loogle_shortdep_qa") == (
        LOOGLE_TASK2PROMPT["shortdep_qa"].format(
            input=document, Q="Where was José Luis Picardo born and raised?"
        )
    )
    assert protocol.max_new_tokens("loogle_shortdep_qa") == 300
    assert protocol.answer_prefix("loogle_shortdep_qa", first) == ""
    assert suite.checksums(settings, ["loogle_shortdep_qa"]) == {
        "loogle_shortdep_qa": LOOGLE_SHA256
    }
    assert suites.row_score(
        "loogle_shortdep_qa", first["answers"][0], first["answers"], None
    ) == pytest.approx(1.0)


def test_loogle_bad_lines(tmp_path):
    good = {
        "input": "A document.",
        "title": "T",
        "qa_pairs": "[{'Q': 'q?', 'A': 'a', 'S': []}]",
        "output": "none",
    }
    for change, where in [
        ({"qa_pairs": "none"}, "field 'qa_pairs' is \"none\": the document has no question"),
        ({"qa_pairs": "[{'Q': 'q?'"}, "field 'qa_pairs' is not a Python literal"),
        ({"qa_pairs": "[{'Q': 'q?', 'A': ''}]"}, "field 'qa_pairs' pair 1 must be a dict"),
        ({"input": ""}, "field 'input' must be a non-empty string"),
        ({"extra": 1}, "field 'extra' is not in the LooGLE schema"),
    ]:
        path = write_jsonl(tmp_path / "shortdep_qa.jsonl", [good, {**good, **change}])
        with pytest.raises(rows.RowError) as e:
            loogle.read_rows(path)
        assert str(e.value).startswith(f"{path} line 2: {where}"), str(e.value)
    path = write_jsonl(
        tmp_path / "shortdep_qa.jsonl",
        [{**good, "qa_pairs": [{"Q": "q1?", "A": "a1"}, {"Q": "q2?", "A": "a2", "S": ["s"]}]}],
    )
    assert [(r["_id"], r["Q"], r["evidence"]) for r in loogle.read_rows(path)] == [
        ("1.1", "q1?", {}),
        ("1.2", "q2?", {"S": ["s"]}),
    ]


@pytest.mark.parametrize(
    "suite, metric, message",
    [
        (
            "ruler",
            "string_match_all",
            "error: --metric string_match_all: RULER tasks have fixed metrics; leave --metric out",
        ),
        ("kvpress", "nope", "error: --metric 'nope' is not a kvpress metric; known: "),
    ],
)
def test_metric_flag_is_checked_before_anything_loads(suite, metric, message, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.longbench",
            "--suite",
            suite,
            "--metric",
            metric,
            "--datasets",
            "vt",
            "--model",
            str(tmp_path / "no_model"),
        ],
        cwd=REPO,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith(message), proc.stderr[-2000:]
