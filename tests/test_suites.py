"""Suites behind one protocol (`experiments.suites`).

- The registry: every suite answers every question for every one of its tasks, a dataset
  belongs to one suite, and the runner's --suite choices are the registry's names with the
  default first.
- No module of experiments/ outside suites/ names a suite or a dataset in a string literal:
  they ask the suite value instead of comparing names.
- WORKSPACE.md's "Add a suite" recipe works as written: in a temporary copy of the
  repository, its python block saved as `experiments/suites/echo.py` and its registry line
  added, `python -m experiments.longbench --suite echo` runs on a tiny random model and
  `python -m experiments.report` scores it.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from experiments import suites
from experiments.suites.base import RowSettings, StopRule, Suite

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 900


def test_registry_maps_names_and_datasets():
    assert suites.DEFAULT in suites.SUITES
    assert {"synthetic", "longbench", "ruler"} <= set(suites.SUITES)
    for name, suite in suites.SUITES.items():
        assert isinstance(suite, Suite) and suite.name == name
        for task in suite.tasks:
            assert suites.for_dataset(task) is suite
            assert suite.max_new_tokens(task) > 0
            assert isinstance(suite.stop_rule(task), StopRule)
            assert isinstance(suite.uses_chat_template(task), bool)
            assert suite.row_schema(task) is not None
        assert isinstance(suite.identity(RowSettings()), dict)
    assert sum(len(s.tasks) for s in suites.SUITES.values()) == len(suites.DATASETS)
    with pytest.raises(ValueError, match="unknown dataset 'hotpot'"):
        suites.for_dataset("hotpot")
    with pytest.raises(ValueError, match="unknown suite"):
        suites.get("nope")


def test_run_identities_keep_their_recorded_keys():
    """What config.json fingerprints: the suites' entries are the ones earlier folders hold."""
    settings = RowSettings(data_dir=None, seed=3, synthetic_length=256, ruler_length=2048)
    assert suites.get("synthetic").identity(settings) == {"synthetic_length": 256, "seed": 3}
    assert suites.get("longbench").identity(settings) == {"synthetic_length": None,
                                                          "seed": None}
    assert suites.get("ruler").identity(settings) == {"synthetic_length": None, "seed": 3,
                                                      "ruler_length": 2048}


def test_runner_suite_choices_are_the_registry():
    from experiments.run_config import FLAGS

    flag = FLAGS["suite"]
    assert flag.default == suites.DEFAULT == "synthetic"
    # the default first, then the others by module name (the registry imports them sorted)
    assert flag.parser.enum_values == ["synthetic", "infinitebench", "kvpress", "longbench",
                                         "longbench_v2", "loogle", "niah", "ruler"]


