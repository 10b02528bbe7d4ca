"""The RULER suite (`experiments.suites.ruler`): RULER's templates and task table, seeded rows,
token lengths with a real tokenizer, the shared niah_multikey_3 rows, RULER's metric, and the
runner's loader path and command line.

Lengths are measured with the embedded SmolLM2 tokenizer (converted once into the dge_jax
cache, no network). The shared RULER rows are read from ../shared/data/ruler beside the checkout
(or the folder DGE_RULER_DIR names); tests that need them skip without it, and fail under CI.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import pytest
from conftest import shared_data_dir

from experiments import protocol, rows, suites
from experiments.predictions import PREDICTIONS_FILE, config_hash
from experiments.run_folder import sha256_file
from experiments.suites import longbench_config, ruler, ruler_tasks, synthetic

REPO = pathlib.Path(__file__).resolve().parents[1]
LENGTH = 4096
NUM_ROWS = 3
SHARED_FILE = "niah_multikey_3_4096.jsonl"
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"

# NVIDIA/RULER scripts/data/synthetic/constants.py (commit c3f5e3b), quoted as published.
RULER_CONSTANTS = {
    'niah': {
        'tokens_to_generate': 128,
        'template': """Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?""",  # noqa: E501
        'answer_prefix': """ The special magic {type_needle_v} for {query} mentioned in the provided text are"""  # noqa: E501
    },
    'variable_tracking': {
        'tokens_to_generate': 30,
        'template': """Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.""",  # noqa: E501
        'answer_prefix': """ Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, they are: """  # noqa: E501
    },
    'common_words_extraction': {
        'tokens_to_generate': 120,
        'template': """Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?""",  # noqa: E501
        'answer_prefix': """ Answer: The top 10 words that appear most often in the list are:"""
    },
    'freq_words_extraction' : {
        'tokens_to_generate': 50,
        'template': """Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?""",  # noqa: E501
        'answer_prefix': """ Answer: According to the coded text above, the three most frequently appeared words are:"""  # noqa: E501
    },
}

# NVIDIA/RULER scripts/synthetic.yaml (qa_1 / qa_2 aside): task -> (generator, args).
RULER_YAML = {
    "niah_single_1": ("niah", dict(type_haystack="noise", type_needle_k="words",
                                   type_needle_v="numbers", num_needle_k=1, num_needle_v=1,
                                   num_needle_q=1)),
    "niah_single_2": ("niah", dict(type_haystack="essay", type_needle_k="words",
                                   type_needle_v="numbers", num_needle_k=1, num_needle_v=1,
                                   num_needle_q=1)),
    "niah_single_3": ("niah", dict(type_haystack="essay", type_needle_k="words",
                                   type_needle_v="uuids", num_needle_k=1, num_needle_v=1,
                                   num_needle_q=1)),
    "niah_multikey_1": ("niah", dict(type_haystack="essay", type_needle_k="words",
                                     type_needle_v="numbers", num_needle_k=4, num_needle_v=1,
                                     num_needle_q=1)),
    "niah_multikey_2": ("niah", dict(type_haystack="needle", type_needle_k="words",
                                     type_needle_v="numbers", num_needle_k=1, num_needle_v=1,
                                     num_needle_q=1)),
    "niah_multikey_3": ("niah", dict(type_haystack="needle", type_needle_k="uuids",
                                     type_needle_v="uuids", num_needle_k=1, num_needle_v=1,
                                     num_needle_q=1)),
    "niah_multivalue": ("niah", dict(type_haystack="essay", type_needle_k="words",
                                     type_needle_v="numbers", num_needle_k=1, num_needle_v=4,
                                     num_needle_q=1)),
    "niah_multiquery": ("niah", dict(type_haystack="essay", type_needle_k="words",
                                     type_needle_v="numbers", num_needle_k=1, num_needle_v=1,
                                     num_needle_q=4)),
    "vt": ("variable_tracking", dict(type_haystack="noise", num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0)),
}
# Generator arguments the yaml leaves at their argparse defaults.
ARGPARSE_DEFAULTS = {"cwe": {"num_fewshot": 1}, "fwe": {"coded_wordlen": 6, "vocab_size": -1}}


def ruler_string_match_all(preds, refs):
    """scripts/eval/synthetic/constants.py's metric, as published (the reference)."""
    score = sum([sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref)
                 for pred, ref in zip(preds, refs, strict=True)]) / len(preds) * 100
    return round(score, 2)


