"""How a multi-process run fails to start (issue #42, cases 6, 8, 11): in one line, in time.

- Bad JAX_* / DGE_JAX_* variables are refused by name before anything connects (an address
  without a port was an IndexError, a non-numeric heartbeat a bare `int()` error).
- Process 0 refuses a coordinator port already taken (JAX's "Failed to start RPC server"
  came before any line of ours), and so does the launcher, before it starts any process.
- One process of two started alone waited silently (JAX's 300 s, then an abort with a stack
  trace) and ignored Ctrl-C: now it says what it waits for, ends after
  DGE_JAX_INIT_TIMEOUT_SECONDS with one line naming what never connected, and ends at once
  on Ctrl-C. These run real subprocesses, a few seconds each.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from dge_jax.distribution import multihost
from experiments import launch

REPO = pathlib.Path(__file__).resolve().parents[1]
SHORT = 3  # seconds a lone process waits in these tests


def three(port: int = 1234, count: str = "2", index: str = "0") -> dict[str, str]:
    return {multihost.COORDINATOR: f"127.0.0.1:{port}", multihost.NUM_PROCESSES: count,
            multihost.PROCESS_ID: index}


def closed_port() -> int:
    """A port nothing listens on (bound, read, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def listening():
    """A port something listens on, for the test's duration."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def env_for(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "DGE_JAX_"))}
    return dict(base, PYTHONPATH=path, JAX_PLATFORMS="cpu", **extra)


# --- the variables, checked before anything connects -----------------------------------------


@pytest.mark.parametrize("env, line", [
    ({**three(), multihost.COORDINATOR: "localhost"},
     "JAX_COORDINATOR_ADDRESS='localhost' is not host:port; set it to process 0's host and a "
     "port (1-65535) free there, e.g. JAX_COORDINATOR_ADDRESS=127.0.0.1:12345"),
    ({**three(), multihost.COORDINATOR: "localhost:http"}, "'localhost:http' is not host:port"),
    ({**three(), multihost.COORDINATOR: ":1234"}, "':1234' is not host:port"),
    ({**three(), multihost.COORDINATOR: "h:70000"}, "'h:70000' is not host:port"),
    (three(count="0"), "JAX_NUM_PROCESSES='0' is not a process count; set it to a positive "
     "integer, the same on every process"),
    (three(index="-1"), "JAX_PROCESS_ID='-1' is not a process id; set it to a non-negative "
     "integer below JAX_NUM_PROCESSES=2"),
    (three(index="2"), "JAX_PROCESS_ID=2 must be below JAX_NUM_PROCESSES=2; number the "
     "processes 0 to 1"),
    ({**three(), multihost.HEARTBEAT: "abc"}, "DGE_JAX_HEARTBEAT_SECONDS='abc' is not a whole "
     "number of seconds; set it to a positive integer (e.g. DGE_JAX_HEARTBEAT_SECONDS=60) or "
     "unset it"),
    ({multihost.HEARTBEAT: "abc"}, "DGE_JAX_HEARTBEAT_SECONDS='abc' is not a whole number"),
    ({**three(), multihost.INIT_TIMEOUT: "0"}, "DGE_JAX_INIT_TIMEOUT_SECONDS='0' is not a whole"),
], ids=["no-port", "port-not-a-number", "no-host", "port-too-large", "no-processes",
        "negative-id", "id-too-large", "heartbeat", "heartbeat-detected-cluster", "init-timeout"])
def test_bad_variables_are_one_line_naming_the_variable(env, line):
    with pytest.raises(ValueError) as caught:
        multihost.initialize(env)
    assert line in str(caught.value) and "\n" not in str(caught.value)
    assert not multihost.jax.distributed.is_initialized()


def test_process_zero_refuses_a_port_in_use(listening):
    with pytest.raises(ValueError, match=(
            f"^port {listening} of JAX_COORDINATOR_ADDRESS=127.0.0.1:{listening} is in use on "
            "this host, where process 0 serves the coordinator; give every process another "
            r"port \(the launcher's --port\)$")):
        multihost.initialize(three(listening))
    assert not multihost.jax.distributed.is_initialized()
    assert multihost.port_in_use(listening) and not multihost.port_in_use(closed_port())


def test_launcher_refuses_a_port_in_use_before_starting_anything(listening, tmp_path):
    ran = tmp_path / "ran"
    done = subprocess.run(
        [sys.executable, "-m", "experiments.launch", "--processes", "2", "--port",
         str(listening), "--", sys.executable, "-c", f"open({str(ran)!r}, 'w')"],
        cwd=REPO, env=env_for(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == f"error: port {listening} is in use; pick another with --port\n"
    assert not ran.exists()


def test_launcher_sets_the_wait_for_the_others():
    envs = launch.environments(2, 4321, None, None, heartbeat=9, base={}, init_timeout=7)
    assert [e[multihost.INIT_TIMEOUT] for e in envs] == ["7", "7"]
    assert multihost.INIT_TIMEOUT not in launch.environments(1, 1, None, None, 9, {})[0]


# --- what a process that waits in vain says -----------------------------------------------


def test_what_never_connected_as_far_as_each_process_can_tell(listening):
    free = closed_port()
    up = multihost.Rendezvous(f"127.0.0.1:{listening}", 3, 2).timed_out(5)
    assert up.startswith(f"process 2 of 3 reached the coordinator at 127.0.0.1:{listening} "
                         "but not all 3 processes connected in 5 s; start every process "
                         "(JAX_PROCESS_ID 0 to 2)")
    down = multihost.Rendezvous(f"127.0.0.1:{free}", 3, 1).timed_out(5)
    assert down.startswith(f"process 1 of 3 found no coordinator at 127.0.0.1:{free} in 5 s "
                           "(Connection refused): process 0, which serves it, is not running")
    # it answered earlier: gone by the timeout (process 0 gave up first) is no news
    assert "reached the coordinator" in multihost.Rendezvous(
        f"127.0.0.1:{free}", 3, 1).timed_out(5, reached=True)
    first = multihost.Rendezvous(f"127.0.0.1:{free}", 3, 0).timed_out(5)
    assert "at least one of processes 1 to 2 never connected" in first
    assert first.endswith("or give them longer with DGE_JAX_INIT_TIMEOUT_SECONDS (now 5 s)")


CONNECT = [sys.executable, "-c", "from dge_jax.distribution import multihost; "
           "multihost.initialize(); print('connected')"]


def test_one_process_of_two_ends_after_the_timeout_naming_what_never_connected(tmp_path):
    # process 1 through the runner, process 0 alone on another port: both at once
    port1, port0 = closed_port(), closed_port()
    runner = subprocess.Popen(
        [sys.executable, "-m", "experiments.longbench", "--distributed", "--out_dir",
         str(tmp_path / "out")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env_for(**three(port1, index="1"),
                               DGE_JAX_INIT_TIMEOUT_SECONDS=str(SHORT)))
    alone = subprocess.Popen(
        CONNECT, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env_for(**three(port0), DGE_JAX_INIT_TIMEOUT_SECONDS=str(SHORT)))
    started = time.monotonic()
    try:
        outs = [p.communicate(timeout=60) for p in (runner, alone)]
    finally:
        for p in (runner, alone):
            p.kill()
    assert time.monotonic() - started < 40
    fix = (f"start every process (JAX_PROCESS_ID 0 to 1) with JAX_COORDINATOR_ADDRESS="
           "127.0.0.1:{} and JAX_NUM_PROCESSES=2, or give them longer with "
           f"DGE_JAX_INIT_TIMEOUT_SECONDS (now {SHORT} s)")
    expected = [
        f"error: process 1 of 2 found no coordinator at 127.0.0.1:{port1} in {SHORT} s "
        f"(Connection refused): process 0, which serves it, is not running there; "
        + fix.format(port1),
        f"error: process 0 of 2 waited {SHORT} s at 127.0.0.1:{port0} and process 1 never "
        "connected; " + fix.format(port0),
    ]
    for p, (out, err), line, index, port in zip((runner, alone), outs, expected, (1, 0),
                                                (port1, port0), strict=True):
        assert p.returncode == 1, err[-3000:]
        assert "connected" not in out
        # the note, then the error: nothing of JAX's (its abort prints a stack trace)
        assert err.splitlines() == [
            f"note: process {index} of 2 waits for the other processes at 127.0.0.1:{port} "
            f"to connect (up to {SHORT} s, DGE_JAX_INIT_TIMEOUT_SECONDS sets it; Ctrl-C stops "
            "it)", line], err[-3000:]
    assert not (tmp_path / "out").exists()


def test_ctrl_c_ends_a_waiting_process_at_once():
    port = closed_port()
    # A test suite started in the background by a non-interactive shell (`pytest ... &` in a
    # script) ignores SIGINT, and an ignored signal stays ignored across exec: the child would
    # then never see the Ctrl-C (the cause of this test's rare failures, found from the
    # stacks -X faulthandler printed). Give it the default disposition back, as a shell does.
    # -X faulthandler: if Ctrl-C is ever ignored again, SIGABRT makes the process print
    # every thread's stack, which the failure then shows.
    proc = subprocess.Popen([CONNECT[0], "-X", "faulthandler", *CONNECT[1:]], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env_for(**three(port, index="1")),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not lines and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lines and lines[0].startswith("note: process 1 of 2 waits"), lines
        assert "up to 120 s" in lines[0]  # the default
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            status = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=10)
            reader.join(10)
            pytest.fail("Ctrl-C did not end the waiting process in 20 s; its threads:\n"
                        + "".join(lines))
        assert status == 130
        assert time.monotonic() - sent < 5
    finally:
        proc.kill()
    reader.join(10)
    assert lines[1:] == [
        f"error: interrupted while process 1 of 2 waited for the other processes at "
        f"127.0.0.1:{port}; nothing ran yet: rerun the command on every process\n"]