def _string_literals(path: pathlib.Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_no_module_outside_suites_names_a_suite_or_dataset():
    """A literal equal to a suite's or a dataset's name (a comparison, a membership test, a
    table keyed by it) belongs in that suite's module; prose that mentions one is fine."""
    names = set(suites.SUITES) | set(suites.DATASETS)
    found = [f"{path.relative_to(REPO)}:{line}: {value!r}"
             for path in sorted((REPO / "experiments").glob("*.py"))
             for line, value in _string_literals(path) if value in names]
    assert not found, "suite or dataset named outside experiments/suites/:\n" + "\n".join(found)


def _add_a_suite_recipe() -> tuple[str, str, str]:
    """(module path, module source, registry line) of WORKSPACE.md's "Add a suite"."""
    text = (REPO / "WORKSPACE.md").read_text(encoding="utf-8")
    section = text[text.index("## Add a suite"):]
    section = section[:m.start()] if (m := re.search(r"^## ", section[3:], re.M)) else section
    source = re.search(r"^```python\n(.*?)^```", section, re.M | re.S).group(1)
    line = re.search(r"^```text\n(.*?)^```", section, re.M | re.S).group(1).strip()
    path = re.match(r"# (experiments/suites/\w+\.py)\n", source).group(1)
    return path, source, line


def _copy_repository(dest: pathlib.Path) -> pathlib.Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")
    for name in ("dge_jax", "models", "experiments"):
        shutil.copytree(REPO / name, dest / name, ignore=ignore)
    return dest


@pytest.mark.slow
def test_add_a_suite_recipe_runs_and_is_scored(tmp_path):
    from tiny_model import build_tiny_llama

    path, source, line = _add_a_suite_recipe()
    copy = _copy_repository(tmp_path / "repo")
    (copy / path).write_text(source, encoding="utf-8")
    registry = copy / "experiments/suites/__init__.py"
    text = registry.read_text(encoding="utf-8")
    last = [m.end() for m in re.finditer(r"^from experiments\.suites\.\w+ import SUITE.*\n",
                                         text, re.M)][-1]
    registry.write_text(text[:last] + line + "\n" + text[last:], encoding="utf-8")

    model = build_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(copy), JAX_PLATFORMS="cpu", TQDM_DISABLE="1",
               MPLCONFIGDIR=str(tmp_path / "mpl"))
    args = [sys.executable, "-m", "experiments.longbench", "--model", str(model),
            "--suite", "echo", "--rules", "full,snapkv", "--timings", "prefill",
            "--budgets", "16", "--window", "4", "--batch_size", "2", "--out_dir", str(out)]
    proc = subprocess.run(args, cwd=copy, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    assert {r["dataset"] for r in rows} == {"echo_word"}
    assert sorted(r["cell"] for r in rows) == ["full", "full", "snapkv/prefill/b16",
                                               "snapkv/prefill/b16"]
    config = json.loads((out / "config.json").read_text())
    assert config["identity"]["suite"] == "echo" and config["identity"]["seed"] == 0

    (out / "scores.json").unlink()
    proc = subprocess.run([sys.executable, "-m", "experiments.report", str(out)], cwd=copy,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scores = json.loads((out / "scores.json").read_text())
    assert set(scores["datasets"]["echo_word"]) == {"full", "snapkv/prefill/b16"}
    assert all(0 <= s <= 100 for s in scores["datasets"]["echo_word"].values())


def test_help_lists_the_runner_flags():
    """The flags live in experiments.run_config; `python -m experiments.longbench --help`
    lists them as before (they are key flags of the entry module)."""
    proc = subprocess.run([sys.executable, "-m", "experiments.longbench", "--help"], cwd=REPO,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("suite", "datasets", "budgets", "ruler_length", "synthetic_length", "mesh"):
        assert f"  --{name}:" in proc.stdout, name
    assert ("<synthetic|infinitebench|kvpress|longbench|longbench_v2|loogle|niah|ruler>"
            in proc.stdout)


def test_messages_that_list_suites_read_as_before():
    from absl import flags

    from experiments.run_config import UsageError, check_scalar_flags

    values = flags.FlagValues()
    for name, default in (("batch_size", 4), ("chunk", 512), ("num_samples", None),
                          ("max_length", None), ("synthetic_length", 512),
                          ("ruler_length", 4096), ("window", 8), ("kernel", 7),
                          ("k_max", 8)):
        flags.DEFINE_integer(name, default, "", flag_values=values)
    flags.DEFINE_float("draft_weight", 1.0, "", flag_values=values)
    flags.DEFINE_string("adaptive_rule", None, "", flag_values=values)
    flags.DEFINE_bool("answer_prefix", True, "", flag_values=values)
    values(["runner", "--noanswer_prefix"])
    with pytest.raises(UsageError) as e:
        check_scalar_flags(values, suites.get("longbench"))
    assert str(e.value) == ("--noanswer_prefix: LongBench prompts have no answer prefix; it "
                            "applies to --suite synthetic and --suite kvpress and --suite niah and "
                            "--suite ruler")
    check_scalar_flags(values, suites.get("ruler"))  # it has answer prefixes
