"""LongBench v1 prediction protocol: verbatim tables, prompts of real rows, truncation, chat.

Real rows are read from ../shared/data/longbench beside the checkout (or DGE_LONGBENCH_DIR);
tests that need them skip without them, and fail under CI (tests/conftest.py, shared_data_dir).
"""

import hashlib
import json

import pytest

from experiments import protocol
from experiments.suites import longbench_config as config

# The seven datasets of the shared data folder and their first rows' prompts, with the template
# written out by hand from THUDM/LongBench config/dataset2prompt.json.
HAND_PROMPTS = {
    "hotpotqa": lambda r: (
        "Answer the question based on the given passages. Only give me the answer and do not "
        "output any other words.\n\nThe following are given passages.\n" + r["context"]
        + "\n\nAnswer the question based on the given passages. Only give me the answer and do "
        "not output any other words.\n\nQuestion: " + r["input"] + "\nAnswer:"
    ),
    "multi_news": lambda r: (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n"
        + r["context"] + "\n\nNow, write a one-page summary of all the news.\n\nSummary:"
    ),
    "trec": lambda r: (
        "Please determine the type of the question below. Here are some examples of questions."
        "\n\n" + r["context"] + "\n" + r["input"]
    ),
    "samsum": lambda r: (
        "Summarize the dialogue into a few short sentences. The following are some examples."
        "\n\n" + r["context"] + "\n\n" + r["input"]
    ),
    "passage_count": lambda r: (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. "
        "Please carefully read these paragraphs and determine how many unique paragraphs there "
        "are after removing duplicates. In other words, how many non-repeating paragraphs are "
        "there in total?\n\n" + r["context"] + "\n\nPlease enter the final count of unique "
        "paragraphs after removing duplicates. The output format should only contain the "
        "number, such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": lambda r: (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
        "paragraph the abstract is from.\n\n" + r["context"] + "\n\nThe following is an "
        "abstract.\n\n" + r["input"] + "\n\nPlease enter the number of the paragraph that the "
        'abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.'
        "\n\nThe answer is: "
    ),
    "lcc": lambda r: (
        "Please complete the code given below. \n" + r["context"] + "Next line of code:\n"
    ),
}


class CharTokenizer:
    """One id per character; decode(a) + decode(b) == decode(a + b)."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class WordTokenizer:
    """One id per whitespace word; decode joins words with single spaces (lossy on purpose)."""

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text):
        ids = []
        for word in text.split():
            if word not in self.vocab:
                self.vocab[word] = len(self.words)
                self.words.append(word)
            ids.append(self.vocab[word])
        return ids

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids)


class BosTokenizer(CharTokenizer):
    """Adds a BOS id (0) in front of every encoding, as Llama tokenizers do."""

    def encode(self, text):
        return [0] + super().encode(text)


def chat(prompt: str) -> str:
    return f"[INST]{prompt}[/INST]"


# --- verbatim tables ---------------------------------------------------------------------------


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_tables_are_verbatim_copies_of_the_official_json():
    # git blob ids of LongBench/config/*.json at THUDM/LongBench commit 2e00731; the official
    # files are json.dumps(indent=4, ensure_ascii=False) output without a trailing newline.
    prompts = json.dumps(dict(config.DATASET2PROMPT), indent=4, ensure_ascii=False).encode()
    maxlen = json.dumps(dict(config.DATASET2MAXLEN), indent=4, ensure_ascii=False).encode()
    assert _git_blob_sha1(prompts) == "1c85f6bc0f0df4e42131aa49a867797ee7043ecf"
    assert _git_blob_sha1(maxlen) == "79d0d9990e5799c845ebcf839c1ee1a4ff14873e"


def test_task_lists():
    assert len(config.ALL_TASKS) == 21
    assert len(config.ENGLISH_TASKS) == 16
    in_categories = [t for tasks in config.CATEGORIES_EN.values() for t in tasks]
    assert sorted(in_categories) == sorted(config.ENGLISH_TASKS)
    assert config.NO_CHAT_TEMPLATE == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    assert config.FIRST_LINE_TASKS == {"trec", "triviaqa", "samsum", "lsht"}
    assert not set(config.CHINESE_TASKS) & set(config.ENGLISH_TASKS)
    assert set(config.CHINESE_TASKS) | set(config.ENGLISH_TASKS) == set(config.ALL_TASKS)


# --- prompts of real rows ----------------------------------------------------------------------


@pytest.mark.parametrize("dataset", sorted(HAND_PROMPTS))
def test_prompt_of_a_real_row(data_dir, dataset):
    row = protocol.load_rows(data_dir, dataset, num_samples=1)[0]
    assert row["dataset"] == dataset
    assert protocol.build_prompt(row, dataset) == HAND_PROMPTS[dataset](row)


def test_load_rows(data_dir):
    rows = protocol.load_rows(data_dir, "trec")
    assert len(rows) == 8
    assert protocol.load_rows(data_dir, "trec", num_samples=3) == rows[:3]
    assert set(rows[0]) == set(protocol.ROW_KEYS)


def test_load_rows_errors_name_the_variable(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"narrativeqa\.jsonl.*DGE_LONGBENCH_DIR"):
        protocol.load_rows(tmp_path, "narrativeqa")
    monkeypatch.delenv(protocol.DATA_DIR_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match="DGE_LONGBENCH_DIR"):
        protocol.load_rows(None, "trec")
    with pytest.raises(FileNotFoundError, match="DGE_LONGBENCH_DIR"):
        protocol.load_rows(tmp_path / "absent", "trec")


def test_load_rows_reads_the_variable(data_dir, monkeypatch):
    monkeypatch.setenv(protocol.DATA_DIR_ENV, str(data_dir))
    assert len(protocol.load_rows(None, "lcc", num_samples=2)) == 2


def test_unknown_dataset():
    with pytest.raises(ValueError, match="unknown dataset"):
        protocol.build_prompt({"context": "", "input": ""}, "hotpot")
    with pytest.raises(ValueError, match="unknown dataset"):
        protocol.max_new_tokens("hotpot")


# --- truncation --------------------------------------------------------------------------------


def test_truncate_middle():
    ids = list(range(10))
    assert protocol.truncate_middle(ids, 10) == ids  # fits: unchanged
    assert protocol.truncate_middle(ids, 4) == [0, 1, 8, 9]  # half = 2 each side
    assert protocol.truncate_middle(ids, 5) == [0, 1, 8, 9]  # odd: half = 2, one id fewer
    with pytest.raises(ValueError):
        protocol.truncate_middle(ids, 1)  # pred.py's half = 0 would keep everything


def test_truncate_prompt_decodes_each_half_separately():
    text, n, cut = protocol.truncate_prompt("abcdefghij", CharTokenizer(), 4)
    assert (text, n, cut) == ("abij", 10, True)
    # decode(head) + decode(tail), as pred.py: the seam loses the separator a joint decode keeps
    tok = WordTokenizer()
    text, n, cut = protocol.truncate_prompt("w1 w2 w3 w4 w5 w6", tok, 4)
    assert (text, n, cut) == ("w1 w2w5 w6", 6, True)
    assert protocol.truncate_prompt("short", CharTokenizer(), 100) == ("short", 5, False)


def test_prepare_sample_truncates_before_the_chat_template():
    row = {"context": "x" * 1000, "input": "Who?"}
    prompt = protocol.build_prompt(row, "hotpotqa")
    sample = protocol.prepare_sample(row, "hotpotqa", CharTokenizer(), 100, chat)
    # the raw prompt is cut to 50 + 50 characters, then wrapped whole
    assert sample.text == "[INST]" + prompt[:50] + prompt[-50:] + "[/INST]"
    assert sample.num_prompt_tokens == len(prompt)
    assert sample.truncated


def test_prepare_sample_counts_bos_like_pred_py():
    # With a BOS, the first half keeps BOS + 49 characters; decode (no special tokens here)
    # turns the BOS id 0 into "\x00", so the caller's decode must skip special tokens.
    row = {"context": "y" * 500, "input": "?"}
    prompt = protocol.build_prompt(row, "lcc")
    sample = protocol.prepare_sample(row, "lcc", BosTokenizer(), 100, chat)
    assert sample.text == "\x00" + prompt[:49] + prompt[-50:]
    assert sample.num_prompt_tokens == len(prompt) + 1


@pytest.mark.parametrize("dataset", config.ALL_TASKS)
def test_chat_template_exceptions(dataset):
    row = {"context": "ctx", "input": "q"}
    sample = protocol.prepare_sample(row, dataset, CharTokenizer(), 10_000, chat)
    prompt = protocol.build_prompt(row, dataset)
    if dataset in {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}:
        assert sample.text == prompt
    else:
        assert sample.text == chat(prompt)
    assert not sample.truncated


def test_synthetic_rows_get_chat_then_answer_prefix():
    row = {"context": "hay. The pass key is 12345. Remember it. hay.", "input": "Pass key?"}
    sample = protocol.prepare_sample(row, "passkey", CharTokenizer(), 10_000, chat)
    assert sample.text == chat(protocol.build_prompt(row, "passkey")) + "The pass key is"
    assert protocol.max_new_tokens("passkey") == 16
    bare = protocol.prepare_sample(row, "passkey", CharTokenizer(), 10_000, chat,
                                   with_answer_prefix=False)
    assert bare.text == chat(protocol.build_prompt(row, "passkey"))


def test_max_new_tokens_official():
    assert protocol.max_new_tokens("hotpotqa") == 32
    assert protocol.max_new_tokens("multi_news") == 512
    assert protocol.max_new_tokens("samsum") == 128
    assert protocol.max_new_tokens("lcc") == 64


# --- stop rule ---------------------------------------------------------------------------------


def test_samsum_stops_at_newline_token():
    rule = protocol.stop_rule("samsum")
    assert rule.stop_strings == ("\n",)
    assert rule.min_new_tokens == 1  # pred.py: min_length = context_length + 1
    # the last id of encode("\n"), past a BOS
    assert rule.extra_eos_ids(BosTokenizer()) == (ord("\n"),)
    assert rule.extra_eos_ids(CharTokenizer()) == (10,)


@pytest.mark.parametrize("dataset", ["hotpotqa", "trec", "multi_news", "lcc", "passkey"])
def test_other_tasks_have_no_extra_stop(dataset):
    rule = protocol.stop_rule(dataset)
    assert rule.stop_strings == () and rule.min_new_tokens == 0
    assert rule.extra_eos_ids(CharTokenizer()) == ()
