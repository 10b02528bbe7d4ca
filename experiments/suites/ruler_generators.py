"""RULER's four generators, ported step by step (`scripts/data/synthetic/{niah,
variable_tracking,common_words_extraction,freq_words_extraction}.py`), and `make_rows`, which
runs one for a task (`experiments.suites.ruler` says how the port follows RULER)."""

from __future__ import annotations

import dataclasses
import random
import string
import uuid
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from experiments import rows
from experiments.suites.ruler_tasks import (
    DEPTHS,
    FIX,
    NEEDLE,
    NOISE,
    TASKS,
    AdjNounWords,
    RulerTask,
    TokenCounter,
    dataset_name,
    essay_words,
    fit_row,
    largest_fitting,
    split_answer_prefix,
    split_sentences,
    word_list,
)

if TYPE_CHECKING:
    from experiments.suites.base import Tokenizer

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
        size = largest_fitting(lambda n: count(self.make(search, n)[0]) + ttg <= limit,
                                step, max(int((limit / per_unit) * 3), step * 2)) or step

        def row(index: int) -> tuple[str, list[str], int]:
            rng = ctx.stream(ctx.length, ctx.seed, index)
            text, answers, tokens = fit_row(lambda n: self.make(rng, n), count, limit - ttg,
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
        size = largest_fitting(lambda n: count(self.make(rng, n, True)[0]) <= 500, step,
                                max(int((500 / per_unit) * 3), step * 2)) or step
        text, answers, _ = fit_row(lambda n: self.make(rng, n, True), count, 500, size, step,
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
        size = largest_fitting(
            lambda n: count(self.make(search, n, False)[0]) + example_tokens + ttg <= limit,
            step, max(int((limit / per_unit) * 3), step * 2)) or step
        cut = ctx.task.template[:20]

        def make(rng, n):
            text, answers = self.make(rng, n, False)
            at = text.index(cut)
            return text[:at] + self.randomize(rng, example) + "\n" + text[at:], answers

        def row(index: int) -> tuple[str, list[str], int]:
            rng = ctx.stream(ctx.length, ctx.seed, index)
            text, answers, tokens = fit_row(lambda n: make(rng, n), count, limit - ttg, size,
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
            out = sorted(set(word_list("nounlist.txt") + word_list("adjectivelist.txt")
                             + word_list("verblist.txt")))
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
        size = largest_fitting(
            lambda n: n <= most and count(self.make(search, n)[0]) + ttg <= limit,
            step, max(int(limit // per_word) * 2, step * 2)) or step
        if size == most:
            self.example(search, most + 1, 1, 1)  # raises: the length needs more words

        def row(index: int) -> tuple[str, list[str], int]:
            rng = ctx.stream(ctx.length, ctx.seed, index)
            text, answers, tokens = fit_row(lambda n: self.make(rng, n), count, limit - ttg,
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
