"""The registry of suites: --suite's name -> `Suite`, and each dataset -> the suite it belongs to.

A suite is one module of this package that defines `SUITE = Suite(...)`
(`experiments.suites.base`); registering it is one import line below. Every other module asks
these values (`get`, `for_dataset`), never compares a suite's name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

from experiments.suites.base import Suite
from experiments.suites.infinitebench import SUITE as INFINITEBENCH  # noqa: F401 (registered)
from experiments.suites.kvpress import SUITE as KVPRESS  # noqa: F401 (registered below)
from experiments.suites.longbench import SUITE as LONGBENCH  # noqa: F401 (registered below)
from experiments.suites.longbench import average_scores as longbench_averages
from experiments.suites.longbench_v2 import SUITE as LONGBENCH_V2  # noqa: F401 (registered below)
from experiments.suites.loogle import SUITE as LOOGLE  # noqa: F401 (registered below)
from experiments.suites.niah import SUITE as NIAH  # noqa: F401 (registered below)
from experiments.suites.ruler import SUITE as RULER  # noqa: F401 (registered below)
from experiments.suites.synthetic import SUITE as SYNTHETIC

DEFAULT = SYNTHETIC.name  # the README's first command runs it (`python -m experiments.longbench`)


def _collect(namespace: Mapping[str, object]) -> Mapping[str, Suite]:
    """Every `Suite` imported above, by name (the default first, as --suite lists them),
    checked: one suite per name."""
    found: dict[str, Suite] = {}
    for value in namespace.values():
        if isinstance(value, Suite):
            if found.setdefault(value.name, value) is not value:
                raise ValueError(f"two suites are named {value.name!r}")
    first = {DEFAULT: found.pop(DEFAULT)}
    return MappingProxyType({**first, **found})


SUITES: Mapping[str, Suite] = _collect(dict(globals()))


def _datasets(suites: Mapping[str, Suite]) -> Mapping[str, Suite]:
    owner: dict[str, Suite] = {}
    for suite in suites.values():
        for dataset in suite.tasks:
            other = owner.setdefault(dataset, suite)
            if other is not suite:
                raise ValueError(f"dataset {dataset!r} is in suites {other.name} and {suite.name}")
    return MappingProxyType(owner)


DATASETS: Mapping[str, Suite] = _datasets(SUITES)


def get(name: str) -> Suite:
    """The suite named `name` (--suite's value)."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known: {list(SUITES)}")
    return SUITES[name]


def _by_prefix(dataset: str) -> Suite | None:
    """The suite whose `dataset_prefix` names `dataset` (`kvpress/<task>`), or None."""
    prefix, slash, _ = dataset.partition("/")
    if not slash:
        return None
    return next((s for s in SUITES.values() if s.dataset_prefix == prefix), None)


def for_dataset(dataset: str) -> Suite:
    """The suite a dataset belongs to (its task list, else its name's prefix); an unknown
    dataset raises naming every suite's."""
    suite = DATASETS.get(dataset) or _by_prefix(dataset)
    if suite is None:
        known = ", ".join(f"{s.title}: {list(s.tasks)}" if s.tasks else
                          f"{s.title}: {s.dataset_prefix}/<task>" for s in SUITES.values())
        raise ValueError(f"unknown dataset {dataset!r}; {known}")
    return suite


def _known(dataset: str) -> bool:
    return dataset in DATASETS or _by_prefix(dataset) is not None


def row_score(dataset: str, prediction: str, answers: Sequence[str],
              all_classes: Sequence[str] | None) -> float:
    """One row's score in [0, 1] by its suite's metric (LongBench's max over answers, the
    synthetic and RULER row metrics that see all of a row's answers at once)."""
    if not _known(dataset):
        raise ValueError(f"no metric for dataset {dataset!r}")
    return for_dataset(dataset).score_row(dataset, prediction, answers, all_classes)


def score_dataset(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | None = None,
) -> float:
    """100 * mean row score, rounded to 2 decimals: eval.py `scorer` (and RULER's
    `round(sum / n * 100, 2)`). `all_classes` is the dataset's class list (trec, lsht)."""
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answer lists")
    if not predictions:
        raise ValueError(f"no predictions to score for {dataset!r}")
    pairs = zip(predictions, answers, strict=True)
    total = sum(row_score(dataset, p, a, all_classes) for p, a in pairs)
    return round(100 * total / len(predictions), 2)


def summary(scores: Mapping[str, float]) -> dict:
    """The suites' own averages over `scores` (dataset -> score), e.g. LongBench's official
    ones when all 16 English tasks are there; {} when no suite has any."""
    out: dict = {}
    for suite in {for_dataset(d).name: for_dataset(d) for d in scores if _known(d)}.values():
        if suite.summary is not None:
            out.update(suite.summary({d: s for d, s in scores.items()
                                      if _known(d) and for_dataset(d) is suite}))
    return out


def average_scores(scores: Mapping[str, float]) -> dict:
    """LongBench's two English averages over the tasks present (`suites.longbench`); other
    suites' tasks are ignored, a name no suite knows raises."""
    unknown = sorted(d for d in scores if not _known(d))
    if unknown:
        raise ValueError(f"unknown tasks in scores: {unknown}")
    return longbench_averages(scores)
