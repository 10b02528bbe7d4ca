"""RULER's task table and what its generators draw from (`experiments.suites.ruler` is the
suite): the ported snapshot's constants, the four generator kinds (templates, answer prefixes,
generation lengths, metric), the eleven tasks of `scripts/synthetic.yaml`, the essay haystack
and wonderwords' word lists, and RULER's token counting."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import pathlib
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from experiments.suites.haystack import haystack_dir

RULER_COMMIT = "c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a"  # NVIDIA/RULER, the ported snapshot
GENERATOR = "ruler-port-1"  # bump when the generated rows change
DATA_DIR_ENV = "DGE_RULER_DIR"
DATASET_PREFIX = "ruler_"  # our dataset names: RULER's niah_multivalue is also a synthetic task
WONDERWORDS_INSTALL = "pip install wonderwords==2.2.0"
# sha256 of wonderwords 2.2.0's word lists (3.x removed four nouns, which moves every draw)
WONDERWORDS_SHA256 = MappingProxyType({
    "nounlist.txt": "0778f51872f2aa89e0745c0cc37471a13e3d2161a79fcfdc03b6390b10604a55",
    "adjectivelist.txt": "66814d46b7e292c83e839d12fe2fa083c8f66779b14b294e1be4e1342c5d4131",
    "verblist.txt": "9fbf5e4e69b8869aebd88e6d545312ff9f878a747327ede5f6dbbba5c27b08ad",
})
FIX = "a bug in experiments/suites/ruler_generators.py: report it"
FILE_FIX = "regenerate the file with RULER's scripts/data/prepare.py (model template base)"


@dataclasses.dataclass(frozen=True)
class Kind:
    """One RULER generator (`scripts/data/synthetic/constants.py` TASKS entry)."""

    tokens_to_generate: int
    template: str
    answer_prefix: str
    metric: str  # scripts/eval/synthetic/constants.py: its metric_fn


# scripts/data/synthetic/constants.py, verbatim ("qa" needs SQuAD / HotpotQA: not ported).
KINDS: Mapping[str, Kind] = MappingProxyType({
    "niah": Kind(
        tokens_to_generate=128,
        template=(
            "Some special magic {type_needle_v} are hidden within the following text. Make "
            "sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n"
            "{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned "
            "in the provided text?"
        ),
        answer_prefix=(
            " The special magic {type_needle_v} for {query} mentioned in the provided text are"
        ),
        metric="string_match_all",
    ),
    "variable_tracking": Kind(
        tokens_to_generate=30,
        template=(
            "Memorize and track the chain(s) of variable assignment hidden in the following "
            "text.\n\n{context}\nQuestion: Find all variables that are assigned the value "
            "{query} in the text above."
        ),
        answer_prefix=(
            " Answer: According to the chain(s) of variable assignment in the text above, "
            "{num_v} variables are assigned the value {query}, they are: "
        ),
        metric="string_match_all",
    ),
    "common_words_extraction": Kind(
        tokens_to_generate=120,
        template=(
            "Below is a numbered list of words. In these words, some appear more often than "
            "others. Memorize the ones that appear most often.\n{context}\nQuestion: What are "
            "the 10 most common words in the above list?"
        ),
        answer_prefix=" Answer: The top 10 words that appear most often in the list are:",
        metric="string_match_all",
    ),
    "freq_words_extraction": Kind(
        tokens_to_generate=50,
        template=(
            "Read the following coded text and track the frequency of each coded word. Find "
            "the three most frequently appeared coded words. {context}\nQuestion: Do not "
            "provide any explanation. Please ignore the dots '....'. What are the three most "
            "frequently appeared words in the above coded text?"
        ),
        answer_prefix=(
            " Answer: According to the coded text above, the three most frequently appeared "
            "words are:"
        ),
        metric="string_match_all",
    ),
})


@dataclasses.dataclass(frozen=True)
class RulerTask:
    """One task of `scripts/synthetic.yaml`: its generator (`kind`) and that generator's
    arguments (the yaml's `args`, plus the argparse defaults the yaml leaves as they are)."""

    name: str
    kind: str
    args: Mapping[str, object]

    @property
    def template(self) -> str:
        return KINDS[self.kind].template

    @property
    def answer_prefix(self) -> str:
        return KINDS[self.kind].answer_prefix

    @property
    def max_new_tokens(self) -> int:
        return KINDS[self.kind].tokens_to_generate

    @property
    def metric(self) -> str:
        return KINDS[self.kind].metric

    def definition(self) -> dict:
        """Everything a generated row depends on besides the seed, length and tokenizer."""
        return {"name": self.name, "kind": self.kind, "args": dict(self.args),
                **dataclasses.asdict(KINDS[self.kind])}


def _niah(haystack: str, key: str, value: str, k: int = 1, v: int = 1, q: int = 1) -> dict:
    return {"type_haystack": haystack, "type_needle_k": key, "type_needle_v": value,
            "num_needle_k": k, "num_needle_v": v, "num_needle_q": q}


# scripts/synthetic.yaml (without qa_1 / qa_2), in its order.
_TASK_ARGS: tuple[tuple[str, str, dict], ...] = (
    ("niah_single_1", "niah", _niah("noise", "words", "numbers")),
    ("niah_single_2", "niah", _niah("essay", "words", "numbers")),
    ("niah_single_3", "niah", _niah("essay", "words", "uuids")),
    ("niah_multikey_1", "niah", _niah("essay", "words", "numbers", k=4)),
    ("niah_multikey_2", "niah", _niah("needle", "words", "numbers")),
    ("niah_multikey_3", "niah", _niah("needle", "uuids", "uuids")),
    ("niah_multivalue", "niah", _niah("essay", "words", "numbers", v=4)),
    ("niah_multiquery", "niah", _niah("essay", "words", "numbers", q=4)),
    ("vt", "variable_tracking", {"type_haystack": "noise", "num_chains": 1, "num_hops": 4}),
    ("cwe", "common_words_extraction", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10,
                                        "num_fewshot": 1}),
    ("fwe", "freq_words_extraction", {"alpha": 2.0, "coded_wordlen": 6, "vocab_size": -1}),
)

