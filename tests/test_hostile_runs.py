"""Hostile inputs to the runner's protocols and length defaults, `generate_for_contexts` and
`experiments.paired_folders` (issue #42): each case once gave a silent wrong result or failed
only after the run folder was claimed. Runs are in-process on the tiny random Llama
(`test_runner_faults.run_inprocess`), on kvpress rows written by the tests.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
from test_runner_faults import model_dir, run_inprocess  # noqa: F401 (fixtures)

from experiments import paired_folders, run_folder

CONTEXT = ("There is an important pass key hidden inside a lot of irrelevant text. "
           "The pass key is 98765. ") * 3


def write_rows(folder: pathlib.Path, task: str, rows: list[dict]) -> pathlib.Path:
    """kvpress rows (context, question, answer_prefix, answer, max_new_tokens) as
    `folder/task.jsonl`; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    full = [{"context": CONTEXT, "question": "What is the pass key?", "answer_prefix": "Answer:",
             "answer": "98765", "max_new_tokens": 4, **r} for r in rows]
    (folder / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full))
    return folder


def kvpress_args(model_dir, data_dir, out_dir, *extra: str) -> list[str]:  # noqa: F811
    return ["--model", str(model_dir), "--suite", "kvpress", "--data_dir", str(data_dir),
            "--rules", "full", "--timings", "prefill", "--budgets", "16", "--window", "4",
            "--out_dir", str(out_dir), *extra]


def lines(out_dir: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in (out_dir / "predictions.jsonl").read_text().splitlines()]


def test_shared_context_answers_each_question_to_its_own_length(
        model_dir, run_inprocess, tmp_path):  # noqa: F811
    """Rows asking for 2, 12 and 12 tokens of one context: each line is decoded to its own
    row's length (not the anchor's 2), and FullKV's answers are query_agnostic's."""
    data = write_rows(tmp_path / "data", "passkey", [
        {"question": f"Question {i}: what is the pass key?", "max_new_tokens": n}
        for i, n in enumerate((2, 12, 12))])
    got = {}
    for name in ("shared_context", "query_agnostic"):
        code, _, err = run_inprocess(*kvpress_args(model_dir, data, tmp_path / name,
                                                   "--protocol", name))
        assert code == 0, err
        got[name] = {r["sample_id"]: (r["new_tokens"], r["pred"]) for r in lines(tmp_path / name)}
    assert sorted(n for n, _ in got["shared_context"].values()) == [2, 12, 12]
    assert got["shared_context"] == got["query_agnostic"]


def test_generate_for_contexts_checks_the_model_context(tmp_path):
    from tiny_model import build_tiny_llama

    import dge_jax
    from dge_jax.generation import generate_for_contexts

    folder = build_tiny_llama(tmp_path / "tiny64")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    model = dge_jax.load(str(folder))
    context, question = list(range(3, 43)), [list(range(50, 70))]  # 40 and 20 tokens
    with pytest.raises(ValueError, match=r"context 0 \(40 tokens\), its question 0 \(20 tokens\) "
                                         r"and max_new_tokens=10 need 70 positions; the model's "
                                         r"context is 64"):
        generate_for_contexts(model, [context], [question], [None], max_new_tokens=10)
    (out,) = generate_for_contexts(model, [context], [question], [None], max_new_tokens=4)
    assert len(out[0].tokens[0]) <= 4
    with pytest.raises(ValueError, match=r"answer_lengths must hold one max_new_tokens per "
                                         r"question \(1\)"):
        generate_for_contexts(model, [context], [question], [None], answer_lengths=[2, 3])


def _refused_before_the_folder(run, args, out_dir, *needles):
    code, _, err = run(*args)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    assert not out_dir.exists()  # nothing claimed: the fixed command runs in that folder


@pytest.mark.parametrize("case", ["anchor", "max_length", "empty_question", "split_context",
                                  "huge_answer"])
