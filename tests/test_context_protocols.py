"""The runner's --protocol (`experiments.context_protocols`): the split of a rendered sample,
the synthetic shared-context task, one batch per context, and a shared_context run end to
end on the tiny model (question_index on every line, the identity, the report's breakdown).
"""

from __future__ import annotations

import json
import sys

import pytest
from test_runner import env, model_dir, read_rows, run_ok, run_refused  # noqa: F401

from experiments import context_protocols as cp
from experiments import protocol
from experiments.suites import ruler, synthetic


class _Words:
    """A whitespace tokenizer (lengths only)."""

    def encode(self, text):
        return list(range(len(text.split())))

    def decode(self, ids):
        return ""


@pytest.fixture(scope="module")
def shared_rows():
    return synthetic.make_suite(_Words(), ["multikey_shared"], 8, 300)["multikey_shared"]


def test_shared_task_rows_share_a_context_and_ask_each_key(shared_rows):
    first, second = shared_rows[:4], shared_rows[4:]
    assert len({r["context"] for r in first}) == 1 and len({r["context"] for r in second}) == 1
    assert first[0]["context"] != second[0]["context"]
    assert len({r["input"] for r in first}) == 4  # each row asks another key
    assert len({r["answers"][0] for r in first}) == 4
    assert all(r["answers"][0] in r["context"] for r in shared_rows)
    assert len({r["_id"] for r in shared_rows}) == 8


def test_the_question_is_what_follows_the_context(shared_rows):
    row = shared_rows[1]
    question = cp.question_text(row, "multikey_shared")
    assert question == "\n\n" + row["input"] + "\n"
    text = "<user>" + protocol.build_prompt(row, "multikey_shared") + "</user> The number is"
    context, rest = cp.split(text, question, "row 1")
    assert context + rest == text and context.endswith(row["context"])
    assert rest.startswith(question) and rest.endswith("The number is")
    ruler_row = {"input": "Memorize it.\nkey 1 is 5.\nWhat is key 1?"}
    assert ruler.SUITE.question(ruler_row, "niah_single_1") == "What is key 1?"
    with pytest.raises(ValueError, match="truncated away"):
        cp.split("a context only", question, "row 1")


def test_rows_are_grouped_by_their_context_in_row_order(shared_rows):
    """check_rows and shared_batches group by one rule: the raw prompt before the question."""
    assert cp.context_groups(shared_rows, "multikey_shared") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    mixed = [shared_rows[4], shared_rows[0], shared_rows[5], shared_rows[1]]
    assert cp.context_groups(mixed, "multikey_shared") == [[0, 2], [1, 3]]


def test_one_batch_per_context_with_every_row(shared_rows):
    pending = [(shared_rows[5], ("snapkv",))]  # only a later row of the second context
    (batch,) = cp.shared_batches("multikey_shared", shared_rows, pending)
    max_new, items = batch
    assert max_new == synthetic.max_new_tokens("multikey_shared")
    assert [r["_id"] for r, _ in items] == [r["_id"] for r in shared_rows[4:]]
    assert [m for _, m in items] == [(), ("snapkv",), (), ()]  # the anchor is run, not written


def test_a_shared_context_run_end_to_end(model_dir, env, tmp_path):  # noqa: F811
    out = tmp_path / "shared"
    run_ok([sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
            "--suite", "synthetic", "--datasets", "multikey_shared", "--num_samples", "4",
            "--synthetic_length", "256", "--rules", "full,snapkv", "--timings", "prefill,dge",
            "--budgets", "16", "--window", "4", "--protocol", "shared_context",
            "--out_dir", str(out)], env)  # fmt: skip
    rows = read_rows(out)
    assert len(rows) == 4 * 3
    for cell in ("full", "snapkv/prefill/b16", "snapkv/dge/k2/b16"):
        assert sorted(r["question_index"] for r in rows if r["cell"] == cell) == [0, 1, 2, 3]
    identity = json.loads((out / "config.json").read_text())["identity"]
    assert identity["context_protocol"] == "shared_context"
    text = (out / "results.md").read_text()
    assert "Shared contexts, the anchor question" in text and "the later questions" in text


