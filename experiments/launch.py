"""Starts N local processes of one command as one JAX multi-controller run.

    python -m experiments.launch --processes 2 -- python -m experiments.longbench --distributed
    python -m experiments.launch --processes 2 --cpu_devices 4 -- \\
        python -m experiments.longbench --distributed --mesh data=2,model=4
    python -m experiments.launch --processes 4 --gpus_per_process 2 -- python my_script.py

Each process gets JAX's variables (JAX_COORDINATOR_ADDRESS on a free local port,
JAX_NUM_PROCESSES, JAX_PROCESS_ID), its own GPUs (CUDA_VISIBLE_DEVICES) or CPU devices
(JAX_NUM_CPU_DEVICES), a heartbeat timeout, and with --init_timeout how long a process waits
for the others to connect (DGE_JAX_INIT_TIMEOUT_SECONDS, else 120 s). A --port already taken
is refused before any process starts. Process 0 writes to this terminal, the others
to LOG_DIR/process-<i>.log. When a process fails, the launcher stops the others at once (no
one waits on a dead peer), prints the failed process's last lines and exits with its status;
rerunning the same command resumes every process's missing samples. Ctrl-C stops all of them.
On a TPU pod run the command on every host instead (`gcloud ... --worker=all`, docs/tpu_vm.md): JAX
finds the pod's processes itself.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

from dge_jax.distribution.multihost import (
    COORDINATOR,
    DEFAULT_INIT_TIMEOUT,
    HEARTBEAT,
    INIT_TIMEOUT,
    NUM_PROCESSES,
    PROCESS_ID,
    port_in_use,
)

GRACE = 10.0  # seconds a stopped process gets between SIGTERM and SIGKILL


def free_port() -> int:
    """A TCP port nothing listens on now (the coordinator binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environments(n: int, port: int, cpu_devices: int | None, gpus: int | None,
                 heartbeat: int, base: dict[str, str],
                 init_timeout: int | None = None) -> list[dict[str, str]]:
    """Each process's environment: `base` plus JAX's variables and its share of devices."""
    out = []
    for i in range(n):
        env = {**base, COORDINATOR: f"127.0.0.1:{port}", NUM_PROCESSES: str(n),
               PROCESS_ID: str(i), HEARTBEAT: str(heartbeat)}
        if init_timeout is not None:
            env[INIT_TIMEOUT] = str(init_timeout)
        if cpu_devices is not None:
            env["JAX_NUM_CPU_DEVICES"] = str(cpu_devices)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(i * gpus, (i + 1) * gpus))
        out.append(env)
    return out


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every running process's group, SIGKILL to those alive after GRACE s."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def tail(path: pathlib.Path | None, lines: int = 15) -> str:
    if path is None or not path.is_file():
        return ""
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "".join(f"  | {line}\n" for line in text)


def watch(procs: list[subprocess.Popen], logs: list[pathlib.Path | None],
          timeout: float | None) -> int:
    """Waits for every process; the first failure (or the timeout) stops the rest."""
    started = time.monotonic()
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, code = failed[0]
            stop(procs)
            print(f"error: process {i} of {len(procs)} exited with status {code}; the others "
                  f"were stopped. Rerun the same command to resume what was not saved"
                  + (f"; its last lines ({logs[i]}):\n{tail(logs[i])}" if logs[i] else ""),
                  file=sys.stderr)
            return code if code > 0 else 128 - code
        if all(c == 0 for c in codes):
            return 0
        if timeout is not None and time.monotonic() - started > timeout:
            stop(procs)
            print(f"error: the processes ran past --timeout {timeout:g} s and were stopped; "
                  "rerun the same command to resume what was saved", file=sys.stderr)
            return 124
        time.sleep(0.2)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.launch", description=__doc__.split("\n\n")[0],
        usage="%(prog)s --processes N [options] -- COMMAND ...")
    parser.add_argument("--processes", type=int, required=True, help="processes to start")
    parser.add_argument("--cpu_devices", type=int, help="CPU devices per process")
    parser.add_argument("--gpus_per_process", type=int, help="GPUs per process (process i "
                        "gets GPUs i*G .. i*G+G-1)")
    parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    parser.add_argument("--log_dir", help="where processes 1.. write (default: a new "
                        "temporary folder)")
    parser.add_argument("--heartbeat", type=int, default=30, help="seconds before a silent "
                        "peer counts as dead (JAX's heartbeat timeout)")
    parser.add_argument("--init_timeout", type=int, help="seconds a process waits for the "
                        f"others to connect before it fails ({INIT_TIMEOUT}; default "
                        f"{DEFAULT_INIT_TIMEOUT})")
    parser.add_argument("--timeout", type=float, help="stop every process after this many "
                        "seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command: give it after --, e.g. -- python -m experiments.longbench "
                     "--distributed")
    for name in ("processes", "cpu_devices", "gpus_per_process", "heartbeat", "init_timeout"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    if not 0 <= args.port < 65536:
        parser.error(f"--port must be a TCP port (1-65535, or 0 for a free one), got {args.port}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    n = args.processes
    if args.port and port_in_use(args.port):  # else process 0 fails with JAX's RPC error
        print(f"error: port {args.port} is in use; pick another with --port", file=sys.stderr)
        return 2
    envs = environments(n, args.port or free_port(), args.cpu_devices, args.gpus_per_process,
                        args.heartbeat, dict(os.environ), args.init_timeout)
    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="dge_jax-launch-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    logs: list[pathlib.Path | None] = [None] + [log_dir / f"process-{i}.log" for i in range(1, n)]
    if n > 1:
        print(f"launch: {n} processes; processes 1-{n - 1} write to {log_dir}/process-<i>.log",
              file=sys.stderr)
    procs = []
    try:
        for i, env in enumerate(envs):
            out = None if logs[i] is None else open(logs[i], "wb")
            procs.append(subprocess.Popen(args.command, env=env, stdout=out,
                                          stderr=subprocess.STDOUT if out else None,
                                          start_new_session=True))
            if out is not None:
                out.close()
        return watch(procs, logs, args.timeout)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        try:
            for p in procs:
                p.wait(GRACE)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            stop(procs)
        print("error: interrupted; every process was stopped. Rerun the same command to "
              "resume what was saved", file=sys.stderr)
        return 130
    except OSError as e:
        stop(procs)
        print(f"error: cannot start {args.command[0]!r}: {e.strerror}; check the command",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
