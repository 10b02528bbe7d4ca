"""Several processes, one program: JAX's multi-controller runtime, as this library uses it.

Every process runs the same Python program; `initialize` connects them
(`jax.distributed.initialize`), after which `jax.devices()` lists every process's devices
and a `Mesh` over them spans hosts. A computation on such a mesh returns arrays no single
process holds whole, so the library reads device values on the host only through `fetch`.
On one process (`jax.process_count() == 1`) everything here is the plain single-host path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Mapping

import jax
import numpy as np

# The standard variables of JAX's runtime (its own launcher and `jax.distributed` read them).
COORDINATOR, NUM_PROCESSES, PROCESS_ID = (
    "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
# How long a process waits for a peer that stopped answering before it fails (JAX's default,
# 100 s, kept unless the launcher or the user sets it).
HEARTBEAT = "DGE_JAX_HEARTBEAT_SECONDS"
BIND = "JAX_COORDINATOR_BIND_ADDRESS"  # where process 0 serves (JAX's default: [::]:port)
# How long `initialize` waits for every process to connect before it ends this one.
INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT = "DGE_JAX_INIT_TIMEOUT_SECONDS", 120
NOTE_AFTER = 2.0  # seconds of waiting before the one line saying what this process waits for
JAX_MARGIN = 30  # JAX's own timeout is later than ours: its expiry aborts with a stack trace
INTERRUPTED, TIMED_OUT = 130, 1  # exit statuses of a wait ended by Ctrl-C / by the timeout


@dataclasses.dataclass(frozen=True)
class Processes:
    """Where this process stands among the run's processes."""

    index: int = 0
    count: int = 1


def current() -> Processes:
    """This process's index and the process count (one process: index 0 of 1)."""
    return Processes(jax.process_index(), jax.process_count())