def test_ruler_shared_rows_ask_one_key_each():
    multiquery = [{
        "_id": "7", "all_classes": None, "length": 99, "answers": ["111", "222"],
        "input": "Some special magic numbers are hidden.\nOne of the special magic numbers for "
                 "amber-fox is: 111.\nWhat are all the special magic numbers for amber-fox, "
                 "and icy-owl mentioned in the provided text?",
        "answer_prefix": " The special magic numbers for amber-fox, and icy-owl mentioned in "
                         "the provided text are",
    }]  # fmt: skip
    first, second = ruler.one_key_each(multiquery)
    assert [first["_id"], second["_id"]] == ["7.0", "7.1"]
    assert first["answers"] == ["111"] and second["answers"] == ["222"]
    assert second["input"].endswith(
        "\nWhat is the special magic number for icy-owl mentioned in the provided text?")
    assert second["answer_prefix"] == (
        " The special magic number for icy-owl mentioned in the provided text is")
    head = multiquery[0]["input"].rsplit("\n", 1)[0]
    assert first["input"].startswith(head) and second["input"].startswith(head)
    dataset = "ruler_niah_multiquery_shared"
    (batch,) = cp.shared_batches(dataset, [first, second], [(second, ("full",))])
    assert [r["_id"] for r, _ in batch[1]] == ["7.0", "7.1"]  # one context: both rows
    with pytest.raises(Exception, match="no multiquery question"):
        ruler.one_key_each([{**multiquery[0], "input": "What is it?"}])


def test_loogle_questions_follow_their_document():
    row = {"input": "The long document.", "Q": "Who wrote it?"}
    dataset = "loogle_shortdep_qa"
    question = cp.question_text(row, dataset)
    assert question == "\nQuestion: Who wrote it?\nAnswer: "
    assert protocol.build_prompt(row, dataset).endswith("The long document." + question)


def test_two_protocols_paired_on_their_samples(model_dir, env, tmp_path, capsys):  # noqa: F811
    from experiments import paired_folders

    folders = {}
    for name in ("query_agnostic", "query_aware"):
        folders[name] = tmp_path / name
        run_ok([sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
                "--suite", "synthetic", "--datasets", "passkey", "--num_samples", "1",
                "--synthetic_length", "256", "--rules", "full,snapkv", "--timings", "prefill,dge",
                "--budgets", "16", "--window", "4", "--protocol", name,
                "--out_dir", str(folders[name])], env)  # fmt: skip
    entries = paired_folders.compare(folders["query_agnostic"], folders["query_aware"])
    assert [e["cell"] for e in entries] == ["full", "snapkv/prefill/b16", "snapkv/dge/k2/b16"]
    assert all(e["samples"] == 1 and e["p_holm"] >= e["p"] for e in entries)
    full = entries[0]  # FullKV sees the whole prompt under both protocols
    assert full["accuracy"] == full["other_accuracy"] and full["wins"] == full["losses"] == 0
    assert full["same_answer"] == 1  # one prompt, the same tokens under both protocols
    assert full["score"] == full["other_score"] and full["higher"] == full["lower"] == 0
    assert all(e["sign_p_holm"] >= e["sign_p"] for e in entries)
    assert paired_folders.main([str(folders["query_agnostic"]), str(folders["query_aware"])]) == 0
    out = capsys.readouterr().out
    assert "context_protocol: 'query_agnostic' vs None" in out
    assert "| snapkv/dge/k2/b16 | 1 |" in out
    assert paired_folders.main([str(tmp_path), str(folders["query_aware"])]) == 2


def test_anchoring_counts_only_what_fullkv_answers():
    from experiments import anchoring
    from experiments.stats import fisher_exact

    assert fisher_exact(1, 9, 11, 3) == pytest.approx(0.0027594, abs=1e-6)  # scipy's value
    assert fisher_exact(3, 3, 3, 3) == pytest.approx(1.0)

    def line(cell, sample, q, right):
        return {"dataset": "passkey", "cell": cell, "sample_id": sample, "question_index": q,
                "pred": "12345" if right else "no", "answers": ["12345"], "all_classes": None}

    lines = []
    for context in range(4):
        for q in range(3):
            sample = f"{context}.{q}"
            lines.append(line("full", sample, q, right=q != 2))  # FullKV misses question 2
            lines.append(line("dge", sample, q, right=q == 0 or (q == 1 and context == 0)))
    (entry,) = anchoring.anchoring(lines)
    assert entry["cell"] == "dge" and entry["anchor"] == (4, 4) and entry["later"] == (1, 4)
    assert entry["p"] == pytest.approx(fisher_exact(4, 0, 1, 3))
    with pytest.raises(ValueError, match="FullKV cell"):
        anchoring.anchoring([r for r in lines if r["cell"] != "full"])


def test_a_chosen_anchor_comes_first(shared_rows, model_dir, env):  # noqa: F811
    pending = [(r, ("full",)) for r in shared_rows]
    first, _ = cp.shared_batches("multikey_shared", shared_rows, pending, anchor=2)
    ids = [r["_id"] for r, _ in first[1]]
    assert ids == [shared_rows[i]["_id"] for i in (2, 0, 1, 3)]
    with pytest.raises(ValueError, match="--anchor 4, but a context has only 4 questions"):
        cp.shared_batches("multikey_shared", shared_rows, pending, anchor=4)
    run_refused([sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
                 "--anchor", "1"], env, "--anchor 1", "--protocol shared_context")
