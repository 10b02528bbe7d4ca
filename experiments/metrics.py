"""LongBench v1 metrics, reimplemented to give the official numbers, plus the synthetic tasks'
row metrics (RULER's string_match_all / string_match_part are in `experiments.suites.ruler`).
Which metric a dataset uses is its suite's answer (`experiments.suites`); this module knows no
suite.

The official scorer is THUDM/LongBench `LongBench/metrics.py` + `eval.py`. It relies on three
packages; here is how each is matched without them:

- `rouge==1.0.1` (pltrdy/rouge): `rouge_l` replays `Rouge().get_scores(..., avg=True)["rouge-l"]`:
  sentences split on ".", unique-word ("exclusive") counts, the summary-level union LCS, the
  package's own LCS back-tracking order, and `f = 2pr / (p + r + 1e-8)`. The official wrapper turns
  any exception into 0.0; the only ones that happen are an empty prediction or reference (no
  sentence left after splitting on "."), and a RecursionError of the package's recursive LCS
  back-tracking for a sentence pair near 1000 words, which depends on the caller's stack depth.
  We return 0.0 for the first and compute the score for the second (it cannot be replayed
  exactly, and no LongBench generation length gets close to it).
- `fuzzywuzzy==0.18.0`: `fuzz_ratio` is `fuzz.ratio` as LongBench's requirements.txt installs it,
  without python-Levenshtein, i.e. `difflib.SequenceMatcher(None, a, b).ratio()` (autojunk on),
  scaled by 100 and rounded with Python's round-half-even; equal strings give 100 before the
  empty-string check gives 0. With python-Levenshtein installed fuzzywuzzy computes an
  indel-distance ratio instead, which differs on some strings; published KV-cache papers do not
  say which they had.
- `jieba==0.42.1` (Chinese word segmentation, `cut_all=False`): imported lazily by `qa_f1_zh` and
  `rouge_zh` only; nothing English needs it.

Metrics take `(prediction, ground_truth, all_classes)` and return a float in [0, 1];
LongBench's row rule (`suites.longbench.score_row`) applies the first-line rule and takes the max
over a row's answers; `suites.score_dataset` returns 100 * mean rounded to 2 decimals, as eval.py
`scorer` does.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

Metric = Callable[[str, str, Sequence[str] | None], float]
RowMetric = Callable[[str, Sequence[str]], float]

_PUNCTUATION = frozenset(string.punctuation)
_ZH_PUNCTUATION = frozenset(
    string.punctuation
    # the official `cn_punctuation` string, split for line length
    + "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝"
    + "～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿"
    + "–—‘’‛“”„‟…‧﹏."
)


# ---------------------------------------------------------------------------------------------
# Normalization and token F1


def normalize_answer(text: str) -> str:
    """Lowercase, drop ASCII punctuation, replace the words a/an/the by a space, squeeze spaces.

    The official order matters: punctuation goes first, so "the-cat" becomes "thecat".
    """
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """Lowercase, drop ASCII and Chinese punctuation, and remove all whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _ZH_PUNCTUATION)
    return "".join(text.split())


def token_f1(prediction_tokens: Sequence[str], ground_truth_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 (multiset overlap), 0 when nothing overlaps."""
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(ground_truth_tokens)
    return 2 * precision * recall / (precision + recall)


def _jieba_cut(text: str) -> list[str]:
    try:
        import jieba
    except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            "the Chinese LongBench metrics (qa_f1_zh, rouge_zh) segment words with jieba, as the "
            "official code does: pip install jieba==0.42.1"
        ) from e
    return list(jieba.cut(text, cut_all=False))


# ---------------------------------------------------------------------------------------------
# Official metrics (one prediction against one ground truth)


def qa_f1_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    """Token F1 of the normalized answers (narrativeqa, qasper, hotpotqa, triviaqa, ...)."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    """Token F1 over jieba words, each normalized, empty ones dropped (multifieldqa_zh)."""

    def words(text: str) -> list[str]:
        return [w for w in (normalize_zh_answer(t) for t in _jieba_cut(text)) if w]

    return token_f1(words(prediction), words(ground_truth))


def _sentences(text: str) -> list[list[str]]:
    """pltrdy/rouge's split: pieces between "." (empty ones dropped before squeezing spaces).

    A whitespace-only piece survives as the empty word "", which then counts as a word.
    """
    return [" ".join(piece.split()).split(" ") for piece in text.split(".") if len(piece) > 0]


def _lcs_words(x: Sequence[str], y: Sequence[str]) -> set[str]:
    """The words of the LCS of x and y, back-tracked in pltrdy/rouge's order (up on a strict
    improvement, else left), since the union over sentences depends on which LCS is chosen."""
    table = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
    for i in range(1, len(x) + 1):
        for j in range(1, len(y) + 1):
            if x[i - 1] == y[j - 1]:
                table[i][j] = table[i - 1][j - 1] + 1
            else:
                table[i][j] = max(table[i - 1][j], table[i][j - 1])
    words: set[str] = set()
    i, j = len(x), len(y)
    while i > 0 and j > 0:
        if x[i - 1] == y[j - 1]:
            words.add(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def _rouge_l_pr(prediction: str, ground_truth: str) -> tuple[float, float] | None:
    """(P, R) of pltrdy/rouge 1.0.1's ROUGE-L, or None when either text is empty."""
    hyp, ref = _sentences(prediction), _sentences(ground_truth)
    if not hyp or not ref:
        return None  # the package raises ValueError
    union: set[str] = set()
    for r in ref:
        for c in hyp:
            union |= _lcs_words(r, c)
    precision = len(union) / len({w for s in hyp for w in s})
    recall = len(union) / len({w for s in ref for w in s})
    return precision, recall


