"""LongBench metrics against values worked out by hand from the official definitions.

Official code: THUDM/LongBench LongBench/metrics.py and eval.py, with rouge==1.0.1 (pltrdy),
fuzzywuzzy==0.18.0 (pure-python backend) and jieba==0.42.1. Each expected value below is derived
in a comment; none comes from running the code under test.
"""

import math

import pytest

from experiments import metrics, suites
from experiments.suites import longbench_config as config
from experiments.suites import synthetic

TREC_CLASSES = [  # all_classes of the official trec rows (50 classes)
    "Food", "Date", "Order, rank", "Speed", "Disease and medicine",
    "Word with a special property", "Abbreviation", "Language", "Letter like a-z", "Other entity",
    "Animal", "Expression abbreviated", "Price", "Techniques and method", "Musical instrument",
    "Mountain", "Currency name", "Event", "Product", "State", "Individual", "Organ of body",
    "Reason", "Manner of an action", "City", "Religion",
    "Invention, book and other creative piece", "Distance, linear measure", "Temperature",
    "Postcode or other code", "Size, area and volume", "Sport", "Country", "Other location",
    "Lasting time of somethin", "Equivalent term", "Description of something", "Weight",
    "Vehicle", "Color", "Other number", "Definition of something", "Element and substance",
    "Description of a person", "Symbols and sign", "Number of something", "Plant",
    "Percent, fraction", "Group or organization of person", "Title of a person",
]


def f_rouge(p: float, r: float) -> float:
    """pltrdy/rouge's F with its 1e-8 in the denominator."""
    return 2.0 * (p * r / (p + r + 1e-8))