def seconds(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    """The positive whole number of seconds variable `name` sets (`default` when unset)."""
    value = env.get(name)
    if not value:
        return default
    if not re.fullmatch(r"[0-9]+", value.strip()) or int(value) < 1:
        raise ValueError(f"{name}={value!r} is not a whole number of seconds; set it to a positive "
                         f"integer (e.g. {name}=60) or unset it")
    return int(value)


def split_address(address: str, name: str = COORDINATOR) -> tuple[str, int]:
    """(host, port) of a `host:port` address; anything else is refused by `name`."""
    host, _, port = address.strip().rpartition(":")
    if not host or not re.fullmatch(r"[0-9]+", port) or not 0 < int(port) < 65536:
        raise ValueError(f"{name}={address!r} is not host:port; set it to process 0's host "
                         f"and a port (1-65535) free there, e.g. {name}=127.0.0.1:12345")
    return host.strip("[]"), int(port)


def port_in_use(port: int) -> bool:
    """Whether TCP `port` is taken on this host: a bind like the coordinator's ([::]:port,
    every address, address reuse on) fails with EADDRINUSE."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family)
        except OSError:
            continue  # no IPv6 here
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                probe.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
                continue
            return False
    return False


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """What this process connects to: from the JAX_* variables, or (all None) JAX's
    detection of a TPU pod or GPU cluster."""

    address: str | None = None
    count: int | None = None
    index: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Rendezvous:
        """The variables checked, all three or none (part of them is refused by name)."""
        names = (COORDINATOR, NUM_PROCESSES, PROCESS_ID)
        given = [n for n in names if env.get(n)]
        if not given:
            return cls()
        if len(given) < len(names):
            missing = ", ".join(n for n in names if n not in given)
            raise ValueError(f"{', '.join(given)} set without {missing}: set all three (or "
                             "none, to let JAX detect a TPU pod or GPU cluster)")
        split_address(env[COORDINATOR])
        count, index = env[NUM_PROCESSES], env[PROCESS_ID]
        if not re.fullmatch(r"[0-9]+", count) or int(count) < 1:
            raise ValueError(f"{NUM_PROCESSES}={count!r} is not a process count; set it to a "
                             "positive integer, the same on every process")
        if not re.fullmatch(r"[0-9]+", index):
            raise ValueError(f"{PROCESS_ID}={index!r} is not a process id; set it to a "
                             f"non-negative integer below {NUM_PROCESSES}={count}")
        if int(index) >= int(count):
            raise ValueError(f"{PROCESS_ID}={int(index)} must be below {NUM_PROCESSES}="
                             f"{int(count)}; number the processes 0 to {int(count) - 1}")
        return cls(env[COORDINATOR].strip(), int(count), int(index))

    @property
    def who(self) -> str:
        if self.index is None:
            return "this process (of the cluster JAX detected)"
        return f"process {self.index} of {self.count}"

    def waiting(self, timeout: int) -> str:
        """The note a process prints while it waits."""
        where = f" at {self.address}" if self.address else ""
        return (f"note: {self.who} waits for the other processes{where} to connect (up to "
                f"{timeout} s, {INIT_TIMEOUT} sets it; Ctrl-C stops it)")

    def timed_out(self, timeout: int, reached: bool = False) -> str:
        """What never connected, as far as this process can tell (`reached`: the coordinator
        answered earlier), and what to do."""
        longer = f"or give them longer with {INIT_TIMEOUT} (now {timeout} s)"
        if self.index is None:
            return (f"{self.who} waited {timeout} s and not every process connected; start "
                    f"the command on every host, {longer}")
        every = (f"start every process ({PROCESS_ID} 0 to {self.count - 1}) with "
                 f"{COORDINATOR}={self.address} and {NUM_PROCESSES}={self.count}, {longer}")
        if self.index == 0:
            missing = ("process 1 never connected" if self.count == 2 else
                       f"at least one of processes 1 to {self.count - 1} never connected (the "
                       "coordinator does not say which)")
            return f"{self.who} waited {timeout} s at {self.address} and {missing}; {every}"
        unreachable = "" if reached else self.unreachable()
        if unreachable:
            return (f"{self.who} found no coordinator at {self.address} in {timeout} s "
                    f"({unreachable}): process 0, which serves it, is not running there; "
                    f"{every}")
        return (f"{self.who} reached the coordinator at {self.address} but not all "
                f"{self.count} processes connected in {timeout} s; {every}")

    def unreachable(self) -> str:
        """Why the coordinator's address does not answer ("" when it does)."""
        host, port = split_address(self.address)
        try:
            socket.create_connection((host, port), timeout=2).close()
        except OSError as e:
            return e.strerror or type(e).__name__
        return ""


def initialize(environ: Mapping[str, str] | None = None) -> Processes:
    """Connects this process to the others (`jax.distributed.initialize`), once.

    With JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set (the launcher,
    `python -m experiments.launch`, sets them) those are used, checked first; with none of
    them, JAX detects a TPU pod's or a GPU cluster's (SLURM, Open MPI) settings itself. A bad
    or partial setting is a ValueError naming the variable. CPU processes exchange through
    gloo. Must run before anything touches a device.

    The wait for the other processes is bounded by DGE_JAX_INIT_TIMEOUT_SECONDS (120 s); a
    wait past 2 s says on stderr what it waits for. JAX's connect blocks in C++ and cannot be
    cancelled (nor can Python exit normally while it runs: JAX's exit handler waits on it),
    so it runs in a thread while this one watches: on the timeout, or on Ctrl-C, the process
    prints one `error:` line and ends at once (`os._exit`, status 1 or 130)."""
    env = os.environ if environ is None else environ
    meet = Rendezvous.from_env(env)
    kwargs: dict = {}
    if meet.index is not None:
        kwargs = dict(coordinator_address=meet.address, num_processes=meet.count,
                      process_id=meet.index)
    heartbeat = seconds(env, HEARTBEAT)
    if heartbeat is not None:
        kwargs["heartbeat_timeout_seconds"] = heartbeat
    timeout = seconds(env, INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT)
    if jax.distributed.is_initialized():
        return current()
    served = BIND if env.get(BIND) else COORDINATOR  # process 0 serves on its port
    if meet.index == 0 and port_in_use(split_address(env[served], served)[1]):
        raise ValueError(busy(served, env[served]))  # JAX's own error is cryptic
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        connect(kwargs, meet, timeout)
    except ValueError as e:  # no variables, and no cluster JAX knows how to join
        if meet.index is not None:
            raise
        names = ", ".join((COORDINATOR, NUM_PROCESSES, PROCESS_ID))
        raise ValueError(
            f"no cluster to join: {names} are not set and JAX detected no TPU pod "
            f"or GPU cluster ({e}); set the three on every process (python -m "
            "experiments.launch --processes N -- COMMAND sets them locally)") from e
    except jax.errors.JaxRuntimeError as e:  # the port was taken between the check and now
        if "Failed to start RPC server" in str(e) and meet.index == 0:
            raise ValueError(busy(served, env[served])) from e
        raise
    return current()


def busy(name: str, address: str) -> str:
    port = split_address(address, name)[1]
    return (f"port {port} of {name}={address} is in use on this host, where process 0 serves "
            "the coordinator; give every process another port (the launcher's --port)")


def connect(kwargs: dict, meet: Rendezvous, timeout: int) -> None:
    """`jax.distributed.initialize(**kwargs)` in a thread, watched from this one: its error
    is raised here; past `timeout` s, or on Ctrl-C, the process ends with one line."""
    outcome: list[BaseException | None] = []
    done = threading.Event()

    def run() -> None:
        try:
            jax.distributed.initialize(**kwargs, initialization_timeout=timeout + JAX_MARGIN)
            outcome.append(None)
        except BaseException as e:  # handed to the watching thread
            outcome.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="dge_jax.multihost.initialize", daemon=True).start()
    started, noted, reached = time.monotonic(), False, False
    try:
        while not done.wait(0.1):  # short waits: a pending Ctrl-C is seen at once
            waited = time.monotonic() - started
            if waited >= timeout:
                end(TIMED_OUT, meet.timed_out(timeout, reached))
            if not noted and waited >= NOTE_AFTER:
                print(meet.waiting(timeout), file=sys.stderr, flush=True)
                noted = True
                # whether the coordinator is up now: it may be gone by the timeout
                reached = bool(meet.index) and not meet.unreachable()
    except KeyboardInterrupt:
        where = f" at {meet.address}" if meet.address else ""
        end(INTERRUPTED, f"interrupted while {meet.who} waited for the other processes"
                         f"{where}; nothing ran yet: rerun the command on every process")
    if outcome[0] is not None:
        raise outcome[0]


def end(status: int, message: str) -> None:
    """Prints `error: message` and ends the process now (the blocked connect cannot be
    cancelled, and a normal exit would wait on it)."""
    with contextlib.suppress(OSError, ValueError):  # stdout closed: the line goes on
        sys.stdout.flush()
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(status)


def fetch(x) -> np.ndarray:
    """A device array's value on this host, also when it spans other processes' devices:
    a replicated one is read from a local copy, a sharded one gathered from every process
    (`multihost_utils.process_allgather`, which every process must then call)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def broadcast(value: np.ndarray) -> np.ndarray:
    """Process 0's `value` on every process (each passes an array of the same shape)."""
    if jax.process_count() == 1:
        return np.asarray(value)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(value)))


def gather(value: np.ndarray) -> np.ndarray:
    """Every process's `value` (the same shape on each), stacked by process index."""
    if jax.process_count() == 1:
        return np.asarray(value)[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(value)))


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier of this name (no-op on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