# Not RULER's: niah_multiquery's rows asked once per key, each row one key, the rows of a
# multiquery row sharing its context (the shared_context protocol's questions; `SHARED`).
_SHARED_ARGS: tuple[tuple[str, str, dict], ...] = (
    ("niah_multiquery_shared", "niah", _niah("essay", "words", "numbers", q=4)),
)

if TYPE_CHECKING:
    from experiments.suites.base import Tokenizer

# Our dataset name -> task. RULER's names (niah_single_1, vt, ...) are accepted on the
# command line (`dataset_name`); results use ours.
TASKS: Mapping[str, RulerTask] = MappingProxyType({
    DATASET_PREFIX + name: RulerTask(name, kind, MappingProxyType(args))
    for name, kind, args in _TASK_ARGS + _SHARED_ARGS
})
# shared task -> questions per context (one per queried key)
SHARED: Mapping[str, int] = MappingProxyType({
    DATASET_PREFIX + name: args["num_needle_q"] for name, _, args in _SHARED_ARGS
})


def dataset_name(name: str) -> str:
    """Our dataset name of a RULER task given by RULER's name ("vt") or ours ("ruler_vt")."""
    full = name if name.startswith(DATASET_PREFIX) else DATASET_PREFIX + name
    if full not in TASKS:
        raise ValueError(f"unknown RULER task {name!r}; known: "
                         f"{[t.name for t in TASKS.values()]}")
    return full


# ---------------------------------------------------------------------------------------------
# Haystacks and word lists

# niah.py / variable_tracking.py, verbatim.
NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
         "again.")
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."


def _depths() -> tuple[int, ...]:
    """niah.py's DEPTHS: np.round(np.linspace(0, 100, num=40)) as ints (0, 3, 5, 8, ...)."""
    import numpy as np

    return tuple(int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)))


DEPTHS = _depths()


def essay_words(folder: str | None = None) -> tuple[str, ...]:
    """RULER's essay haystack: the essays concatenated as files (sorted, no separator), all
    whitespace runs made one space, split on " " (niah.py: `re.sub(r'\\s+', " ", essay)`)."""
    folder = folder or haystack_dir()
    text = "".join(pathlib.Path(p).read_text(encoding="utf-8")
                   for p in sorted(pathlib.Path(folder).glob("*.txt")))
    return tuple(re.sub(r"\s+", " ", text).split(" "))


def split_sentences(text: str) -> list[str]:
    """Sentences of whitespace-collapsed text (in place of nltk's sent_tokenize)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


def _wonderwords_dir() -> pathlib.Path:
    """wonderwords' assets folder, located without importing the package."""
    spec = importlib.util.find_spec("wonderwords")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"RULER's word lists come from wonderwords: {WONDERWORDS_INSTALL}")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "assets"


