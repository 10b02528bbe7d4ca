"""Several processes, one run (issue #32): JAX's multi-controller runtime on local CPU processes.

Fast tests: the variables `multihost.initialize` takes, how the runner splits batches, the
per-process prediction files, and the launcher's failure handling (on a plain command).
Slow tests (subprocesses through `python -m experiments.launch`):

- data-parallel: 2 processes of a synthetic run merge to the single-process run's predictions
  (same keys, same tokens), also after one process is killed mid-run and the run resumed by
  3 processes (then one process alone finds nothing missing);
- one model sharded across 2 processes x 4 CPU devices (an 8-device mesh): the same tokens and
  kept sets as one process with 8 devices, for FullKV and DGE(2)-SnapKV, through the library
  (tests/multihost_checks.py, which also counts the bytes each process reads) and the runner.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from tiny_model import build_tiny_llama

from dge_jax.distribution import multihost
from experiments import distributed, launch
from experiments.distributed import assign, batches_of
from experiments.predictions import PredictionStore, read_folder

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 600


def line(key: str, **extra) -> dict:
    return {"key": key, "config_hash": "h", "dataset": "d", "sample_id": key, "cell": "full",
            "pred": "p", "answers": ["a"], **extra}


# --- the variables --------------------------------------------------------------------------


@pytest.mark.parametrize("env, needle", [
    ({multihost.COORDINATOR: "127.0.0.1:1234"}, "without JAX_NUM_PROCESSES, JAX_PROCESS_ID"),
    ({multihost.COORDINATOR: "h:1", multihost.NUM_PROCESSES: "two",
      multihost.PROCESS_ID: "0"}, "JAX_NUM_PROCESSES='two' is not a process count"),
    ({multihost.COORDINATOR: "h:1", multihost.NUM_PROCESSES: "2",
      multihost.PROCESS_ID: "2"}, "JAX_PROCESS_ID=2 must be below JAX_NUM_PROCESSES=2"),
])
def test_initialize_refuses_incomplete_or_bad_variables(env, needle):
    with pytest.raises(ValueError, match=needle):
        multihost.initialize(env)


def test_distributed_without_a_cluster_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    done = subprocess.run(
        [sys.executable, "-m", "experiments.longbench", "--distributed", "--out_dir",
         str(tmp_path / "out")], cwd=REPO, env={**env, "JAX_PLATFORMS": "cpu"},
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "--distributed: no cluster to join" in done.stderr
    assert "python -m experiments.launch" in done.stderr
    assert not (tmp_path / "out").exists()


def test_fetch_and_broadcast_on_one_process():
    import jax.numpy as jnp

    x = jnp.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(multihost.fetch(x), np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(multihost.broadcast(np.array([1, 2])), [1, 2])
    multihost.barrier("alone")  # no peer: returns at once
    assert multihost.current() == multihost.Processes(0, 1)


# --- the split ------------------------------------------------------------------------------


def pending_rows(n: int, lengths=(8,)) -> list:
    return [({"_id": f"r{i}", "length": lengths[i % len(lengths)]}, ("cell",)) for i in range(n)]


def test_data_parallel_batches_are_one_process_batches_split_round_robin(monkeypatch):
    from experiments import protocol

    monkeypatch.setattr(protocol, "max_new_tokens", lambda dataset, row: row["length"])
    pending = {"a": pending_rows(7, lengths=(8, 16)), "b": pending_rows(5), "c": pending_rows(1)}
    alone = assign(pending, 2, distributed.ALONE)
    assert alone == {d: batches_of(d, p, 2) for d, p in pending.items()}
    ordered = [(d, b) for d, batches in alone.items() for b in batches]
    shares = [assign(pending, 2, distributed.Share("data", i, 3)) for i in range(3)]
    for i, work in enumerate(shares):
        mine = [(d, b) for d, batches in work.items() for b in batches]
        # every third batch of the run, counted across datasets, each exactly as one process
        # forms it (same rows together: the same left padding)
        assert mine == ordered[i::3]
    # model mode: every process runs every batch
    assert assign(pending, 2, distributed.Share("model", 1, 2)) == alone
    assert distributed.Share("model", 1, 2).writes is False
    assert distributed.Share("data", 1, 2).writes is True


# --- the prediction files -------------------------------------------------------------------


def test_each_process_writes_its_own_file_and_reads_every_file(tmp_path):
    first = PredictionStore(tmp_path, process=0, processes=2)
    second = PredictionStore(tmp_path, process=1, processes=2, tidy=False)
    first.append([line("a")])
    second.append([line("b"), line("c")])
    assert (tmp_path / "predictions.p0.jsonl").read_text().count("\n") == 1
    assert (tmp_path / "predictions.p1.jsonl").read_text().count("\n") == 2
    # a later run, under any process count, sees every line as done
    for store in (PredictionStore(tmp_path), PredictionStore(tmp_path, process=2, processes=3)):
        assert store.done == {"a", "b", "c"}
    assert sorted(r["key"] for r in read_folder(tmp_path)) == ["a", "b", "c"]


def test_torn_lines_are_quarantined_by_their_owner_and_orphans_by_the_first(tmp_path):
    good = json.dumps(line("a")) + "\n"
    for name in ("predictions.p1.jsonl", "predictions.p5.jsonl"):
        (tmp_path / name).write_text(good.replace('"a"', f'"{name}"') + '{"key": "torn')
    warnings: list[str] = []
    # process 1 of 2 owns p1 (quarantines it) and only reads p5 (warns)
    PredictionStore(tmp_path, warn=warnings.append, process=1, processes=2, tidy=False)
    assert (tmp_path / "predictions.p1.quarantine.jsonl").is_file()
    assert not (tmp_path / "predictions.p5.quarantine.jsonl").exists()
    assert any("predictions.p5.jsonl line 2 is not used" in w for w in warnings)
    # the first process also tidies files no process of this run owns
    store = PredictionStore(tmp_path, warn=warnings.append, process=0, processes=2)
    assert (tmp_path / "predictions.p5.quarantine.jsonl").is_file()
    assert store.done == {"predictions.p1.jsonl", "predictions.p5.jsonl"}
    # a reader that does not write never changes a file
    (tmp_path / "predictions.jsonl").write_text("not json\n")
    before = (tmp_path / "predictions.jsonl").read_bytes()
    PredictionStore(tmp_path, warn=warnings.append, writes=False)
    assert (tmp_path / "predictions.jsonl").read_bytes() == before


def test_a_repeated_key_across_files_counts_once(tmp_path):
    (tmp_path / "predictions.jsonl").write_text(json.dumps(line("a", pred="first")) + "\n")
    (tmp_path / "predictions.p0.jsonl").write_text(json.dumps(line("a", pred="copy")) + "\n")
    assert [r["pred"] for r in read_folder(tmp_path)] == ["first"]


# --- the launcher ---------------------------------------------------------------------------


def test_launcher_environments():
    envs = launch.environments(2, 4321, cpu_devices=4, gpus=2, heartbeat=9, base={"A": "1"})
    assert [e[multihost.PROCESS_ID] for e in envs] == ["0", "1"]
    assert {e[multihost.COORDINATOR] for e in envs} == {"127.0.0.1:4321"}
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3"]
    assert envs[1]["JAX_NUM_CPU_DEVICES"] == "4" and envs[1]["A"] == "1"
    assert envs[0][multihost.HEARTBEAT] == "9"


def test_launcher_stops_every_process_when_one_fails(tmp_path):
    # process 1 fails at once; process 0 would sleep for a minute: the launcher stops it
    script = ("import os, sys, time\n"
              "if os.environ['JAX_PROCESS_ID'] == '1':\n"
              "    print('process 1 is failing'); sys.exit(3)\n"
              "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)\n")
    pid_file = tmp_path / "pid"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "experiments.launch", "--processes", "2", "--log_dir",
         str(tmp_path / "logs"), "--", sys.executable, "-c", script, str(pid_file)],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert time.monotonic() - started < 30
    assert "process 1 of 2 exited with status 3; the others were stopped" in done.stderr
    assert "process 1 is failing" in done.stderr  # its last lines
    if pid_file.is_file():  # process 0 had started: it must be gone
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


def test_launcher_refuses_no_command():
    done = subprocess.run([sys.executable, "-m", "experiments.launch", "--processes", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no command" in done.stderr


# --- end to end, several processes (slow) ---------------------------------------------------


def env_for(tmp_path: pathlib.Path, **extra: str) -> dict:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu", TQDM_DISABLE="1",
                MPLCONFIGDIR=str(tmp_path / "mpl"), **extra)


def runner_args(model_dir: pathlib.Path, out_dir: pathlib.Path, *extra: str) -> list[str]:
    """6 synthetic passkey samples of 256 tokens; FullKV, SnapKV and DGE(2)-SnapKV."""
    return [sys.executable, "-m", "experiments.longbench", "--model", str(model_dir),
            "--datasets", "passkey", "--num_samples", "6", "--synthetic_length",
            "256", "--rules", "full,snapkv", "--timings", "prefill,dge", "--budgets", "16",
            "--window", "4", "--out_dir", str(out_dir), *extra]


def launched(n: int, tmp_path: pathlib.Path, command: list[str], *options: str) -> list[str]:
    return [sys.executable, "-m", "experiments.launch", "--processes", str(n), "--log_dir",
            str(tmp_path / "logs"), *options, "--", *command]


def predictions(out_dir: pathlib.Path) -> dict[str, tuple]:
    return {r["key"]: (r["pred"], r["new_tokens"]) for r in read_folder(out_dir)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.mark.long
def test_two_processes_split_a_run_and_merge_to_one_process_predictions(model_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    env = env_for(tmp_path)
    done = subprocess.run(runner_args(model_dir, one, "--batch_size", "1"), cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run(launched(2, tmp_path, runner_args(
        model_dir, two, "--batch_size", "1", "--distributed")), cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    files = sorted(p.name for p in two.glob("predictions*.jsonl"))
    assert files == ["predictions.p0.jsonl", "predictions.p1.jsonl"]
    assert all((two / f).read_text().strip() for f in files)  # both processes predicted
    assert predictions(two) == predictions(one) and len(predictions(one)) == 18
    # process 0 wrote the report over both files, and one config.json
    assert json.loads((two / "scores.json").read_text())
    assert json.loads((two / "config.json").read_text())["run_id"] == \
        json.loads((one / "config.json").read_text())["run_id"]

    # Killed mid-run: process 1 dies after its first batch, the launcher stops process 0;
    # rerunning the same command resumes and loses nothing.
    killed = tmp_path / "killed"
    command = launched(2, tmp_path, runner_args(model_dir, killed, "--batch_size", "1",
                                                "--distributed"))
    run = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    own = killed / "predictions.p1.jsonl"
    deadline = time.monotonic() + TIMEOUT
    while not (own.is_file() and own.read_text().count("\n") >= 3):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)
    os.kill(process_with(multihost.PROCESS_ID, "1", str(killed)), signal.SIGKILL)
    _, err = run.communicate(timeout=120)
    assert run.returncode != 0 and "process 1 of 2 exited with status" in err, err[-3000:]
    assert len(predictions(killed)) < 18
    # rerun under another process count: 3 processes predict what the 2 left
    rerun = launched(3, tmp_path, runner_args(model_dir, killed, "--batch_size", "1",
                                              "--distributed"))
    done = subprocess.run(rerun, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert predictions(killed) == predictions(one)
    files = sorted(killed.glob("predictions*.jsonl"))
    assert sum(p.read_text().count("\n") for p in files) == 18  # none written twice
    # and one process alone finds nothing missing
    done = subprocess.run(runner_args(model_dir, killed, "--batch_size", "1"), cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0 and "(6 samples done" in done.stdout, done.stderr[-3000:]
    assert sum(p.read_text().count("\n") for p in files) == 18


def process_with(variable: str, value: str, marker: str) -> int:
    """The pid of the process whose environment sets `variable` to `value` and whose command
    line names `marker` (Linux's /proc)."""
    for proc in pathlib.Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if proc.name.isdigit() and marker in cmd and "experiments.longbench" in cmd and \
                f"{variable}={value}".encode() in env:
            return int(proc.name)
    raise AssertionError(f"no process with {variable}={value} running {marker}")


@pytest.mark.slow
def test_a_model_sharded_across_two_processes_gives_one_process_tokens(tmp_path):
    sys.path.insert(0, str(REPO / "tests"))
    import mesh_checks

    ckpt = mesh_checks.write_checkpoint(tmp_path / "ckpt", mesh_checks.CONFIG)
    script = [sys.executable, str(REPO / "tests" / "multihost_checks.py"), str(ckpt)]
    done = subprocess.run([*script, str(tmp_path / "one")], env=env_for(
        tmp_path, JAX_NUM_CPU_DEVICES="8"), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run(launched(2, tmp_path, [*script, str(tmp_path / "two")],
                                   "--cpu_devices", "4"),
                          env=env_for(tmp_path), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    one = json.loads((tmp_path / "one.p0.json").read_text())
    # one process reads each block its devices hold once, however many devices hold it: on
    # data=2, model=4 the weights are replicated twice, and read once
    assert one["read_2x4"] <= one["checkpoint_bytes"]
    for i in range(2):
        two = json.loads((tmp_path / f"two.p{i}.json").read_text())
        assert two["processes"] == 2
        for mesh in ("2x4", "1x8"):
            assert two[f"tokens_{mesh}"] == one[f"tokens_{mesh}"], (i, mesh)
            assert two[f"kept_{mesh}"] == one[f"kept_{mesh}"], (i, mesh)
        # on data=1, model=8 each process reads only its devices' slices: less than the
        # checkpoint (the replicated norms and biases in full, the split weights in part)
        assert 0 < two["read_1x8"] < 0.8 * two["checkpoint_bytes"]


@pytest.mark.long
def test_the_runner_with_a_model_sharded_across_processes(model_dir, tmp_path):
    # tiny_model's 2 kv heads do not divide model=4: rows over data x model, so 8 a batch
    args = ("--batch_size", "8", "--mesh", "data=2,model=4")
    one, two = tmp_path / "one", tmp_path / "two"
    done = subprocess.run(runner_args(model_dir, one, *args), cwd=tmp_path,
                          env=env_for(tmp_path, JAX_NUM_CPU_DEVICES="8"),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run(launched(2, tmp_path, runner_args(model_dir, two, *args,
                                                            "--distributed"), "--cpu_devices",
                                   "4"),
                          cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    # one writer: process 0, into the folder's one file
    assert sorted(p.name for p in two.glob("predictions*.jsonl")) == ["predictions.jsonl"]
    assert predictions(two) == predictions(one) and len(predictions(one)) == 18


@pytest.mark.slow
def test_every_process_stops_on_a_busy_folder_or_another_identity(model_dir, tmp_path):
    from experiments.run_folder import locked

    env = env_for(tmp_path)
    out = tmp_path / "busy"
    command = launched(2, tmp_path, runner_args(model_dir, out, "--distributed"))
    with locked(out):  # another runner holds the folder
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
    assert done.returncode == 1, done.stderr[-3000:]
    # process 0's own line, or process 1's (in the launcher's tail of its log) if it ended first
    assert ("is in use by another runner" in done.stderr
            or "process 0 could not open the run folder" in done.stderr), done.stderr[-3000:]
    assert not list(out.glob("predictions*"))
    # process 1 sees other weights (another host's files): every process stops, naming it
    other = build_tiny_llama(tmp_path / "other", seed=1)
    pick = f"$( [ $JAX_PROCESS_ID = 0 ] && echo {model_dir} || echo {other} )"
    shell = " ".join(runner_args(pathlib.Path(pick), tmp_path / "mixed", "--distributed"))
    done = subprocess.run(launched(2, tmp_path, ["sh", "-c", shell]), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "the run identity of process(es) [1] differs from process 0's" in done.stderr
    assert not list((tmp_path / "mixed").glob("predictions*"))
