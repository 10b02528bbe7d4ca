"""The LongBench v1 prediction protocol (THUDM/LongBench `LongBench/pred.py`), model-agnostic.

For each row, pred.py does, in this order:

1. `prompt = dataset2prompt[dataset].format(**row)`;
2. tokenize the raw prompt; if it has more than `max_length` tokens, keep the first and last
   `half = max_length // 2` tokens, decode the two halves separately (special tokens skipped)
   and concatenate the two strings;
3. wrap the (possibly truncated) text in the chat template, except for trec, triviaqa, samsum,
   lsht, lcc and repobench-p;
4. tokenize again, special tokens added (`tokenizer(prompt)`, so a BOS too), and generate
   greedily for `dataset2maxlen[dataset]` tokens; samsum also stops at the "\\n" token (and
   must emit at least one token).

The chat template is applied after truncation, so it is never cut. Synthetic tasks
(`experiments.synthetic`) go through the same steps with their own template, and their answer
prefix is appended after the chat template. RULER tasks (`experiments.ruler`) do too: the
row's `input` is the prompt (RULER's own template, already filled), the chat template wraps
it, and the row's `answer_prefix` follows, as RULER's call_api.py sends `input + answer_prefix`.
The tokenizer is any object with `encode(text) -> list[int]` and `decode(ids) -> str` (decode
should skip special tokens, as pred.py's `skip_special_tokens=True` does;
`dge_jax.runtime.tokenizer.Tokenizer` qualifies).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Protocol

from experiments import longbench_config as config
from experiments import rows, ruler, synthetic

DATA_DIR_ENV = "DGE_LONGBENCH_DIR"
ROW_KEYS = rows.LONGBENCH_KEYS
OFFICIAL_FIX = "fix the row or re-download the official file"


class Tokenizer(Protocol):
    """Text <-> token ids of the model under test."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _check_dataset(dataset: str) -> None:
    if dataset not in config.DATASET2PROMPT and dataset not in synthetic.TASKS and \
            dataset not in ruler.TASKS:
        raise ValueError(
            f"unknown dataset {dataset!r}; LongBench: {list(config.ALL_TASKS)}, "
            f"synthetic: {list(synthetic.TASKS)}, RULER: {list(ruler.TASKS)}"
        )


def build_prompt(row: dict, dataset: str) -> str:
    """The raw prompt of a row: the dataset's template filled with the row's fields.

    Official templates for LongBench tasks, `synthetic.TASKS[...].template` for synthetic ones;
    a RULER row's `input` is its prompt already.
    """
    _check_dataset(dataset)
    if dataset in config.DATASET2PROMPT:
        return config.DATASET2PROMPT[dataset].format(**row)
    if dataset in ruler.TASKS:
        return row["input"]
    return synthetic.TASKS[dataset].template.format(**row)


def _halves(token_ids: Sequence[int], max_length: int) -> tuple[list[int], list[int]] | None:
    """(first half, last half) when `token_ids` is longer than `max_length`, else None."""
    if max_length < 2:
        # pred.py would compute half = 0 and keep everything (ids[-0:] is the whole list).
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    if len(token_ids) <= max_length:
        return None
    half = max_length // 2
    return list(token_ids[:half]), list(token_ids[-half:])


def truncate_middle(token_ids: Sequence[int], max_length: int) -> list[int]:
    """The ids themselves if they fit, else the first and last max_length // 2 of them.

    With an odd `max_length` the result has max_length - 1 ids, as in pred.py.
    """
    halves = _halves(token_ids, max_length)
    return list(token_ids) if halves is None else halves[0] + halves[1]


def truncate_prompt(prompt: str, tokenizer: Tokenizer, max_length: int) -> tuple[str, int, bool]:
    """(prompt cut in the middle to `max_length` tokens, its original token count, cut or not).

    The halves are decoded separately and the strings concatenated, exactly as pred.py does;
    decoding the joined ids can differ at the seam (e.g. a dropped leading space).
    """
    ids = tokenizer.encode(prompt)
    halves = _halves(ids, max_length)
    if halves is None:
        return prompt, len(ids), False
    return tokenizer.decode(halves[0]) + tokenizer.decode(halves[1]), len(ids), True


def uses_chat_template(dataset: str) -> bool:
    """False for the six tasks pred.py feeds without a chat template, True otherwise."""
    return dataset not in config.NO_CHAT_TEMPLATE


def answer_prefix(dataset: str, row: dict | None = None) -> str:
    """Text appended after the chat template: "" for LongBench, the task's prefix if synthetic,
    the row's own `answer_prefix` for RULER (it names the row's query)."""
    if dataset in ruler.TASKS:
        if row is None:
            raise ValueError(f"{dataset}: a RULER answer prefix belongs to a row; pass it")
        return row["answer_prefix"]
    return synthetic.TASKS[dataset].answer_prefix if dataset in synthetic.TASKS else ""


