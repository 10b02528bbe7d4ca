"""Several processes, one program: JAX's multi-controller runtime, as this library uses it.

Every process runs the same Python program; `initialize` connects them
(`jax.distributed.initialize`), after which `jax.devices()` lists every process's devices
and a `Mesh` over them spans hosts. A computation on such a mesh returns arrays no single
process holds whole, so the library reads device values on the host only through `fetch`.
On one process (`jax.process_count() == 1`) everything here is the plain single-host path.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax
import numpy as np

# The standard variables of JAX's runtime (its own launcher and `jax.distributed` read them).
COORDINATOR, NUM_PROCESSES, PROCESS_ID = (
    "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
# How long a process waits for a peer that stopped answering before it fails (JAX's default,
# 100 s, kept unless the launcher or the user sets it).
HEARTBEAT = "DGE_JAX_HEARTBEAT_SECONDS"


@dataclasses.dataclass(frozen=True)
class Processes:
    """Where this process stands among the run's processes."""

    index: int = 0
    count: int = 1


def current() -> Processes:
    """This process's index and the process count (one process: index 0 of 1)."""
    return Processes(jax.process_index(), jax.process_count())


def initialize(environ: Mapping[str, str] | None = None) -> Processes:
    """Connects this process to the others (`jax.distributed.initialize`), once.

    With JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set (the launcher,
    `python -m experiments.launch`, sets them) those are used; with none of them, JAX
    detects a TPU pod's or a GPU cluster's (SLURM, Open MPI) settings itself. Part of them
    set is refused by name. CPU processes exchange through gloo. Must run before anything
    touches a device."""
    env = os.environ if environ is None else environ
    names = (COORDINATOR, NUM_PROCESSES, PROCESS_ID)
    given = [n for n in names if env.get(n)]
    if given and len(given) < len(names):
        missing = ", ".join(n for n in names if n not in given)
        raise ValueError(f"{', '.join(given)} set without {missing}: set all three (or none, "
                         "to let JAX detect a TPU pod or GPU cluster)")
    kwargs: dict = {}
    if given:
        for name in (NUM_PROCESSES, PROCESS_ID):
            if not env[name].isdigit():
                raise ValueError(f"{name}={env[name]!r} must be a non-negative integer")
        count, index = int(env[NUM_PROCESSES]), int(env[PROCESS_ID])
        if not 0 <= index < count:
            raise ValueError(f"{PROCESS_ID}={index} must be below {NUM_PROCESSES}={count}")
        kwargs = dict(coordinator_address=env[COORDINATOR], num_processes=count,
                      process_id=index)
    if env.get(HEARTBEAT):
        kwargs["heartbeat_timeout_seconds"] = int(env[HEARTBEAT])
    if jax.distributed.is_initialized():
        return current()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**kwargs)
    except ValueError as e:  # no variables, and no cluster JAX knows how to join
        if given:
            raise
        raise ValueError(
            f"no cluster to join: {', '.join(names)} are not set and JAX detected no TPU pod "
            f"or GPU cluster ({e}); set the three on every process (python -m "
            "experiments.launch --processes N -- COMMAND sets them locally)") from e
    return current()


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
