"""The runner over several processes (`--distributed`), on JAX's multi-controller runtime.

Every process runs the same command; `dge_jax.distribution.multihost.initialize` connects them
(JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or JAX's detection on a TPU
pod or GPU cluster). The --mesh decides the mode:

- **data** (no --mesh, or one no larger than a process's own devices): each process loads the
  model on its own devices and predicts every `count`-th batch of the run, writing its own
  prediction file (`predictions.p<index>.jsonl`). Batches are formed exactly as one process
  forms them (same rows, same left padding), so the merged predictions equal a
  single-process run's token for token.
- **model** (a --mesh over every process's devices): one model sharded across processes, each
  reading only the slices its devices hold; every process runs every batch as one SPMD
  program, and the first one writes the predictions.

In both modes the first process claims the folder (its lock, `open_run`'s identity check,
config.json) and writes the report; the others go on only once it has, and only if their own
run identity is the same (another checkpoint or data on one host is refused by name). Each
process reads every prediction file before any process writes (a barrier), so all agree on
what is missing, under any process count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
from collections.abc import Callable, Iterator

import numpy as np

from experiments import protocol
from experiments.predictions import PredictionStore
from experiments.run_folder import locked

MODES = ("single", "data", "model")


class PeerFailed(RuntimeError):
    """Another process of the run failed before this one could go on (its output says why)."""


@dataclasses.dataclass(frozen=True)
class Share:
    """This process's part in a run: the mode, its index and the process count."""

    mode: str = "single"
    index: int = 0
    count: int = 1

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {MODES}")

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def writes(self) -> bool:
        """Whether this process writes predictions (in model mode only the first does)."""
        return self.mode != "model" or self.first

    def owns(self, batch: int) -> bool:
        """Whether this process predicts the run's `batch`-th batch (counted over datasets)."""
        return self.mode != "data" or batch % self.count == self.index

    def store(self, out_dir: pathlib.Path) -> PredictionStore:
        """This process's view of the folder's predictions (its own file in data mode)."""
        if self.mode == "data":
            return PredictionStore(out_dir, process=self.index, processes=self.count,
                                   tidy=self.first)
        return PredictionStore(out_dir, writes=self.writes)


ALONE = Share()  # one process, the only writer


def start(distributed: bool, mesh_spec: str | None):
    """(this process's `Share`, the mesh to load the model on or None): connects the
    processes first when `distributed`; a mesh is over every process's devices (model mode)
    or over this process's own (data mode)."""
    import jax

    from dge_jax.distribution import multihost
    from dge_jax.distribution.sharding import parse_mesh

    processes = multihost.Processes()
    if distributed:
        try:
            processes = multihost.initialize()
        except ValueError as e:
            raise ValueError(f"--distributed: {e}") from e
    if processes.count == 1:
        return ALONE, parse_mesh(mesh_spec) if mesh_spec else None
    local, every = jax.local_devices(), jax.devices()
    if not mesh_spec:
        return Share("data", processes.index, processes.count), None
    mesh = parse_mesh(mesh_spec, devices=every)
    size = math.prod(mesh.devices.shape)
    if size == len(every):
        return Share("model", processes.index, processes.count), mesh
    if size <= len(local):
        return (Share("data", processes.index, processes.count),
                parse_mesh(mesh_spec, devices=local))
    raise ValueError(
        f"--mesh {mesh_spec} spans {size} devices; under --distributed give a mesh of all "
        f"{len(every)} devices of the {processes.count} processes (the model sharded across "
        f"them) or of at most one process's {len(local)} (each process its own model)")


def _agree(share: Share, ok: bool, run_id: str) -> None:
    """Process 0's verdict (it opened the folder) and run id to every process, then every
    process's check of that id to every process: all go on, or all stop (process 0 with its
    own error when it could not open the folder)."""
    from dge_jax.distribution import multihost

    mine = np.frombuffer(run_id.encode().ljust(64)[:64], np.uint8)
    sent = multihost.broadcast(np.concatenate([np.array([ok], np.uint8), mine]))
    theirs = bytes(sent[1:]).decode().strip()
    votes = multihost.gather(np.array([theirs == run_id], np.uint8))[:, 0]
    if not sent[0]:
        if share.first:
            return  # the error that stopped it goes on
        raise PeerFailed("process 0 could not open the run folder; its output says why")
    differ = [i for i, same in enumerate(votes) if not same]
    if differ:
        raise PeerFailed(
            f"the run identity of process(es) {differ} differs from process 0's {theirs} "
            f"(this process's: {run_id}): every process must see the same checkpoint, data "
            "and flags (check the files on each host)")


@contextlib.contextmanager
def claimed(share: Share, out_dir: pathlib.Path, open_folder: Callable[[], object],
            run_id: str) -> Iterator[None]:
    """The folder held for the run: by this process alone, or, across processes, by the
    first one (its lock and `open_folder`, the identity check), the others going on once it
    has and only with the same identity."""
    if share.count == 1:
        with locked(out_dir):
            open_folder()
            yield
        return
    with contextlib.ExitStack() as stack:
        if share.first:
            ok = False
            try:
                stack.enter_context(locked(out_dir))
                open_folder()
                ok = True
            finally:
                _agree(share, ok, run_id)  # the others hear of a failure too, and stop
        else:
            _agree(share, False, run_id)
        yield


def all_read(share: Share) -> None:
    """Returns once every process has read the folder's predictions (no one writes before)."""
    from dge_jax.distribution import multihost

    if share.count > 1:
        multihost.barrier("dge_jax.runner.predictions_read")


def all_done(share: Share) -> None:
    """Returns once every process has written its predictions (then the report merges)."""
    from dge_jax.distribution import multihost

    if share.count > 1:
        multihost.barrier("dge_jax.runner.predictions_written")


def batches_of(dataset: str, pending: list, batch_size: int) -> list[tuple[int, list]]:
    """(generation length, up to batch_size pending (row, cells)) in run order; a batch
    holds rows of one generation length (kvpress's rows carry their own)."""
    by_length: dict[int, list] = {}
    for item in pending:
        by_length.setdefault(protocol.max_new_tokens(dataset, item[0]), []).append(item)
    return [(n, group[start:start + batch_size]) for n, group in by_length.items()
            for start in range(0, len(group), batch_size)]


def assign(pending: dict[str, list], batch_size: int,
           share: Share) -> dict[str, list[tuple[int, list]]]:
    """Each dataset's batches this process predicts: one process's batches, numbered across
    datasets in run order, every `share.count`-th of them (data-parallel), so every batch
    is the one a single process would run."""
    work, number = {}, 0
    for dataset, items in pending.items():
        work[dataset] = []
        for batch in batches_of(dataset, items, batch_size):
            if share.owns(number):
                work[dataset].append(batch)
            number += 1
    return work