def rouge_l(prediction: str, ground_truth: str) -> float:
    """ROUGE-L F of pltrdy/rouge 1.0.1 (summary level, unique words); 0.0 when either is empty.

    F = 2PR / (P + R + 1e-8), P = |U| / |words(pred)|, R = |U| / |words(ref)|, where U is the
    union over reference sentences r and predicted sentences c of the words of LCS(r, c).
    """
    pr = _rouge_l_pr(prediction, ground_truth)
    if pr is None:
        return 0.0  # the official wrapper returns 0.0
    precision, recall = pr
    return 2.0 * (precision * recall / (precision + recall + 1e-8))


def rouge_l_recall(prediction: str, ground_truth: str) -> float:
    """ROUGE-L R of pltrdy/rouge 1.0.1 (`get_scores(hyps=[prediction], refs=[ground_truth])
    [0]["rouge-l"]["r"]`, LooGLE's automatic metric); 0.0 when either is empty (LooGLE's
    wrapper in kvpress scores a failing pair 0)."""
    pr = _rouge_l_pr(prediction, ground_truth)
    return 0.0 if pr is None else pr[1]


def rouge_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    """ROUGE-L F (gov_report, qmsum, multi_news, samsum)."""
    return rouge_l(prediction, ground_truth)


def rouge_zh_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    """ROUGE-L F over jieba words joined by spaces (dureader, vcsum)."""
    return rouge_l(" ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)))


def classification_score(
    prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None
) -> float:
    """1/k if the ground truth is among the k class names found in the prediction, else 0.

    Class names that are strict substrings of the ground truth are dropped first, with the
    official loop that removes from the list it iterates over (so the name right after a removed
    one is not examined). That quirk changes scores, so it is kept on purpose.
    """
    if all_classes is None:
        raise ValueError("classification needs the dataset's all_classes")
    matches = [name for name in all_classes if name in prediction]
    for name in matches:  # noqa: B909 - official mutation-while-iterating, kept for exactness
        if name in ground_truth and name != ground_truth:
            matches.remove(name)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _id_share(prediction: str, answer_id: str) -> float:
    """Share of the numbers (\\d+ runs) in the prediction that equal `answer_id` as strings."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(n == answer_id for n in numbers) / len(numbers)


def _paragraph_id(ground_truth: str, pattern: str) -> str:
    found = re.findall(pattern, ground_truth)
    if not found:
        raise ValueError(f"ground truth {ground_truth!r} does not match {pattern!r}")
    return found[0]


def retrieval_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    """Share of numbers in the prediction equal to N of the answer "Paragraph N"."""
    return _id_share(prediction, _paragraph_id(ground_truth, r"Paragraph (\d+)"))


def retrieval_zh_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    """Share of numbers in the prediction equal to N of the answer "段落N"."""
    return _id_share(prediction, _paragraph_id(ground_truth, r"段落(\d+)"))


def count_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    """Share of numbers in the prediction equal to the answer (passage_count)."""
    return _id_share(prediction, str(ground_truth))


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy 0.18.0 `fuzz.ratio` with its pure-python backend (see the module docstring)."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def first_code_line(prediction: str) -> str:
    """The first line (after leading newlines) without "`", "#" or "//"; "" if there is none."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim_score(prediction: str, ground_truth: str, all_classes=None) -> float:
    """fuzz.ratio / 100 between the first code line of the prediction and the answer."""
    return fuzz_ratio(first_code_line(prediction), ground_truth) / 100


METRICS: Mapping[str, Metric] = MappingProxyType(
    {
        "qa_f1": qa_f1_score,
        "qa_f1_zh": qa_f1_zh_score,
        "rouge": rouge_score,
        "rouge_zh": rouge_zh_score,
        "classification": classification_score,
        "retrieval": retrieval_score,
        "retrieval_zh": retrieval_zh_score,
        "count": count_score,
        "code_sim": code_sim_score,
    }
)


# ---------------------------------------------------------------------------------------------
# Synthetic-task metrics (one prediction against all of a row's answers)


def _contains(prediction: str, answer: str) -> bool:
    """Whether the normalized answer occurs in the normalized prediction as whole words."""
    return f" {normalize_answer(answer)} " in f" {normalize_answer(prediction)} "


def match_any(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if any answer occurs in the prediction as whole words (case and punctuation free)."""
    return float(any(_contains(prediction, a) for a in answers))


def match_fraction(prediction: str, answers: Sequence[str]) -> float:
    """Fraction of the answers that occur in the prediction as whole words."""
    return sum(_contains(prediction, a) for a in answers) / len(answers)


ROW_METRICS: Mapping[str, RowMetric] = MappingProxyType(
    {"match_any": match_any, "match_fraction": match_fraction}
)


# ---------------------------------------------------------------------------------------------
# Rules around a metric


def first_line(prediction: str) -> str:
    """eval.py's rule for trec, triviaqa, samsum and lsht: the first line after leading newlines."""
    return prediction.lstrip("\n").split("\n")[0]