def test_input_errors_come_before_the_folder_is_claimed(
        model_dir, run_inprocess, tmp_path, case):  # noqa: F811
    two = [{"question": "Q?"}, {"question": "What is the pass key hidden in the text above?"}]
    rows, extra, needles = {
        "anchor": (two, ["--protocol", "shared_context", "--anchor", "2"],
                   ["--anchor 2, but the context of row passkey.jsonl:line 1 has only 2 "
                    "question(s): pass an --anchor below 2"]),
        "max_length": ([{"max_new_tokens": 12}], ["--max_length", "4090"],
                       ["--max_length 4090 leaves 6 of the model's 4096 positions", "needs 27",
                        "lower --max_length to 4069 or less"]),
        "empty_question": ([{"question": ""}], ["--protocol", "query_agnostic"],
                           ["row passkey.jsonl:line 1: its question is empty",
                            "or use --protocol query_aware"]),
        "split_context": (two, ["--protocol", "shared_context", "--max_length", "80"],
                          ["--max_length 80 cuts the prompts of rows passkey.jsonl:line 1 and "
                           "passkey.jsonl:line 2 (one context) at different places",
                           "raise --max_length to"]),
        "huge_answer": ([{"max_new_tokens": 10**9}], [],
                        ["row passkey.jsonl:line 1 asks for 1000000000 new tokens",
                         "lower that row's max_new_tokens (below 4079)"]),
    }[case]
    data = write_rows(tmp_path / "data", "passkey", rows)
    out = tmp_path / "out"
    _refused_before_the_folder(run_inprocess, kvpress_args(model_dir, data, out, *extra), out,
                               *needles)


def test_one_long_answer_sets_the_max_length_and_the_run_says_so(
        model_dir, run_inprocess, tmp_path):  # noqa: F811
    """A task whose row asks for 3,950 tokens sets the default max length for every task: the
    run says which row, what the length would be without that task, and results.md how many
    prompts were cut."""
    data = write_rows(tmp_path / "data", "passkey", [{"context": CONTEXT * 8}])
    write_rows(data, "vt", [{"context": "short", "max_new_tokens": 3950}])
    out = tmp_path / "out"
    code, stdout, err = run_inprocess(*kvpress_args(model_dir, data, out))
    assert code == 0, err
    assert ("max length 131 tokens (the default: the model's 4096 positions less the 3965 that "
            "kvpress/vt row vt.jsonl:line 1 needs for its 3950 new tokens") in stdout
    assert ("without kvpress/vt it would be 4077: run that task apart, or pass --max_length"
            in stdout)
    results = (out / "results.md").read_text()
    assert ("- prompts: max length 131 tokens; 1 of 2 cut in the middle to the max length "
            "(kvpress/passkey 1 of 1)") in results


# --- paired_folders -----------------------------------------------------------------------------


def _folder(path: pathlib.Path, data_sha: str, answers: str = "98765",
            seed: int = 0) -> pathlib.Path:
    """A run folder written as the runner writes one: config.json by `open_run`, one line."""
    identity = {"model": "tiny", "suite": "synthetic", "max_length": 100, "seed": seed,
                "synthetic_length": 256}
    run_folder.open_run(path, identity, {"passkey": data_sha}, {"datasets": ["passkey"]}, "cmd")
    line = {"key": "k", "config_hash": "h", "run_id": run_folder.run_id(identity),
            "dataset": "passkey", "sample_id": "passkey-0", "cell": "full", "pred": "98765",
            "answers": [answers], "all_classes": None}
    (path / "predictions.jsonl").write_text(json.dumps(line) + "\n")
    return path


@pytest.mark.parametrize("other, message", [
    ({"data_sha": "b" * 64}, "passkey (sha256 aaaaaaaaaaaa vs bbbbbbbbbbbb)"),
    ({"seed": 1}, "seed 0 vs 1"),
    ({"answers": "12345"}, "passkey sample passkey-0 (answers ['98765']"),
])
def test_paired_folders_refuses_folders_of_other_data(tmp_path, capsys, other, message):
    first = _folder(tmp_path / "a", "a" * 64)
    second = _folder(tmp_path / "b", **{"data_sha": "a" * 64, **other})
    assert paired_folders.main([str(first), str(second)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "pairing them would be wrong" in err
    same = _folder(tmp_path / "c", "a" * 64)
    assert paired_folders.main([str(first), str(same)]) == 0
    shutil.rmtree(same)
