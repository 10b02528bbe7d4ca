"""Hostile inputs to `python -m experiments.longbench` (issue #28), one test per defect.

Swapped weights of the same shapes, empty or malformed list flags, two runners in one folder,
flags that fail only after the folder is claimed, tracebacks where one line is promised
(unwritable folder, full disk, Ctrl-C, --help), an empty data file, and the names scripts and
folders gave the rules before they were called rules. Most runs call the
runner in-process (`run_inprocess`: the same `main`, without the interpreter start-up and
with the compiled code kept), on the tiny random Llama of tests/tiny_model.py, one synthetic
sample of 256 tokens; the few that need what a shell sees (a real SIGINT, --help's exit
status) run a subprocess with this checkout first on PYTHONPATH.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from tiny_model import build_tiny_llama

from experiments import run_folder
from experiments.predictions import PREDICTIONS_FILE

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 600


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def cheap_args(model_dir, out_dir, *extra: str) -> list[str]:
    """A run of a few seconds: one synthetic passkey sample of 256 tokens, FullKV and SnapKV
    at budget 16 (window 4) before decoding."""
    return ["--model", str(model_dir), "--datasets", "passkey", "--num_samples", "1",
            "--synthetic_length", "256", "--rules", "full,snapkv", "--timings", "prefill",
            "--budgets", "16", "--window", "4", "--out_dir", str(out_dir), *extra]


@pytest.fixture
def run_inprocess(monkeypatch, capsys):
    """Calls the runner's `main` as `python -m experiments.longbench *args` would; returns
    (exit status, stdout, stderr). Flags are reset to their defaults first."""
    import tqdm
    from absl import flags

    from experiments import longbench

    # No progress bar on stderr (TQDM_DISABLE is read when tqdm is first imported).
    monkeypatch.setattr(tqdm, "tqdm", functools.partial(tqdm.tqdm, disable=True))

    def run(*args: str) -> tuple[int, str, str]:
        flags.FLAGS.unparse_flags()
        monkeypatch.setattr(sys, "argv", ["longbench.py", *args])
        capsys.readouterr()
        try:
            longbench.main()
            code = 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code
        finally:  # the flags are process-wide: leave none parsed for the next test
            flags.FLAGS.unparse_flags()
        out, err = capsys.readouterr()
        return code, out, err

    return run


def subprocess_env(tmp_path) -> dict:
    """This checkout first on PYTHONPATH (the installed package may point at another one)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu", TQDM_DISABLE="1",
                MPLCONFIGDIR=str(tmp_path / "mpl"))


def one_error_line(code: int, err: str, status: int, *needles: str) -> str:
    """The run ended with `status` and exactly one stderr line, `error: ...` holding needles."""
    lines = err.strip().splitlines()
    assert code == status and len(lines) == 1 and lines[0].startswith("error: "), (
        f"exit {code}, stderr:\n{err[-3000:]}")
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def read_lines(out_dir: pathlib.Path) -> list[dict]:
    path = out_dir / PREDICTIONS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


# 1. The model fingerprint sees weight contents, not only sizes.


def test_resaved_weights_of_the_same_shapes_change_the_fingerprint(model_dir, tmp_path):
    other = build_tiny_llama(tmp_path / "other", seed=1)
    weights = "model.safetensors"
    assert (other / weights).stat().st_size == (model_dir / weights).stat().st_size
    assert (other / weights).read_bytes() != (model_dir / weights).read_bytes()
    assert run_folder.files_fingerprint(other) != run_folder.files_fingerprint(model_dir)