def max_new_tokens(dataset: str) -> int:
    """Generation length: dataset2maxlen for LongBench, the task's own for synthetic tasks,
    RULER's tokens_to_generate for RULER tasks."""
    _check_dataset(dataset)
    if dataset in config.DATASET2MAXLEN:
        return config.DATASET2MAXLEN[dataset]
    if dataset in ruler.TASKS:
        return ruler.max_new_tokens(dataset)
    return synthetic.max_new_tokens(dataset)


@dataclasses.dataclass(frozen=True)
class PreparedSample:
    """The model input text of one row and how it was obtained.

    `text` is what the generator tokenizes; `num_prompt_tokens` counts the raw prompt before
    truncation and chat template; `truncated` says whether the middle was cut.
    """

    text: str
    num_prompt_tokens: int
    truncated: bool


def prepare_sample(
    row: dict,
    dataset: str,
    tokenizer: Tokenizer,
    max_length: int,
    chat: Callable[[str], str],
    with_answer_prefix: bool = True,
) -> PreparedSample:
    """Prompt -> middle truncation on its tokens -> chat template (not for the six) -> prefix.

    `chat(prompt)` renders one user turn with the generation prompt, e.g.
    `dge_jax.runtime.tokenizer.Tokenizer.apply_chat_template`; pass `lambda p: p` for a base model.
    `with_answer_prefix=False` ends the prompt at the chat template's generation prompt, so
    the model starts its answer unprompted (an ablation: the first drafted tokens are then
    the model's own preamble, e.g. "The pass key is", rather than the answer itself).
    """
    prompt = build_prompt(row, dataset)
    text, num_tokens, truncated = truncate_prompt(prompt, tokenizer, max_length)
    if uses_chat_template(dataset):
        text = chat(text)
    prefix = answer_prefix(dataset, row) if with_answer_prefix else ""
    return PreparedSample(text + prefix, num_tokens, truncated)


@dataclasses.dataclass(frozen=True)
class StopRule:
    """When generation stops besides EOS and the length limit.

    pred.py, samsum only: `eos_token_id=[eos, tokenizer.encode("\\n")[-1]]` and
    `min_length=context_length + 1`, so EOS (the newline included) is banned for the first token.
    The exact rule is token level (`extra_eos_ids`): a token that merely contains "\\n" (e.g.
    ".\\n" in some vocabularies) does not stop. `stop_strings` is the same rule for generators
    that work on text, and may stop earlier than pred.py on such tokens.
    """

    stop_strings: tuple[str, ...] = ()
    min_new_tokens: int = 0

    def extra_eos_ids(self, tokenizer: Tokenizer) -> tuple[int, ...]:
        """Ids to treat as EOS: the last id of `encode(s)` for each stop string, as pred.py."""
        return tuple(tokenizer.encode(s)[-1] for s in self.stop_strings)


def stop_rule(dataset: str) -> StopRule:
    """The official stop rule of a dataset: newline for samsum, nothing extra otherwise (RULER's
    default stop_words are empty too)."""
    _check_dataset(dataset)
    if dataset == "samsum":
        return StopRule(stop_strings=("\n",), min_new_tokens=1)
    return StopRule()


def resolve_data_dir(path: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder of `{dataset}.jsonl` files: `path`, else $DGE_LONGBENCH_DIR; it must exist."""
    if path is None:
        path = os.environ.get(DATA_DIR_ENV)
        if not path:
            raise FileNotFoundError(
                f"no LongBench data folder: set {DATA_DIR_ENV} (or pass the runner's data-dir "
                f"flag) to a folder of {{dataset}}.jsonl files in the official schema"
            )
    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"LongBench data folder {folder} does not exist; set {DATA_DIR_ENV} (or the runner's "
            f"data-dir flag) to a folder of {{dataset}}.jsonl files"
        )
    return folder


def row_schema(dataset: str) -> rows.Schema:
    """The strict schema of a dataset's rows: official LongBench, the synthetic task's, or
    RULER's (of its files and generated rows, before `ruler.runner_rows`)."""
    _check_dataset(dataset)
    if dataset in ruler.TASKS:
        return rows.RULER_SCHEMA
    if dataset in synthetic.TASKS:
        return synthetic.row_schema(dataset)
    return rows.longbench_schema(dataset, config.DATASET2PROMPT[dataset],
                                 needs_classes=config.DATASET2METRIC[dataset] == "classification")


def load_rows(
    data_dir: str | os.PathLike | None, dataset: str, num_samples: int | None = None
) -> list[dict]:
    """The first `num_samples` rows (all if None) of `{data_dir}/{dataset}.jsonl`.

    `data_dir=None` reads $DGE_LONGBENCH_DIR. Every row of the file is checked against
    `row_schema(dataset)` (types of the official keys, unique `_id`s, the file's task), so a bad
    row is a `rows.RowError` naming the file, line and field, not a silently wrong score.
    """
    path = resolve_data_dir(data_dir) / f"{dataset}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: put the official {dataset}.jsonl in the folder named by "
            f"{DATA_DIR_ENV} (or the runner's data-dir flag)"
        )
    checked = rows.read_jsonl(path, row_schema(dataset), OFFICIAL_FIX)
    return checked if num_samples is None else checked[:num_samples]