@pytest.fixture(scope="module")
def tok():
    from dge_jax.checkpoints.embedded import resolve_model_dir
    from dge_jax.checkpoints.tokenizer import Tokenizer

    return Tokenizer.from_folder(resolve_model_dir("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def suite(tok):
    """NUM_ROWS generated rows of every task at LENGTH tokens, seed 0 (RULER's schema)."""
    cache: dict = {}
    return {d: ruler.make_rows(d, tok, tok.apply_chat_template, NUM_ROWS, LENGTH, 0, cache)
            for d in ruler.TASKS}


@pytest.fixture(scope="module")
def ruler_dir() -> pathlib.Path:
    path = shared_data_dir(ruler.DATA_DIR_ENV)
    if not (path / SHARED_FILE).is_file():
        pytest.fail(f"{ruler.DATA_DIR_ENV}={path} holds no {SHARED_FILE}")
    return path


@pytest.fixture(scope="module")
def shared_rows(ruler_dir) -> list[dict]:
    return ruler.read_rows(ruler_dir / SHARED_FILE)


# ---------------------------------------------------------------------------------------------
# RULER's definitions


def test_templates_prefixes_and_lengths_are_rulers():
    assert set(ruler.KINDS) == set(RULER_CONSTANTS)
    for kind, published in RULER_CONSTANTS.items():
        ours = ruler.KINDS[kind]
        assert ours.template == published["template"]
        assert ours.answer_prefix == published["answer_prefix"]
        assert ours.tokens_to_generate == published["tokens_to_generate"]
        assert ours.metric == "string_match_all"  # eval constants: every synthetic kind
    assert ruler.NOISE == ("The grass is green. The sky is blue. The sun is yellow. Here we "
                           "go. There and back again.")
    assert ruler.NEEDLE == "One of the special magic {type_needle_v} for {key} is: {value}."
    assert ruler.DEPTHS[:6] == (0, 3, 5, 8, 10, 13) and len(ruler.DEPTHS) == 40
    assert ruler.DEPTHS[-1] == 100


def test_task_table_is_synthetic_yaml():
    official = {d: t for d, t in ruler.TASKS.items() if d not in ruler.SHARED}  # + ours
    assert [t.name for t in official.values()] == list(RULER_YAML)
    assert list(ruler.SHARED) == ["ruler_niah_multiquery_shared"]
    shared = ruler.TASKS["ruler_niah_multiquery_shared"]  # niah_multiquery's generator
    assert (shared.kind, dict(shared.args)) == (ruler.TASKS["ruler_niah_multiquery"].kind,
                                                dict(ruler.TASKS["ruler_niah_multiquery"].args))
    for dataset, task in official.items():
        kind, args = RULER_YAML[task.name]
        assert dataset == "ruler_" + task.name
        assert task.kind == kind
        assert dict(task.args) == {**args, **ARGPARSE_DEFAULTS.get(task.name, {})}


def test_names_and_the_synthetic_clash():
    assert ruler.dataset_name("vt") == ruler.dataset_name("ruler_vt") == "ruler_vt"
    with pytest.raises(ValueError, match="unknown RULER task 'qa_1'"):
        ruler.dataset_name("qa_1")
    # RULER's niah_multivalue is also a synthetic task: ours is prefixed and scored by RULER.
    assert "niah_multivalue" in synthetic.TASKS and "niah_multivalue" not in ruler.TASKS
    assert not set(ruler.TASKS) & (set(synthetic.TASKS) | set(longbench_config.ALL_TASKS))
    # substring match (RULER) vs whole-word match (synthetic) on the same answer
    assert suites.row_score("ruler_niah_multivalue", "12345678", ["1234567"], None) == 1.0
    assert suites.row_score("niah_multivalue", "12345678", ["1234567"], None) == 0.0


def test_protocol_of_ruler_tasks():
    for dataset, task in ruler.TASKS.items():
        assert protocol.max_new_tokens(dataset) == RULER_CONSTANTS[task.kind][
            "tokens_to_generate"]
        assert protocol.stop_rule(dataset) == protocol.StopRule()  # RULER: no stop words
        assert protocol.uses_chat_template(dataset)
        assert protocol.row_schema(dataset) is rows.RULER_SCHEMA
    with pytest.raises(ValueError, match="belongs to a row"):
        protocol.answer_prefix("ruler_vt")


def test_word_lists_are_wonderwords_2_2_0():
    words = ruler.AdjNounWords.load()
    assert len(words) == 910 * 6786 == 6_175_260  # RULER's len(sorted(set(adj-noun)))
    assert words.distinct()
    assert words[0] == f"{words.adjectives[0]}-{words.nouns[0]}"
    vocabulary = [w for name in ("nounlist.txt", "adjectivelist.txt", "verblist.txt")
                  for w in ruler_tasks.word_list(name)]
    assert len(set(vocabulary)) == 8169  # cwe's vocabulary


def test_other_wonderwords_is_refused(monkeypatch):
    monkeypatch.setattr(ruler_tasks, "WONDERWORDS_SHA256", {**ruler_tasks.WONDERWORDS_SHA256,
                                                            "nounlist.txt": "0" * 64})
    with pytest.raises(FileNotFoundError, match=r"pip install wonderwords==2\.2\.0"):
        ruler_tasks.word_list("nounlist.txt")
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install wonderwords==2\.2\.0"):
        ruler_tasks._wonderwords_dir()


def test_essay_haystack_is_rulers_concatenation():
    words = ruler.essay_words()
    # RULER concatenates the 49 essay files without a separator, collapses whitespace and
    # splits on " ": 111,877 words, starting with the first essay's fused header.
    assert len(words) == 111_877
    assert words[:4] == ("July", "2010What", "hard", "liquor,")
    assert all(w and " " not in w for w in words)


# ---------------------------------------------------------------------------------------------
# Generated rows


def test_rows_have_rulers_schema(suite):
    for dataset, generated in suite.items():
        assert [r["index"] for r in generated] == list(range(NUM_ROWS))
        for r in generated:
            assert set(r) == {"index", "input", "outputs", "length", "answer_prefix"}
            assert r["input"] and r["outputs"] and all(isinstance(o, str) for o in r["outputs"])
            assert r["answer_prefix"].startswith(ruler.TASKS[dataset].answer_prefix[:10])
            for answer in r["outputs"]:
                assert answer in r["input"]
        rows.check_rows(((str(i), r) for i, r in enumerate(generated)), rows.RULER_SCHEMA,
                        dataset, "x")


def test_answers_per_task(suite):
    counts = {"ruler_niah_multivalue": 4, "ruler_niah_multiquery": 4, "ruler_vt": 5,
              "ruler_cwe": 10, "ruler_fwe": 3,
              "ruler_niah_multiquery_shared": 4}  # generated rows, before one_key_each
    for dataset, generated in suite.items():
        for r in generated:
            assert len(r["outputs"]) == counts.get(dataset, 1)
    for r in suite["ruler_niah_single_1"]:
        assert re.fullmatch(r"\d{7}", r["outputs"][0])
        assert r["input"].startswith("A special magic number is hidden within the following "
                                     "text. Make sure to memorize it. I will quiz you about "
                                     "the number afterwards.\n")
        assert r["input"].count(ruler.NOISE) > 50
    for r in suite["ruler_niah_multiquery"]:
        assert ", and " in r["answer_prefix"] and r["answer_prefix"].endswith(" are")
    for r in suite["ruler_vt"]:  # the in-context example (3-letter names) comes first
        assert r["input"].startswith("Memorize and track the chain(s)")
        assert r["input"].count("Memorize and track the chain(s)") == 2
        assert r["answer_prefix"].startswith(" Answer: According to the chain(s) of variable "
                                             "assignment in the text above, 5 variables are "
                                             "assigned the value ")
        value = re.search(r"the value (\d{5}), they are: $", r["answer_prefix"]).group(1)
        assert f"VAR {r['outputs'][0]} = {value}" in r["input"]
    for r in suite["ruler_cwe"]:
        listed = re.findall(r"\d+\. (\S+)", r["input"].rsplit("\nBelow is a numbered", 1)[-1])
        top = sorted(set(listed), key=listed.count, reverse=True)[:10]
        assert sorted(top) == sorted(r["outputs"])
    for r in suite["ruler_fwe"]:
        coded = r["input"].split("coded words. ", 1)[1].split("\nQuestion:", 1)[0].split()
        top = sorted(set(coded) - {"..."}, key=coded.count, reverse=True)[:3]
        assert top == r["outputs"]


def test_deterministic_per_seed_and_index(tok, suite):
    chat = tok.apply_chat_template
    for dataset in ("ruler_niah_single_1", "ruler_vt", "ruler_fwe", "ruler_niah_multikey_3"):
        assert ruler.make_rows(dataset, tok, chat, NUM_ROWS, LENGTH, 0) == suite[dataset]
        assert ruler.make_rows(dataset, tok, chat, 1, LENGTH, 0) == suite[dataset][:1]
        other = ruler.make_rows(dataset, tok, chat, NUM_ROWS, LENGTH, 1)
        assert [r["outputs"] for r in other] != [r["outputs"] for r in suite[dataset]]
    # Goldens: a change here changes the rows: bump ruler.GENERATOR with it.
    assert suite["ruler_niah_single_1"][0]["outputs"] == ["3043277"]
    assert suite["ruler_fwe"][0]["outputs"] == ["plgtzj", "olovqo", "sthhsd"]
    assert suite["ruler_vt"][0]["outputs"] == ["PISVO", "GLIZV", "TTKRR", "BIBIX", "SKEUL"]


def test_lengths_fit_the_target_with_the_chat_template(tok, suite):
    """RULER's rule: tokens(model template + input + answer prefix) + tokens_to_generate <=
    max_seq_length, the haystack as large as that allows. The search finds the largest size
    at which one random draw fits; a row drawn too long there drops one step (500 essay
    words, 25 noise or needle lines, 10 vt lines, 10 cwe words; fwe shrinks by length / 32
    words), so rows fall short by up to a step: at 4K, under a fifth of the length."""
    chat = tok.apply_chat_template
    for dataset, generated in suite.items():
        ttg = ruler.TASKS[dataset].max_new_tokens
        for r in generated:
            view = ruler.runner_rows(dataset, [r], "test")[0]
            sample = protocol.prepare_sample(view, dataset, tok, 10**6, chat)
            assert sample.text == chat(r["input"]) + r["answer_prefix"]
            assert len(tok.encode(sample.text)) + ttg == r["length"]
            assert 0.8 * LENGTH <= r["length"] <= LENGTH, (dataset, r["length"])


@pytest.mark.parametrize("length", [8192, 16384])
def test_longer_targets(tok, length):
    for dataset in ("ruler_niah_single_1", "ruler_niah_single_2", "ruler_niah_multikey_3",
                    "ruler_vt", "ruler_cwe"):
        generated = ruler.make_rows(dataset, tok, tok.apply_chat_template, 2, length, 0)
        # one step is at most about 1,600 tokens (25 uuid lines) whatever the length
        assert all(length - 2000 <= r["length"] <= length for r in generated), (
            dataset, [r["length"] for r in generated])


def test_cwe_past_the_word_lists_is_an_error(tok):
    few = {"cwe_words_0": [f"w{i}" for i in range(100)]}  # stands for wonderwords' 8,169
    with pytest.raises(ValueError, match="english_words.json"):
        ruler.make_rows("cwe", tok, tok.apply_chat_template, 1, LENGTH, 0, few)


def test_too_short_a_target_is_an_error(tok):
    with pytest.raises(ValueError, match="ask for a longer --ruler_length"):
        ruler.make_rows("niah_single_1", tok, tok.apply_chat_template, 1, 200, 0)


# ---------------------------------------------------------------------------------------------
# The shared rows (KVCache-Factory's RULER niah_multikey_3 at 4K)

HEADER = ("A special magic uuid is hidden within the following text. Make sure to memorize "
          "it. I will quiz you about the uuid afterwards.\n")


def multikey_3_structure(view: dict) -> int:
    """Checks a runner row of niah_multikey_3 against RULER's layout; returns its lines."""
    text = view["input"]
    assert text.startswith(HEADER)
    body, question = text[len(HEADER):].rsplit("\n", 1)
    key = re.fullmatch(f"What is the special magic uuid for ({UUID}) mentioned in the "
                       r"provided text\?", question).group(1)
    assert view["answer_prefix"] == (f" The special magic uuid for {key} mentioned in the "
                                     "provided text is")
    pairs = [re.fullmatch(f"One of the special magic uuids for ({UUID}) is: ({UUID})\\.",
                          line).groups() for line in body.split("\n")]
    assert [v for k, v in pairs if k == key] == view["answers"]  # one needle, one answer
    assert len(view["answers"]) == 1
    return len(pairs)


def test_generated_multikey_3_matches_the_shared_rows(suite, shared_rows):
    generated = suite["ruler_niah_multikey_3"]
    for real, ours in zip(shared_rows, generated, strict=False):
        assert set(real) <= set(ours)  # ours add RULER's current answer_prefix field
        assert {k: type(v) for k, v in real.items()} == \
            {k: type(ours[k]) for k in real}
    views = {"shared": ruler.runner_rows("niah_multikey_3", shared_rows, "shared"),
             "generated": ruler.runner_rows("niah_multikey_3", generated, "generated")}
    lines = {name: [multikey_3_structure(v) for v in vs] for name, vs in views.items()}
    assert len(lines["shared"]) == 500 and set(lines["shared"]) == {51}
    # 4096 tokens of SmolLM2 hold fewer uuid lines than of the shared file's tokenizer
    assert all(30 < n < 51 for n in lines["generated"])


def test_metric_on_shared_rows(shared_rows):
    views = ruler.runner_rows("niah_multikey_3", shared_rows[:50], "shared")
    dataset = "ruler_niah_multikey_3"
    for view in views:
        (answer,) = view["answers"]
        other = next(u for u in re.findall(UUID, view["input"]) if u != answer)
        assert suites.row_score(dataset, f" {answer}.", view["answers"], None) == 1.0
        assert suites.row_score(dataset, answer.upper(), view["answers"], None) == 1.0
        assert suites.row_score(dataset, f" {other}.", view["answers"], None) == 0.0
        assert suites.row_score(dataset, "", view["answers"], None) == 0.0
    preds = [f"is {v['answers'][0]}" if i % 3 else "no idea" for i, v in enumerate(views)]
    refs = [v["answers"] for v in views]
    assert suites.score_dataset(dataset, preds, refs) == ruler_string_match_all(preds, refs)


def test_string_match_all_is_rulers():
    cases = [("The numbers are 1, 22 and 333", ["1", "22", "333", "4444"]),
             ("ABC\x00DEF", ["abc", "def", "ghi"]), ("  ", ["x"]), ("x", ["X", "y"])]
    for pred, refs in cases:
        assert round(100 * ruler.string_match_all(pred, refs), 2) == ruler_string_match_all(
            [ruler.postprocess_pred(pred)], [refs])
    assert ruler.postprocess_pred(" a\x01b\tc \n") == "a\nb\nc"
    assert ruler.string_match_part("a b", ["b", "z"]) == 1.0
    assert ruler.string_match_part("a b", ["y", "z"]) == 0.0
    assert suites.row_score("ruler_cwe", "w1 w2", ["w1", "w2", "w3", "w4"], None) == 0.5


# ---------------------------------------------------------------------------------------------
# The runner's loader path


def test_shared_rows_load_through_the_runner(tok, ruler_dir, shared_rows):
    from experiments import runner

    model = types.SimpleNamespace(tokenizer=tok)
    loaded = runner.load_suite(model, "ruler", ["ruler_niah_multikey_3"], 5, str(ruler_dir),
                                  LENGTH, 0)
    (got,) = loaded.values()
    assert [r["_id"] for r in got] == ["0", "1", "2", "3", "4"]
    for view, real in zip(got, shared_rows, strict=False):
        assert view["answers"] == real["outputs"] and view["all_classes"] is None
        assert view["input"] + view["answer_prefix"] == real["input"]
        assert view["input"].endswith("mentioned in the provided text?")
    assert runner.default_datasets("ruler", str(ruler_dir), LENGTH) == [
        "ruler_niah_multikey_3"]
    assert runner.default_datasets("ruler", None) == [
        d for d in ruler.TASKS if d not in ruler.SHARED]


def test_row_sources(ruler_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(ruler.DATA_DIR_ENV, raising=False)
    assert ruler.rows_file("niah_multikey_3", LENGTH, None) is None  # generated
    assert ruler.rows_file("niah_multikey_3", LENGTH, ruler_dir) == ruler_dir / SHARED_FILE
    with pytest.raises(FileNotFoundError, match=r"niah_multikey_3_8192\.jsonl is missing"):
        ruler.rows_file("niah_multikey_3", 8192, ruler_dir)
    monkeypatch.setenv(ruler.DATA_DIR_ENV, str(ruler_dir))  # its files where it has them
    assert ruler.rows_file("niah_multikey_3", LENGTH, None) == ruler_dir / SHARED_FILE
    assert ruler.rows_file("niah_single_1", LENGTH, None) is None


def test_bad_shared_rows_are_refused(tok, ruler_dir, tmp_path):
    model = types.SimpleNamespace(tokenizer=tok)
    from experiments import runner

    lines = (ruler_dir / SHARED_FILE).read_text().splitlines(keepends=True)[:3]
    bad = json.loads(lines[1])
    bad["outputs"] = bad["outputs"][0]  # a string would be matched character by character
    (tmp_path / SHARED_FILE).write_text(lines[0] + json.dumps(bad) + "\n" + lines[2])
    with pytest.raises(rows.RowError, match=r"line 2: field 'outputs' must be a non-empty list"):
        runner.load_suite(model, "ruler", ["ruler_niah_multikey_3"], 1, str(tmp_path),
                             LENGTH, 0)
    cut = json.loads(lines[0])
    cut["input"] = cut["input"].rsplit(" The special magic", 1)[0]
    (tmp_path / SHARED_FILE).write_text(json.dumps(cut) + "\n")
    with pytest.raises(rows.RowError, match="index 0: field 'input' holds no answer prefix"):
        runner.load_suite(model, "ruler", ["ruler_niah_multikey_3"], 1, str(tmp_path),
                             LENGTH, 0)


@pytest.mark.slow
def test_runner_on_generated_and_shared_rows(ruler_dir, tmp_path):
    """The command line on the tiny random Llama: niah_single_1 generated (its rows fit the
    target with the chat template, uncut), niah_multikey_3 from $DGE_RULER_DIR's file; then a
    --data_dir without the asked file is refused."""
    from tiny_model import build_tiny_llama

    from dge_jax.checkpoints.tokenizer import Tokenizer

    model_dir = build_tiny_llama(tmp_path / "tiny")
    tok = Tokenizer.from_folder(model_dir)
    env = dict(os.environ, JAX_PLATFORMS="cpu", TQDM_DISABLE="1",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
               **{ruler.DATA_DIR_ENV: str(ruler_dir)})
    args = [sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
            "--suite", "ruler", "--num_samples", "2", "--ruler_length", str(LENGTH),
            "--rules", "full,snapkv", "--timings", "prefill", "--budgets", "16",
            "--window", "4", "--batch_size", "2"]

    def run(out, *extra):
        proc = subprocess.run([*args, "--out_dir", str(out), *extra], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = [json.loads(x) for x in (out / PREDICTIONS_FILE).read_text().splitlines()]
        assert sorted((r["sample_id"], r["cell"]) for r in lines) == [
            (i, c) for i in ("0", "1") for c in ("full", "snapkv/prefill/b16")]
        return lines, json.loads((out / "config.json").read_text())

    lines, config = run(tmp_path / "generated", "--datasets", "niah_single_1")
    generated = ruler.make_rows("niah_single_1", tok, tok.apply_chat_template, 2, LENGTH, 0)
    for r in lines:
        row = generated[int(r["sample_id"])]
        assert r["dataset"] == "ruler_niah_single_1" and r["answers"] == row["outputs"]
        assert r["prompt_tokens"] + 128 == row["length"] and not r["truncated"]
    assert config["identity"]["suite"] == "ruler"
    assert config["identity"]["ruler_length"] == LENGTH
    assert config["data"] == {
        "ruler_niah_single_1": config_hash(ruler.generator_definition("niah_single_1", LENGTH))}
    assert "ruler_niah_single_1" in (tmp_path / "generated" / "results.md").read_text()

    # The shared rows are longer in the tiny model's tokens than its 4096 positions: cut them
    # so that the chat template and answer prefix still fit.
    lines, config = run(tmp_path / "shared", "--datasets", "ruler_niah_multikey_3",
                        "--max_length", "3800")
    shared = ruler.read_rows(ruler_dir / SHARED_FILE)
    assert all(r["answers"] == shared[int(r["sample_id"])]["outputs"] for r in lines)
    assert config["data"] == {"ruler_niah_multikey_3": sha256_file(ruler_dir / SHARED_FILE)}

    only = tmp_path / "only_multikey_3"
    only.mkdir()
    shutil.copy(ruler_dir / SHARED_FILE, only)
    proc = subprocess.run([*args, "--datasets", "niah_single_1", "--data_dir", str(only),
                           "--out_dir", str(tmp_path / "x")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("error: "), proc.stderr[-2000:]
    assert "niah_single_1_4096.jsonl is missing" in last