# --- normalization -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        # lower -> "the-cat, a dog an apple." -> no punctuation -> "thecat a dog an apple"
        # -> articles (whole words only) become spaces -> squeeze
        ("The-cat, a DOG an apple.", "thecat dog apple"),
        ("  Bob   Dylan!! ", "bob dylan"),
        # "an" inside "and"/"anthem" and "the" inside "theatre" are not articles
        ("Theatre and an anthem", "theatre and anthem"),
        ("a the an", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert metrics.normalize_answer(text) == expected


def test_normalize_zh_answer_drops_chinese_punctuation_and_all_spaces():
    assert metrics.normalize_zh_answer("北京，天安门。 Hello World!") == "北京天安门helloworld"
    assert metrics.normalize_zh_answer("“你好”…") == "你好"


# --- qa_f1 -------------------------------------------------------------------------------------


def test_qa_f1():
    assert metrics.qa_f1_score("The Bob Dylan!", "Bob Dylan") == 1.0
    # 5 predicted tokens, 2 shared: p = 2/5, r = 1, F1 = 2pr/(p+r) = 0.8/1.4 = 4/7
    assert metrics.qa_f1_score("Bob Dylan and Tom Petty", "Bob Dylan") == pytest.approx(4 / 7)
    # multiset overlap: min(2, 1) = 1 shared; p = 1/2, r = 1 -> 2/3
    assert metrics.qa_f1_score("paris paris", "Paris") == pytest.approx(2 / 3)
    # both normalize to nothing -> no overlap -> 0
    assert metrics.qa_f1_score("a the an", "the") == 0.0
    assert metrics.qa_f1_score("London", "Paris") == 0.0


def test_qa_f1_zh_uses_jieba_words():
    # jieba: 我爱北京天安门 -> 我 / 爱 / 北京 / 天安门 ; 北京天安门 -> 北京 / 天安门
    # p = 2/2, r = 2/4 -> F1 = 2 * 0.5 / 1.5 = 2/3
    assert metrics.qa_f1_zh_score("北京天安门", "我爱北京天安门") == pytest.approx(2 / 3)
    # punctuation tokens normalize to "" and are dropped -> identical word lists
    assert metrics.qa_f1_zh_score("北京，天安门。", "北京天安门") == 1.0


# --- rouge-L (pltrdy/rouge 1.0.1) --------------------------------------------------------------


def test_rouge_counts_unique_words():
    # one sentence each; unique words: hyp {the,cat,sat,on,mat} = 5, ref {the,cat,is,on,mat} = 5;
    # LCS = "the cat on the mat" whose word set is {the,cat,on,mat} = 4 -> p = r = 4/5.
    # (A token-count ROUGE-L would give 5/6.)
    got = metrics.rouge_score("the cat sat on the mat", "the cat is on the mat")
    assert got == f_rouge(0.8, 0.8)
    assert got == pytest.approx(0.8, abs=1e-7)
    # repeated words count once: n = m = 1
    assert metrics.rouge_score("a a a", "a") == f_rouge(1.0, 1.0)


def test_rouge_summary_level_union():
    # The package's docstring example: r = w1..w5, c1 = w1 w2 w6 w7 w8, c2 = w1 w3 w8 w9 w5;
    # LCS(r,c1) = {w1,w2}, LCS(r,c2) = {w1,w3,w5}, union = 4 words.
    # n = |{w1,w2,w6,w7,w8,w3,w9,w5}| = 8, m = 5 -> p = 4/8, r = 4/5.
    got = metrics.rouge_score("w1 w2 w6 w7 w8. w1 w3 w8 w9 w5", "w1 w2 w3 w4 w5")
    assert got == f_rouge(0.5, 0.8)


def test_rouge_lcs_backtracking_order():
    # hyp sentences "b a" and "b"; ref "a b". LCS("a b", "b a") has length 1, and the package
    # back-tracks left on ties, picking "b"; "b" again for the second sentence -> union {b}.
    # n = |{b,a}| = 2, m = 2 -> p = r = 1/2. (Picking "a" first would give union {a,b}, F = 1.)
    assert metrics.rouge_score("b a. b", "a b") == f_rouge(0.5, 0.5)


def test_rouge_split_on_periods_keeps_blank_sentence_as_empty_word():
    # "a b. " splits into "a b" and " " -> words a, b and the empty word "" -> n = 3, m = 2,
    # union {a,b} -> p = 2/3, r = 1.
    assert metrics.rouge_score("a b. ", "a b") == f_rouge(2 / 3, 1.0)


@pytest.mark.parametrize("prediction, reference", [("", "abc"), ("...", "abc"), ("abc", "")])
def test_rouge_empty_side_scores_zero(prediction, reference):
    # no sentence left after splitting on "." -> the package raises -> the official wrapper 0.0
    assert metrics.rouge_score(prediction, reference) == 0.0


def test_rouge_is_case_sensitive():
    assert metrics.rouge_score("Cat", "cat") == 0.0


def test_rouge_zh():
    # jieba words joined by spaces: hyp {北京,天安门} n = 2, ref {我,爱,北京,天安门} m = 4,
    # LCS {北京,天安门} -> p = 1, r = 1/2
    assert metrics.rouge_zh_score("北京天安门", "我爱北京天安门") == f_rouge(1.0, 0.5)


# --- classification ----------------------------------------------------------------------------


def test_classification_on_trec_classes():
    assert metrics.classification_score(
        "Description of a person", "Description of a person", TREC_CLASSES) == 1.0
    # two class names occur, the right one among them -> 1/2
    assert metrics.classification_score(
        "Individual or Title of a person", "Individual", TREC_CLASSES) == 0.5
    assert metrics.classification_score("City", "Country", TREC_CLASSES) == 0.0
    assert metrics.classification_score("no class here", "City", TREC_CLASSES) == 0.0


def test_classification_keeps_official_list_mutation_quirk():
    # Found in "a b c": ["a b", "a", "b", "c"]. The loop drops strict substrings of the truth
    # "a b" while iterating the same list: it removes "a" (index 1), the list shifts, and the
    # iterator's next index (2) is now "c", so "b" is never examined. Left: ["a b", "b", "c"]
    # -> 1/3 (a copy-then-filter would leave ["a b", "c"] -> 1/2).
    got = metrics.classification_score("a b c", "a b", ["a b", "a", "b", "c"])
    assert got == pytest.approx(1 / 3)


def test_classification_needs_classes():
    with pytest.raises(ValueError, match="all_classes"):
        metrics.classification_score("City", "City", None)


# --- retrieval and count -----------------------------------------------------------------------


def test_retrieval_parses_paragraph_number():
    assert metrics.retrieval_score("Paragraph 19", "Paragraph 19") == 1.0
    # numbers found: 19 and 3 -> one of two is right
    assert metrics.retrieval_score("Paragraph 19, not Paragraph 3", "Paragraph 19") == 0.5
    # string equality, not prefix: "1" != "19"
    assert metrics.retrieval_score("Paragraph 1", "Paragraph 19") == 0.0
    assert metrics.retrieval_score("I do not know", "Paragraph 19") == 0.0
    with pytest.raises(ValueError, match="Paragraph"):
        metrics.retrieval_score("19", "19")


def test_retrieval_zh():
    assert metrics.retrieval_zh_score("答案是段落3", "段落3") == 1.0
    assert metrics.retrieval_zh_score("段落3和段落13", "段落3") == 0.5


def test_count_extracts_all_numbers():
    assert metrics.count_score("46", "46") == 1.0
    # numbers 46 and 50 -> 1/2
    assert metrics.count_score("There are 46 unique paragraphs out of 50.", "46") == 0.5
    assert metrics.count_score("046", "46") == 0.0  # "046" != "46"
    assert metrics.count_score("4 6", "46") == 0.0  # two numbers, neither is 46
    assert metrics.count_score("forty-six", "46") == 0.0  # no number at all


# --- code_sim ----------------------------------------------------------------------------------


def test_fuzz_ratio_is_fuzzywuzzy_pure_python():
    # difflib: one matching block "abc" of 3, lengths 4 + 4 -> 2*3/8 = 0.75
    assert metrics.fuzz_ratio("abcd", "abce") == 75
    # "abcde" matches (5), 16 characters -> 62.5, rounded half to even -> 62 (not 63)
    assert metrics.fuzz_ratio("abcdefgh", "abcdexyz") == 62
    assert metrics.fuzz_ratio("", "") == 100  # equality is checked before emptiness
    assert metrics.fuzz_ratio("", "x") == 0


def test_code_sim_takes_first_plain_code_line():
    # lines "```python", "    x = 1", "```": the first without ` # // is "    x = 1"
    assert metrics.code_sim_score("```python\n    x = 1\n```", "    x = 1") == 1.0
    assert metrics.code_sim_score("\n\n# comment\n// c\nreturn a", "return a") == 1.0
    assert metrics.code_sim_score("# only a comment", "x = 1") == 0.0
    assert metrics.code_sim_score("abcd\nzzz", "abce") == 0.75
    # a gold line with "#" is skipped in the prediction too: "" vs the gold -> 0
    assert metrics.code_sim_score("x = 1  # set", "x = 1  # set") == 0.0


# --- score_dataset -----------------------------------------------------------------------------


def test_score_dataset_first_line_rule_trec():
    # row 1: leading newlines dropped, first line "Other location", the only class name in it
    # -> 1 (the whole text would also contain "City" -> 1/2). Row 2: "City" vs Country -> 0.
    preds = ["\n\nOther location\nQuestion: Where is it ?\nType: City", "City"]
    got = suites.score_dataset("trec", preds, [["Other location"], ["Country"]], TREC_CLASSES)
    assert got == 50.0


def test_score_dataset_first_line_rule_triviaqa_and_max_over_answers():
    # first line "Paris" equals the first answer exactly -> 1 -> 100
    pred = "Paris\nQuestion: What is the capital of Italy?\nAnswer: Rome"
    assert suites.score_dataset("triviaqa", [pred], [["Paris", "Paris, France"]]) == 100.0


def test_score_dataset_no_first_line_rule_for_hotpotqa():
    # all 4 tokens count: bob dylan and more -> p = 2/4, r = 1 -> F1 = 2/3 -> 66.67
    got = suites.score_dataset("hotpotqa", ["Bob Dylan\nand more"], [["Bob Dylan"]])
    assert got == 66.67
    assert suites.score_dataset("hotpotqa", ["Paris"], [["London", "Paris"]]) == 100.0


def test_score_dataset_rounds_like_eval_py():
    got = suites.score_dataset("passage_count", ["3", "4", "5"], [["3"], ["3"], ["3"]])
    assert got == 33.33  # round(100 * 1/3, 2)


def test_score_dataset_synthetic_tasks():
    answers = [["1234567", "7654321", "1111111", "2222222"]]
    # two of four values found -> 0.5 -> 50
    assert suites.score_dataset("niah_multivalue", ["1234567, 7654321."], answers) == 50.0
    assert suites.score_dataset("passkey", [" 12345."], [["12345"]]) == 100.0
    assert suites.score_dataset("passkey", [" 123456"], [["12345"]]) == 0.0


def test_score_dataset_rejects_bad_input():
    with pytest.raises(ValueError):
        suites.score_dataset("hotpotqa", ["a", "b"], [["a"]])
    with pytest.raises(ValueError):
        suites.score_dataset("hotpotqa", [], [])
    with pytest.raises(ValueError, match="no metric"):
        suites.score_dataset("hotpot", ["a"], [["a"]])


def test_match_metrics_whole_words_after_normalization():
    assert metrics.match_any("The pass key is 12345.", ["12345"]) == 1.0
    assert metrics.match_any("The pass key is 123456.", ["12345"]) == 0.0
    assert metrics.match_any("It is the Queen's Gambit", ["Queen's Gambit"]) == 1.0
    assert metrics.match_fraction("ABCDE and FGHIJ", ["ABCDE", "FGHIJ", "KLMNO", "PQRST"]) == 0.5


# --- tables and averages -----------------------------------------------------------------------


def test_every_task_has_a_metric():
    assert set(config.DATASET2METRIC) == set(config.ALL_TASKS)
    assert set(config.DATASET2METRIC.values()) <= set(metrics.METRICS)
    assert {t.metric for t in synthetic.TASKS.values()} <= set(metrics.ROW_METRICS)
    assert not set(synthetic.TASKS) & set(config.ALL_TASKS)


def _full_scores():
    return {
        "narrativeqa": 10, "qasper": 20, "multifieldqa_en": 30,  # single-doc QA: 20
        "hotpotqa": 40, "2wikimqa": 50, "musique": 60,  # multi-doc QA: 50
        "gov_report": 20, "qmsum": 20, "multi_news": 20,  # summarization: 20
        "trec": 60, "triviaqa": 70, "samsum": 80,  # few-shot: 70
        "passage_count": 0, "passage_retrieval_en": 100,  # synthetic: 50
        "lcc": 50, "repobench-p": 70,  # code: 60
    }


def test_average_scores_full():
    got = suites.average_scores(_full_scores())
    assert got["mean_en16"] == 700 / 16  # = 43.75
    assert got["category_mean"] == pytest.approx(270 / 6)  # (20+50+20+70+50+60)/6 = 45
    assert got["categories"]["few_shot"] == 70
    assert got["missing_en16"] == []


def test_average_scores_partial_ignores_chinese_and_synthetic():
    got = suites.average_scores({"hotpotqa": 40, "lcc": 50, "dureader": 99, "passkey": 100})
    assert got["mean_en16"] == 45.0
    assert got["categories"] == {"multi_doc_qa": 40.0, "code": 50.0}
    assert got["category_mean"] == 45.0
    assert len(got["missing_en16"]) == 14
    assert "hotpotqa" not in got["missing_en16"] and "qasper" in got["missing_en16"]


def test_average_scores_edge_cases():
    with pytest.raises(ValueError, match="unknown"):
        suites.average_scores({"hotpot": 1.0})
    empty = suites.average_scores({})
    assert math.isnan(empty["mean_en16"]) and math.isnan(empty["category_mean"])
    assert empty["missing_en16"] == list(config.ENGLISH_TASKS)
