"""Needle in a haystack over a depth x length grid (`--suite niah`): the heatmap readers of
KV-compression papers look for first (`experiments.heatmaps` draws it from a run folder).

One dataset, `niah`: the synthetic suite's pass key ("The pass key is 12345. Remember it.")
placed at a fixed depth, 0 %, 10 %, ..., 100 % of the haystack's sentences, in the Paul Graham
essays filled to a fixed length: `--synthetic_length` x 1/4, 2/4, 3/4 and 4/4, counted in the
model's tokens as the synthetic suite counts them (prompt without chat template, at most that
many). Row i is grid cell i mod 44 (lengths slowest, then depths) and repeat i // 44, so the
default 44 samples cover the grid once and more samples repeat it with other keys and
haystack windows; each row is a pure function of (length, depth, seed, repeat). A row's id
names its cell, `niah-l<length>-d<depth>-r<repeat>`, which the heatmap reads back from the
predictions. Prompt, answer prefix, generation length (16) and metric (the key appears in the
answer) are the synthetic `passkey` task's.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from experiments import metrics, rows
from experiments.suites.base import RowSettings, Suite, Tokenizer
from experiments.suites.haystack import haystack_dir, load_haystack
from experiments.suites.synthetic import (
    TASKS,
    build_context,
    needles_passkey,
    only_in_needles,
    sentence_token_counts,
)

DATASET = "niah"
DEPTHS = tuple(range(0, 101, 10))  # percent of the haystack before the needle
FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # of --synthetic_length
PASSKEY = TASKS["passkey"]
_ID = re.compile(r"niah-l(\d+)-d(\d+)-r(\d+)")


def lengths(length_tokens: int) -> list[int]:
    """The grid's prompt lengths for --synthetic_length `length_tokens`."""
    return [round(length_tokens * f) for f in FRACTIONS]


def grid_cell(sample_id: str) -> tuple[int, int] | None:
    """(length, depth %) of a row of this suite, from its id; None for any other id."""
    m = _ID.fullmatch(sample_id)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def make_row(tokenizer: Tokenizer, length: int, depth: int, seed: int, repeat: int,
             sentences: Sequence[str], counts: Sequence[int]) -> dict:
    """The pass key at `depth` % of a haystack filling `length` tokens (LongBench's schema)."""
    rng = random.Random(f"{DATASET}|{length}|{depth}|{seed}|{repeat}")
    start = rng.randrange(len(sentences))
    for _ in range(100):
        needles = needles_passkey(rng)
        context, size = build_context("passkey", needles, [depth / 100], tokenizer, sentences,
                                      counts, start, length)
        if only_in_needles(context, needles):
            break
    else:  # pragma: no cover - needs 100 colliding draws in a row
        raise RuntimeError(f"{DATASET}: could not draw a pass key absent from the haystack")
    return {"input": needles.question, "context": context, "answers": list(needles.answers),
            "length": size, "dataset": DATASET, "language": "en", "all_classes": None,
            "_id": f"niah-l{length}-d{depth:03d}-r{repeat}"}


def make_rows(tokenizer: Tokenizer, num_samples: int, length_tokens: int, seed: int = 0,
              sentences: Sequence[str] | None = None) -> list[dict]:
    """`num_samples` rows walking the depth x length grid (module docstring), checked."""
    sentences = tuple(sentences) if sentences is not None else load_haystack()
    counts = sentence_token_counts(tokenizer, sentences)
    cells = [(n, d) for n in lengths(length_tokens) for d in DEPTHS]
    try:
        made = [make_row(tokenizer, *cells[i % len(cells)], seed, i // len(cells), sentences,
                         counts) for i in range(num_samples)]
    except ValueError as e:  # the shortest length cannot hold the prompt around the haystack
        raise ValueError(f"--suite niah --synthetic_length {length_tokens}: the grid's "
                         f"shortest prompts ({lengths(length_tokens)[0]} tokens, a quarter) "
                         f"are too short ({e}); raise --synthetic_length") from e
    return rows.check_rows(((f"row {i}", r) for i, r in enumerate(made)), row_schema(DATASET),
                           "needle-in-a-haystack grid", "a bug in experiments/suites/niah.py's "
                           "generator: report it")


def row_schema(dataset: str) -> rows.Schema:
    return rows.longbench_schema(dataset, PASSKEY.template)


def _load(settings: RowSettings, tokenizer: Tokenizer, chat, datasets, num_samples):
    return {DATASET: make_rows(tokenizer, num_samples or len(DEPTHS) * len(FRACTIONS),
                               settings.synthetic_length, settings.seed)} if datasets else {}


def _checksums(settings: RowSettings, datasets: Sequence[str]) -> dict[str, str]:
    """The task, the grid and the haystack the rows are made from."""
    from experiments.predictions import config_hash
    from experiments.run_folder import files_fingerprint

    made_of = {"task": repr(PASSKEY), "depths": DEPTHS, "fractions": FRACTIONS,
               "haystack": files_fingerprint(haystack_dir())}
    return {d: config_hash(made_of) for d in datasets}


SUITE = Suite(
    name="niah", title="needle in a haystack", tasks=(DATASET,), load=_load,
    row_schema=row_schema, prompt=lambda row, task: PASSKEY.template.format(**row),
    uses_chat_template=lambda task: True,
    answer_prefix=lambda task, row=None: PASSKEY.answer_prefix,
    max_new_tokens=lambda task: PASSKEY.max_new_tokens,
    score_row=lambda task, pred, answers, classes: metrics.ROW_METRICS[PASSKEY.metric](
        pred, rows.references(answers, task)),  # a blank answer raises
    checksums=_checksums, default_datasets=lambda settings: [DATASET],
    identity=lambda s: {"synthetic_length": s.synthetic_length, "seed": s.seed},
    num_samples=len(DEPTHS) * len(FRACTIONS),
)