def test_large_weight_files_are_fingerprinted_by_header_and_sampled_blocks(tmp_path):
    size = run_folder.FULL_HASH_LIMIT + (1 << 20)
    header = json.dumps({"w": {"dtype": "F32", "shape": [size // 4 - 1024],
                               "data_offsets": [0, size - 1024]}}).encode()
    path = tmp_path / "model.safetensors"
    with path.open("wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(size)  # sparse: zeros past the header

    def fingerprint_with(offset: int, data: bytes) -> str:
        with path.open("r+b") as f:
            f.seek(offset)
            old = f.read(len(data))
            f.seek(offset)
            f.write(data)
        try:
            return run_folder.files_fingerprint(tmp_path)
        finally:
            with path.open("r+b") as f:
                f.seek(offset)
                f.write(old)

    base = run_folder.files_fingerprint(tmp_path)
    step = (size - run_folder.SAMPLE_BLOCK) // (run_folder.SAMPLED_BLOCKS - 1)
    assert fingerprint_with(step * 7 + 100, b"\x01") != base  # inside a sampled block
    assert fingerprint_with(size - 1, b"\x01") != base  # the last byte is sampled
    assert fingerprint_with(12, b"X") != base  # the header
    # The documented limit: a change between two sampled blocks goes unseen.
    assert fingerprint_with(step * 7 + run_folder.SAMPLE_BLOCK + 100, b"\x01") == base
    assert run_folder.files_fingerprint(tmp_path) == base


def test_swapped_weights_do_not_resume_into_the_old_folder(model_dir, run_inprocess, tmp_path):
    """A checkpoint re-saved in place with other values of the same shapes used to resume
    into the folder of the old weights, mixing two models in one table."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    out = tmp_path / "out"
    code, _, err = run_inprocess(*cheap_args(model, out, "--rules", "full"))
    assert code == 0, err
    before = read_lines(out)
    other = build_tiny_llama(tmp_path / "other", seed=1)
    shutil.copy(other / "model.safetensors", model / "model.safetensors")
    code, _, err = run_inprocess(*cheap_args(model, out, "--rules", "full"))
    one_error_line(code, err, 2, "another configuration", "model_files")
    assert read_lines(out) == before


def test_a_folder_fingerprinted_by_size_is_not_resumed(tmp_path):
    """Folders written before weights were fingerprinted by content cannot be checked against
    a checkpoint: they are refused (a run without --out_dir gets a new folder), saying why."""
    extent = {"datasets": ["passkey"], "cells": ["full"], "num_samples": 1}
    run_folder.open_run(tmp_path, {"model_files": "by-size"}, {}, extent, "old runner")
    with pytest.raises(run_folder.RunFolderError, match="by size"):
        run_folder.open_run(tmp_path, {"model_files": "by-content"}, {}, extent, "new runner")


# 2. Every list flag is checked: empty, empty items, non-integers, repeats.


@pytest.mark.parametrize(("flag", "value", "needles"), [
    ("--budgets", "", ("--budgets", "empty")),
    ("--budgets", "64,abc", ("--budgets", "'abc'")),
    ("--budgets", "64,,128", ("--budgets", "empty item")),
    ("--budgets", "64,-1", ("--budgets", "'-1'")),
    ("--budgets", "64,64", ("--budgets", "'64'", "twice")),
    ("--k", "2.5", ("--k", "'2.5'")),
    ("--k", "", ("--k", "empty")),
    ("--rules", "", ("--rules", "empty")),
    ("--rules", "full,,snapkv", ("--rules", "empty item")),
    ("--timings", "", ("--timings", "empty")),
    ("--datasets", "", ("--datasets", "empty")),
    ("--datasets", "passkey,", ("--datasets", "empty item")),
    ("--decode_budgets", "32,x", ("--decode_budgets", "'x'")),
    ("--intervals", "", ("--intervals", "empty")),
])
def test_list_flags_are_checked(model_dir, run_inprocess, tmp_path, flag, value, needles):
    """`--budgets ""` used to run FullKV alone ("1 cells x 1 samples"), dropping snapkv
    without a word; `--budgets 64,abc` ended in int()'s message, naming no flag."""
    out = tmp_path / "out"
    code, _, err = run_inprocess(*cheap_args(model_dir, out), flag, value)
    one_error_line(code, err, 2, *needles)
    assert not out.exists(), "a refused command claimed the folder"


# 4. Every flag is checked before the folder is claimed.


def test_bad_flags_are_refused_before_the_folder_is_claimed(model_dir, run_inprocess,
                                                             tmp_path):
    """--window 0, --batch_size 0, --chunk 0 (a ZeroDivisionError traceback) used to fail
    after config.json was written, and the corrected rerun was then refused as "another
    configuration"."""
    out = tmp_path / "out"
    for extra, needles in [
        (("--window", "0"), ("window", "snapkv/prefill/b16")),
        (("--kernel", "4"), ("kernel",)),
        (("--batch_size", "0"), ("--batch_size",)),
        (("--chunk", "0"), ("--chunk",)),
        (("--num_samples", "0"), ("--num_samples",)),
        (("--max_length", "1"), ("--max_length",)),
        (("--synthetic_length", "0"), ("--synthetic_length",)),
        (("--draft_weight", "-1"), ("--draft_weight",)),
        (("--adaptive_rule", "entropy", "--k_max", "0"), ("--k_max",)),
        (("--budgets", "2"), ("budget 2 is smaller",)),  # below the protected window of 4
        (("--timings", "dge", "--k", "20", "--budgets", "64"), ("k=20", "max_new_tokens=16")),
        (("--datasets", "nope"), ("unknown synthetic tasks",)),
    ]:
        code, _, err = run_inprocess(*cheap_args(model_dir, out), *extra)
        one_error_line(code, err, 2, *needles)
        assert not out.exists(), f"{extra} claimed the folder"
    code, _, err = run_inprocess(*cheap_args(model_dir, out))  # the corrected command runs
    assert code == 0, err
    assert {r["cell"] for r in read_lines(out)} == {"full", "snapkv/prefill/b16"}


# 3. One runner per folder.

HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, f"{os.getpid()}\\n".encode())
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_second_runner_in_a_busy_folder_is_refused(model_dir, run_inprocess, tmp_path):
    """Two runners in one --out_dir used to both compute everything and write every line
    twice. The runner holds an flock on OUT_DIR/.lock (with its pid) for the whole run; a
    second one is refused naming the holder, and the report reads the folder regardless."""
    out = tmp_path / "out"
    code, _, err = run_inprocess(*cheap_args(model_dir, out, "--rules", "full"))
    assert code == 0, err
    before = (out / PREDICTIONS_FILE).read_bytes()
    config = (out / "config.json").read_bytes()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out / ".lock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        for rules in ("full", "full,snapkv"):  # nothing to do / something to do
            code, _, err = run_inprocess(*cheap_args(model_dir, out, "--rules", rules,
                                                     "--extend"))
            one_error_line(code, err, 1, str(out), f"pid {holder.pid}")
        assert (out / PREDICTIONS_FILE).read_bytes() == before
        assert (out / "config.json").read_bytes() == config
        from experiments import report

        assert report.main([str(out)]) == 0  # reading needs no lock
    finally:
        holder.communicate("", timeout=60)
    code, _, err = run_inprocess(*cheap_args(model_dir, out, "--rules", "full,snapkv",
                                             "--extend"))
    assert code == 0, err
    keys = [r["key"] for r in read_lines(out)]
    assert len(keys) == len(set(keys)) == 2
    assert not (out / ".lock").exists(), "the lock file outlived the run"


# 5. One line, not a traceback: help, flag mistakes, an unwritable folder, a full disk, Ctrl-C.


def test_help_exits_0(run_inprocess, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.longbench", "--help"], cwd=REPO,
                          env=subprocess_env(tmp_path), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--budgets" in proc.stdout and "python -m experiments.longbench" in proc.stdout
    code, out, _ = run_inprocess("-h")  # (in-process, __main__ is pytest: no flags listed)
    assert code == 0 and "--helpfull" in out
    code, out, _ = run_inprocess("--helpfull")
    assert code == 0 and "--budgets" in out


@pytest.mark.parametrize(("args", "needles"), [
    (("--batch_size", "abc"), ("--batch_size", "abc", "--help")),
    (("--no_such_flag",), ("no_such_flag", "--help")),
    (("--budgets", "64,", "128"), ("'128'",)),  # a space after the comma
])
def test_flag_mistakes_are_one_line(run_inprocess, tmp_path, args, needles):
    code, _, err = run_inprocess("--out_dir", str(tmp_path / "out"), *args)
    one_error_line(code, err, 2, *needles)
    assert not (tmp_path / "out").exists()


def test_an_unwritable_out_dir_is_one_line(model_dir, run_inprocess):
    """An OSError (here EPERM: sysfs takes no folders, even from root) used to be a
    traceback."""
    out = pathlib.Path("/sys/dge_jax_test/run")
    if not pathlib.Path("/sys/kernel").is_dir():
        pytest.skip("no sysfs to stand for an unwritable folder")
    code, _, err = run_inprocess(*cheap_args(model_dir, out, "--rules", "full"))
    one_error_line(code, err, 1, "/sys/dge_jax_test", "--out_dir")


def test_a_full_disk_is_one_line(model_dir, run_inprocess, tmp_path, monkeypatch):
    import errno

    from experiments import predictions

    def no_space(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(predictions, "_write_all", no_space)
    out = tmp_path / "out"
    code, _, err = run_inprocess(*cheap_args(model_dir, out, "--rules", "full"))
    one_error_line(code, err, 1, "No space left on device", "rerun")


def test_ctrl_c_is_one_line_saying_what_is_saved(model_dir, tmp_path):
    """SIGINT used to print 38 lines of traceback; now one line with the number of saved
    predictions (rerunning resumes), exit status 130. Enough samples that the run cannot end
    before the signal on a loaded machine."""
    import signal

    SAMPLES = 400
    import time

    out = tmp_path / "out"
    args = [sys.executable, "-m", "experiments.longbench",
            *cheap_args(model_dir, out, "--rules", "full", "--num_samples", str(SAMPLES),
                        "--batch_size", "1")]
    # pytest-xdist's workers ignore SIGINT, and an ignored signal stays ignored across exec:
    # the runner would then never see the Ctrl-C. Give it the default disposition back.
    proc = subprocess.Popen(args, cwd=REPO, env=subprocess_env(tmp_path), text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    path = out / PREDICTIONS_FILE
    deadline = time.time() + TIMEOUT
    try:
        while not (path.is_file() and path.read_bytes().endswith(b"\n")) and \
                proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    saved = len(read_lines(out))
    assert 1 <= saved < SAMPLES
    one_error_line(proc.returncode, err, 130, f"{saved} predictions", "rerun")


# 6. An empty data file, and data that changed under a folder.


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_an_empty_data_file_is_refused_before_the_folder_is_claimed(model_dir, run_inprocess,
                                                                    tmp_path, content):
    """It used to claim a folder with the empty file's checksum, then fail blaming the
    predictions."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "trec.jsonl").write_text(content)
    out = tmp_path / "out"
    code, _, err = run_inprocess("--model", str(model_dir), "--suite", "longbench",
                                 "--data_dir", str(data), "--datasets", "trec",
                                 "--rules", "full", "--out_dir", str(out))
    one_error_line(code, err, 2, str(data / "trec.jsonl"), "no rows")
    assert not out.exists()


def test_changed_data_gives_a_fix_that_works(tmp_path):
    """The advice was "leave --out_dir out", but the default folder is named by the
    configuration, not the data: it is this same folder."""
    identity = {"model": "m"}
    extent = {"datasets": ["trec"], "cells": ["full"], "num_samples": 1}
    run_folder.open_run(tmp_path, identity, {"trec": "a" * 64}, extent, "first")
    with pytest.raises(run_folder.RunFolderError) as refused:
        run_folder.open_run(tmp_path, identity, {"trec": "b" * 64}, extent, "second")
    message = str(refused.value)
    assert "trec" in message and "leave it out" not in message
    assert "another --out_dir" in message and "restore" in message


# 7. What the runner and its folders called the rules before they were called rules.


def test_methods_the_old_name_of_rules_is_refused(model_dir, run_inprocess, tmp_path):
    """--methods, the flag's name in earlier scripts, is an unknown flag in 0.1: refused in
    one line before the folder is claimed."""
    out = tmp_path / "out"
    code, _, err = run_inprocess(*cheap_args(model_dir, out), "--methods", "full")
    assert code != 0 and "methods" in err, err
    assert not out.exists(), "a refused command claimed the folder"


def test_a_folder_of_the_runner_before_the_rename_resumes_without_recomputing(
        model_dir, run_inprocess, tmp_path, monkeypatch):
    """Until the scoring rules were called rules, the runner stored their options under the
    identity key "policy_options", which config.json, the run id and every line's key (the
    hash of its cell's configuration) all hold. Such a folder, written here by hand as that
    runner wrote it (the same keys and hashes, checked against one it wrote), resumes under
    and no prediction is computed again."""
    import hashlib

    import dge_jax
    import dge_jax.generation
    from experiments.predictions import config_hash, prediction_key

    identity = {
        "model": str(model_dir), "model_files": run_folder.files_fingerprint(model_dir),
        "dtype": "float32", "suite": "synthetic", "protocol": "longbench-v1-pred.py",
        "dge_jax": dge_jax.__version__, "max_length": 1024, "chunk": 512, "batch_size": 4,
        "synthetic_length": 256, "seed": 0,
        "policy_options": {"window": 4, "kernel": 7, "pooling": "max", "gqa": "mean",
                           "gqa_before_pool": False},
        "draft_weight": 1.0, "ties": "later", "adaptive": None}
    run_id = config_hash(identity)
    sample = hashlib.sha1(b"passkey|256|0|0").hexdigest()  # the synthetic passkey row's _id
    lines = []
    for cell, options, ties in (("full", {}, None),
                                ("snapkv/prefill/b16", identity["policy_options"], "later")):
        cell_hash = config_hash({**identity, "cell": cell, "policy_options": options,
                                 "draft_weight": None, "ties": ties, "adaptive": None})
        lines.append({"key": prediction_key(cell_hash, "passkey", sample),
                      "config_hash": cell_hash, "run_id": run_id, "dataset": "passkey",
                      "sample_id": sample, "cell": cell, "pred": "0", "answers": ["1"],
                      "all_classes": None})
    out = tmp_path / "out"
    out.mkdir()
    extent = {"datasets": ["passkey"], "cells": ["full", "snapkv/prefill/b16"],
              "num_samples": 1}
    (out / "config.json").write_text(json.dumps({
        "format": 2, "run_id": run_id, "identity": identity, "data": {}, "extent": extent,
        "history": [{"command": "python -m experiments.longbench --methods full,snapkv",
                     "at": "2025-01-01T00:00:00+00:00", "extent": extent}]}, indent=2))
    written = "".join(json.dumps(line) + "\n" for line in lines)
    (out / PREDICTIONS_FILE).write_text(written)

    def generate_grid(*args, **kwargs):
        raise AssertionError("a prediction of the old folder was computed again")

    monkeypatch.setattr(dge_jax.generation, "generate_grid", generate_grid)
    code, stdout, err = run_inprocess(*cheap_args(model_dir, out), "--max_length", "1024")
    assert code == 0, err
    assert "(1 samples done" in stdout, stdout
    assert (out / PREDICTIONS_FILE).read_text() == written
    config = json.loads((out / "config.json").read_text())
    assert config["run_id"] == run_id and config["identity"] == identity