def word_list(name: str) -> list[str]:
    """`wonderwords.random_word._get_words_from_text_file(name)`, checked to be 2.2.0's."""
    path = _wonderwords_dir() / name
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != \
            WONDERWORDS_SHA256[name]:
        raise FileNotFoundError(
            f"{path} is not wonderwords 2.2.0's {name} (RULER's published data used 2.2.0; "
            f"3.x changed the noun list): {WONDERWORDS_INSTALL}")
    return [w.rstrip() for w in path.read_text(encoding="utf-8").splitlines(keepends=True)]


def words_fingerprint() -> str:
    """Short hash of the word lists the generators draw from."""
    digest = hashlib.sha256()
    for name in sorted(WONDERWORDS_SHA256):
        digest.update(f"{name}:{'|'.join(word_list(name))}\n".encode())
    return digest.hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class AdjNounWords:
    """niah.py's `words`: every "<adjective>-<noun>" of wonderwords, drawn uniformly.

    RULER builds `sorted(set(f"{adj}-{noun}"))` and calls `random.choice` on it; here index
    i of the product of the sorted unique lists stands for one pair (`distinct` checks that
    no two pairs spell the same word, so the set is the same).
    """

    adjectives: tuple[str, ...]
    nouns: tuple[str, ...]

    @classmethod
    def load(cls) -> AdjNounWords:
        return cls(tuple(sorted(set(word_list("adjectivelist.txt")))),
                   tuple(sorted(set(word_list("nounlist.txt")))))

    def __len__(self) -> int:
        return len(self.adjectives) * len(self.nouns)

    def __getitem__(self, i: int) -> str:
        a, n = divmod(i, len(self.nouns))
        return f"{self.adjectives[a]}-{self.nouns[n]}"

    def distinct(self) -> bool:
        """No adj1-noun1 == adj2-noun2 with adj1 != adj2: that needs adj2 = adj1 + "-" + s and
        noun1 = s + "-" + noun2, which a scan of the hyphenated words finds."""
        adjs, nouns = set(self.adjectives), set(self.nouns)
        for adj in adjs:
            for p in (i for i, ch in enumerate(adj) if ch == "-"):
                if adj[:p] in adjs:
                    head = adj[p + 1:] + "-"
                    if any(n.startswith(head) and n[len(head):] in nouns for n in nouns):
                        return False
        return True


# ---------------------------------------------------------------------------------------------
# Lengths


def split_answer_prefix(text: str, kind: str) -> tuple[str, str] | None:
    """(input, answer prefix) as RULER cuts them: at the last occurrence of the first 10
    characters of the kind's answer prefix; None when they do not occur."""
    cut = text.rfind(KINDS[kind].answer_prefix[:10])
    return None if cut < 0 else (text[:cut], text[cut:])


@dataclasses.dataclass(frozen=True)
class TokenCounter:
    """Token counts as RULER's `len(TOKENIZER.text_to_tokens(...))`, with the model's chat
    template standing for RULER's model template."""

    tokenizer: Tokenizer
    chat: Callable[[str], str]
    kind: str

    def bare(self, text: str) -> int:
        """Tokens of `text` as it is (vt's in-context example: RULER drops the model
        template there)."""
        return len(self.tokenizer.encode(text))

    def prompt(self, text: str) -> int:
        """Tokens of the model input: chat template around the input, then the prefix."""
        parts = split_answer_prefix(text, self.kind)
        if parts is None:
            raise RuntimeError(f"{self.kind}: no answer prefix in the prompt; {FIX}")
        return len(self.tokenizer.encode(self.chat(parts[0]) + parts[1]))


def largest_fitting(fits: Callable[[int], bool], lower: int, upper: int) -> int | None:
    """The binary search of niah.py / variable_tracking.py / common_words_extraction.py: the
    largest size in [lower, upper] whose (freshly drawn) prompt fits, or None."""
    best = None
    while lower <= upper:
        mid = (lower + upper) // 2
        if fits(mid):
            best, lower = mid, mid + 1
        else:
            upper = mid - 1
    return best


def fit_row(make: Callable[[int], tuple[str, list[str]]], count: Callable[[str], int],
             limit: int, size: int, step: int, task: str) -> tuple[str, list[str], int]:
    """A row at `size`, redrawn `step` smaller while it does not fit (the generators' sample
    loop); (text, answers, tokens)."""
    while True:
        text, answers = make(size)
        tokens = count(text)
        if tokens <= limit:
            return text, answers, tokens
        if size <= step:  # RULER would retry this size forever
            raise ValueError(f"{task}: no prompt of {size} haystack units fits {limit} tokens; "
                             "ask for a longer --ruler_length")
        size -= step
