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

The chat template is applied after truncation, so it is never cut. A model whose tokenizer
has no chat template (a base model) is prompted with the raw prompt in step 3, its answer
prefix after it, never a made-up template (`dge_jax.checkpoints.tokenizer.prompt_renderer`, the
one place that picks the format). What differs per dataset
(template, chat template or not, answer prefix, generation length, stop rule) is its suite's
answer (`experiments.suites`). Synthetic tasks (`experiments.suites.synthetic`) go through the
same steps with their own template, and their answer prefix is appended after the chat
template. RULER tasks (`experiments.suites.ruler`) do too: the
row's `input` is the prompt (RULER's own template, already filled), the chat template wraps
it, and the row's `answer_prefix` follows, as RULER's call_api.py sends `input + answer_prefix`.
The tokenizer is any object with `encode(text) -> list[int]` and `decode(ids) -> str` (decode
should skip special tokens, as pred.py's `skip_special_tokens=True` does;
`dge_jax.checkpoints.tokenizer.Tokenizer` qualifies).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from dge_jax.checkpoints.tokenizer import RAW_PROMPT, prompt_format, prompt_renderer
from experiments import rows, suites

# LongBench's file folder and schema (`experiments.suites.longbench`), named here too: this
# module is the LongBench protocol, and its users (tests, benchmarks) read them from it.
from experiments.suites.base import StopRule, Tokenizer  # noqa: F401 (this module's names)
from experiments.suites.longbench import (  # noqa: F401 (this module's names)
    DATA_DIR_ENV,
    OFFICIAL_FIX,
    ROW_KEYS,
    load_rows,
    resolve_data_dir,
)


def build_prompt(row: dict, dataset: str) -> str:
    """The raw prompt of a row, by its suite: the dataset's official template filled with the
    row's fields for LongBench, the task's template for synthetic ones; a RULER row's `input`
    is its prompt already."""
    return suites.for_dataset(dataset).prompt(row, dataset)


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
    """False for the six LongBench tasks pred.py feeds without a chat template, True
    otherwise (the suite says)."""
    return suites.for_dataset(dataset).uses_chat_template(dataset)


def answer_prefix(dataset: str, row: dict | None = None) -> str:
    """Text appended after the chat template: "" for LongBench, the task's prefix if synthetic,
    the row's own `answer_prefix` for RULER (it names the row's query)."""
    return suites.for_dataset(dataset).answer_prefix(dataset, row)


def max_new_tokens(dataset: str, row: dict | None = None) -> int:
    """Generation length: dataset2maxlen for LongBench, the task's own for synthetic tasks,
    RULER's tokens_to_generate for RULER tasks, the row's own where a suite's rows carry one
    (kvpress's `max_new_tokens` column; then `row` is needed)."""
    suite = suites.for_dataset(dataset)
    if suite.row_max_new_tokens is not None:
        if row is None:
            raise ValueError(f"{dataset}: the generation length belongs to a row; pass it")
        return suite.row_max_new_tokens(row)
    return suite.max_new_tokens(dataset)


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

    `chat(prompt)` renders the prompt as the model is prompted:
    `dge_jax.checkpoints.tokenizer.prompt_renderer(tokenizer)` (one user turn of its chat template
    with the generation prompt, or the raw prompt for a model without a template).
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


def model_sample(row: dict, dataset: str, tokenizer, max_length: int,
                 with_answer_prefix: bool = True) -> PreparedSample:
    """A row as the runner feeds it to the model: `prepare_sample` in the model's prompt
    format (`prompt_renderer`: its chat template, or the raw prompt without one)."""
    return prepare_sample(row, dataset, tokenizer, max_length, prompt_renderer(tokenizer),
                          with_answer_prefix)


def prompt_format_note(tokenizer) -> str:
    """How a model's prompts are rendered, in words for its run folder and results.md: the
    chat template and where it was read from, or the raw prompt (`prompt_format`)."""
    if prompt_format(tokenizer) == RAW_PROMPT:
        return RAW_PROMPT
    return f"chat template from {tokenizer.chat_template_source}"


def stop_rule(dataset: str) -> StopRule:
    """The official stop rule of a dataset: newline for samsum, nothing extra otherwise (RULER's
    default stop_words are empty too)."""
    return suites.for_dataset(dataset).stop_rule(dataset)


def row_schema(dataset: str) -> rows.Schema:
    """The strict schema of a dataset's rows: official LongBench, the synthetic task's, or
    RULER's (of its files and generated rows, before `ruler.runner_rows`)."""
    return suites.for_dataset(dataset).row_schema(dataset)
