"""What a suite is: the `Suite` value the runner, protocol, metrics and report ask, never a name.

A suite is a frozen dataclass of data and functions (not a `typing.Protocol` a class
implements): one module builds one value in one expression, a missing member fails when that
module is imported rather than at a type check, members with a common answer (no extra stop
rule, names taken as given, no summary) have defaults, and the registry is a plain mapping of
values. This module imports nothing of the project besides `rows`, so every suite can import
it and nothing reaches back into `experiments.protocol`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from experiments import rows


class Tokenizer(Protocol):
    """Text <-> token ids of the model under test."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


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


@dataclasses.dataclass(frozen=True)
class RowSettings:
    """The runner's settings rows are made or read with (each suite reads the ones it uses):
    --data_dir, --seed, --synthetic_length, --ruler_length, --metric."""

    data_dir: str | None = None
    seed: int = 0
    synthetic_length: int = 512
    ruler_length: int = 4096
    metric: str | None = None


Chat = Callable[[str], str]
Loader = Callable[[RowSettings, Tokenizer, Chat, Sequence[str], int | None],
                  dict[str, list[dict]]]
RowScorer = Callable[[str, str, Sequence[str], Sequence[str] | None], float]


def no_stop_rule(dataset: str) -> StopRule:
    """EOS and the length limit only (every task but LongBench's samsum)."""
    return StopRule()


@dataclasses.dataclass(frozen=True)
class Suite:
    """Everything that differs between suites, asked for by dataset where it is per task.

    name: --suite's value, `runs/<name>/`, the run identity's "suite"; title: in messages;
    tasks: its dataset names (unique across suites: the registry maps a dataset to its suite);
    load(settings, tokenizer, chat, datasets, num_samples): rows per dataset in the runner's
    schema (_id, answers, all_classes, ...), checked strictly (`rows`): no blank answer, and
    whatever prompt, question, score_row and row_max_new_tokens assume of a row, so a bad
    row stops the run there, before its folder is written, never while prompting or scoring;
    row_schema(dataset): that strict schema; prompt(row, dataset): the raw prompt, before
    truncation; uses_chat_template(dataset): whether the chat template wraps it;
    answer_prefix(dataset, row): text after the chat template; max_new_tokens(dataset);
    stop_rule(dataset); score_row(dataset, prediction, answers, all_classes) in [0, 1];
    checksums(settings, datasets): sha256 of where each dataset's rows come from (the run
    folder records them); default_datasets(settings): what runs without --datasets;
    identity(settings): the run identity's suite-specific entries (their keys and order are
    what earlier run folders recorded); dataset_name: maps a command-line name to ours (None:
    names are taken as given and checked against `tasks`); num_samples: --num_samples'
    default (None: all rows); has_answer_prefix: whether --noanswer_prefix applies;
    summary(scores by dataset): extra averages for report (None: only the plain mean);
    dataset_prefix: datasets named `<prefix>/<task>` are this suite's though not in `tasks`
    (a suite whose tasks are whatever its data folder holds: kvpress); metrics: the names
    --metric accepts, one metric for every task (empty: the suite refuses --metric);
    with_metric(dataset, metric): the dataset's name under --metric (the metric travels in
    the name, so a report scores the run folder without the command line);
    row_max_new_tokens(row): a row's own generation length where rows carry one (None: the
    dataset's `max_new_tokens`); question(row, dataset): the tail of the raw prompt that is
    the question (None: what follows the row's `context` text; `experiments.context_protocols`);
    row_groups(row): the row's categories ({"difficulty": "hard", ...}), recorded on its
    prediction lines, by which the report breaks scores down (None: none).
    """

    name: str
    title: str
    tasks: tuple[str, ...]
    load: Loader
    row_schema: Callable[[str], rows.Schema]
    prompt: Callable[[dict, str], str]
    uses_chat_template: Callable[[str], bool]
    answer_prefix: Callable[[str, dict | None], str]
    max_new_tokens: Callable[[str], int]
    score_row: RowScorer
    checksums: Callable[[RowSettings, Sequence[str]], dict[str, str]]
    default_datasets: Callable[[RowSettings], list[str]]
    identity: Callable[[RowSettings], dict]
    stop_rule: Callable[[str], StopRule] = no_stop_rule
    dataset_name: Callable[[str], str] | None = None
    num_samples: int | None = None
    has_answer_prefix: bool = True
    summary: Callable[[Mapping[str, float]], dict] | None = None
    dataset_prefix: str | None = None
    metrics: tuple[str, ...] = ()
    with_metric: Callable[[str, str], str] | None = None
    row_max_new_tokens: Callable[[dict], int] | None = None
    question: Callable[[dict, str], str] | None = None
    row_groups: Callable[[dict], dict[str, str]] | None = None

    def resolve(self, names: Sequence[str], metric: str | None = None) -> list[str]:
        """The datasets named on the command line, as this suite names them (under --metric
        `metric`, where the suite takes one); unknown ones raise ValueError naming the known
        ones."""
        if metric is not None:
            self.check_metric(metric)
        if self.dataset_name is not None:
            names = [self.dataset_name(d) for d in names]
        else:
            unknown = [d for d in names if d not in self.tasks]
            if unknown:
                raise ValueError(f"unknown {self.name} tasks {unknown} in --datasets; known: "
                                 f"{sorted(self.tasks)}")
        if metric is None or self.with_metric is None:
            return list(names)
        return [self.with_metric(d, metric) for d in names]

    def check_metric(self, metric: str) -> None:
        """Refuses a --metric this suite does not take (ValueError naming what it takes)."""
        if not self.metrics:
            raise ValueError(f"--metric {metric}: {self.title} tasks have fixed metrics; "
                             "leave --metric out")
        if metric not in self.metrics:
            raise ValueError(f"--metric {metric!r} is not a {self.title} metric; known: "
                             f"{', '.join(self.metrics)}")
