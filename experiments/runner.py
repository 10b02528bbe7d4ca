"""The runner: evaluates a grid of KV-cache eviction cells (FullKV, the eviction baselines and
their DGE / DGE-W versions) on one suite's tasks, into a resumable run folder.

Run it as `python -m experiments.longbench` (the documented entry point, whose docstring is
the --help text); the suites are `experiments.suites`, the flags and the `RunConfig` read from
them once are `experiments.run_config`.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import pathlib
import shlex
import sys
import time
from collections.abc import Callable

from absl import app, flags
from absl import logging as absl_logging

from dge_jax.checkpoints.tokenizer import RAW_PROMPT, prompt_format, prompt_renderer
from dge_jax.eviction.timing import Lookahead
from experiments import context_protocols, distributed, predictions, protocol, suites
from experiments.cells import OBSERVES_DRAFTS, Cell
from experiments.lengths import prompt_length
from experiments.predictions import PredictionStore, config_hash, prediction_key
from experiments.run_config import FLAGS, RunConfig, UsageError
from experiments.run_folder import (
    RULE_OPTIONS_KEY,
    RunFolderBusy,
    default_out_dir,
    files_fingerprint,
    open_run,
    run_id,
)
from experiments.suites.base import RowSettings, Suite

PROTOCOL = "longbench-v1-pred.py"  # experiments.protocol's steps; bump if they change
LOOKAHEAD_KEY = "lookahead"  # the first stage of the run's lookahead cells, in the identity


def default_datasets(suite: str | Suite, data_dir: str | None,
                     ruler_length: int = 4096) -> list[str]:
    """What runs without --datasets: the synthetic main job's tasks; for LongBench, those whose
    file is in the data folder; for RULER, every task, or those whose {task}_{length}.jsonl is
    in --data_dir (the suite says)."""
    suite = suites.get(suite) if isinstance(suite, str) else suite
    return suite.default_datasets(RowSettings(data_dir=data_dir, ruler_length=ruler_length))


def load_suite(model, suite: str | Suite, datasets: list[str], num_samples: int | None,
               data_dir: str | None, length: int, seed: int) -> dict[str, list[dict]]:
    """Rows per dataset, in the runner's schema, checked (bad rows stop here); `length` is the
    suite's prompt length (--synthetic_length, --ruler_length)."""
    settings = RowSettings(data_dir, seed, synthetic_length=length, ruler_length=length)
    return suite_rows(model, suites.get(suite) if isinstance(suite, str) else suite, settings,
                      datasets, num_samples)


def suite_rows(model, suite: Suite, settings: RowSettings, datasets: list[str],
               num_samples: int | None) -> dict[str, list[dict]]:
    """The suite's rows for the model's tokenizer and prompt format (`prompt_renderer`: its
    chat template, or the raw prompt of a model without one)."""
    tok = model.tokenizer
    return suite.load(settings, tok, prompt_renderer(tok), datasets, num_samples)


def run_identity(config: RunConfig, model, max_length: int) -> dict:
    """Everything besides the grid and the samples that changes a prediction: a run folder
    holds one identity (`experiments.run_folder`). Its keys and their order are what earlier
    folders recorded (the suite adds its own: synthetic_length, seed, ruler_length). The
    chunk and the attention are the ones that run (`run_backend`); the attention only when
    it is not xla, so every folder written before it was recorded (xla, the only one then)
    keeps its identity."""
    import dge_jax

    backend, chunk = run_backend(config, model)
    return {
        "model": config.model, "model_files": files_fingerprint(model.path),
        "dtype": config.dtype, "suite": config.suite.name, "protocol": PROTOCOL,
        "dge_jax": dge_jax.__version__, "max_length": max_length, "chunk": chunk,
        "batch_size": config.batch_size,  # left padding may change results in the last bits
        **config.suite.identity(config.rows),
        # only when off, so the folders of every earlier run keep their identity
        **({} if config.answer_prefix else {"answer_prefix": False}),
        RULE_OPTIONS_KEY: dict(config.rule_options),
        "draft_weight": config.draft_weight, "ties": config.ties,
        "adaptive": config.adaptive_identity,
        **({} if backend.attention == "xla" else {"attention": backend.attention}),
        **({} if config.sliding == "window" else {"sliding": config.sliding}),
        **({} if config.sliding_cache == "auto" else {"sliding_cache": config.sliding_cache}),
        **({} if config.kv_quant == "none" else {"kv_quant": config.kv_quant}),
        **({} if config.protocol == "query_aware" else {"context_protocol": config.protocol}),
        **({} if config.anchor == 0 else {"anchor": config.anchor}),
        # only when not LAQ's defaults, so commands extending one folder agree on it
        **({} if config.lookahead == Lookahead() else
           {LOOKAHEAD_KEY: dataclasses.asdict(config.lookahead)}),  # fmt: skip
        # a model without a chat template: its raw prompts (every earlier folder had one)
        **({} if prompt_format(model.tokenizer) != RAW_PROMPT else {"prompt_format": RAW_PROMPT}),
    }


def run_backend(config: RunConfig, model):
    """(the `platform.Backend` the run's steps take on the model's devices, its prefill
    chunk: --chunk, or the platform's for --batch_size rows); --attention cudnn off a GPU is
    a UsageError."""
    from dge_jax.distribution.sharding import mesh_context
    from dge_jax.runtime import platform

    with mesh_context(model.params):
        try:
            backend = platform.current(config.attention)
        except ValueError as e:
            raise UsageError(f"--attention: {e}") from e
        rows = platform.rows_per_device(config.batch_size)
    return backend, backend.chunk_for(rows) if config.chunk is None else config.chunk


def cell_config(identity: dict, cell: Cell) -> dict:
    """What a cell's predictions depend on: the run identity, cut to what the cell uses (a
    line's key hashes it, so a line is only ever reused by the cell that wrote it)."""
    uses_drafts = cell.timing in OBSERVES_DRAFTS
    stage = identity.get(LOOKAHEAD_KEY, dataclasses.asdict(Lookahead()))
    identity = {k: v for k, v in identity.items() if k != LOOKAHEAD_KEY}
    # only lookahead cells' lines hash the first stage (every other cell's key is unchanged)
    identity |= {LOOKAHEAD_KEY: stage} if cell.timing == "lookahead" else {}
    return {
        **identity, "cell": cell.id,
        RULE_OPTIONS_KEY: cell.rule_options(identity[RULE_OPTIONS_KEY]),
        "draft_weight": identity["draft_weight"] if uses_drafts else None,
        "ties": identity["ties"] if cell.rule != "full" else None,
        "adaptive": identity["adaptive"] if cell.adaptive else None,
    }


def data_checksums(config: RunConfig, datasets: list[str]) -> dict[str, str]:
    """sha256 of where each dataset's rows come from: the LongBench or RULER file, or the
    synthetic or RULER task's definition and the haystack (essays, word lists) it fills with."""
    return config.suite.checksums(config.rows, datasets)


def quiet_logging(verbose: bool) -> None:
    """Third-party INFO lines ("Unable to initialize backend 'tpu'", "generated new
    fontManager") read like errors; --verbose brings them back."""
    if not verbose:
        absl_logging.set_verbosity(absl_logging.WARNING)
        logging.getLogger().setLevel(logging.WARNING)


# Exit statuses: a mistake in the command or its inputs, a fault of the environment (a file
# system, another runner, memory), and Ctrl-C (128 + SIGINT, as a shell reports it).
USAGE, ENVIRONMENT, INTERRUPTED = 2, 1, 130


def run(argv) -> int:
    """The runner: every user mistake and environment fault ends in one `error: <what>;
    <fix>` line on stderr (exit 2 for a mistake, 1 for the environment; Ctrl-C: 130, saying
    what is saved); --verbose shows the traceback instead. The one reader of `FLAGS`."""
    verbose = FLAGS.verbose
    quiet_logging(verbose)
    state: dict = {"store": None, "saved_before": 0, "out_dir": None}
    try:
        if len(argv) > 1:
            raise UsageError(f"unexpected argument {argv[1]!r}: flags take one value each, "
                             "lists without spaces (--budgets 128,256); see --help")
        return evaluate(RunConfig.from_flags(FLAGS), state)
    except KeyboardInterrupt:
        if verbose:
            raise
        print(f"error: {interrupted(state)}", file=sys.stderr)
        return INTERRUPTED
    except Exception as e:
        status, message = error_line(e, state)
        if status is None or verbose:
            raise
        print(f"error: {message}", file=sys.stderr)
        return status


def saved(state: dict) -> str:
    """How many predictions the folder holds now (and how many this run added)."""
    store = state["store"]
    if store is None:
        return "no prediction was written"
    n, new = len(store.rows), len(store.rows) - state["saved_before"]
    return f"{n} predictions are saved in {store.path} ({new} by this run)"


def interrupted(state: dict) -> str:
    if state["store"] is None:
        return "interrupted before any prediction was written; rerun the command to start"
    return f"interrupted; {saved(state)}: rerun the same command to resume from them"


def error_line(e: BaseException, state: dict) -> tuple[int | None, str]:
    """(exit status, the `error:` line's text) of a user mistake or environment fault; (None,
    "") for anything else (a bug: its traceback is kept)."""
    if isinstance(e, RunFolderBusy | distributed.PeerFailed):
        return ENVIRONMENT, str(e)
    if isinstance(e, OSError) and e.errno is not None:  # from the operating system
        where = e.filename or "a file"
        out_dir = state["out_dir"]
        ours = out_dir is not None and e.filename is not None and (
            str(out_dir).startswith(str(e.filename)) or str(e.filename).startswith(str(out_dir)))
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            kept = f" ({saved(state)}, and are kept)" if state["store"] is not None else ""
            fix = (f"free space there (or pass another --out_dir) and rerun the same "
                   f"command{kept}")
        elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            fix = ("pass an --out_dir you can write" if ours else
                   "check its permissions (the runner writes only under --out_dir)")
        elif ours and e.errno in (errno.ENOTDIR, errno.EEXIST):
            fix = "--out_dir must name a folder (or a path where one can be made)"
        else:
            fix = "check the path and rerun (--verbose shows the traceback)"
        return ENVIRONMENT, f"{where}: {e.strerror}; {fix}"
    if isinstance(e, ValueError | FileNotFoundError):
        return USAGE, str(e)
    if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e)[:200]:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return ENVIRONMENT, (f"out of memory ({first[:160]}); lower --batch_size or "
                             "--max_length, or spread the model with --mesh")
    return None, ""


def generation_lengths(rows: dict[str, list[dict]]) -> dict[str, list[int]]:
    """Each dataset's distinct generation lengths, ascending (one, unless its rows carry
    their own: kvpress's)."""
    return {d: sorted({protocol.max_new_tokens(d, row) for row in r}) for d, r in rows.items()}


def grid_evictions(config: RunConfig, identity: dict, lengths: dict[str, list[int]]) -> dict:
    """Each cell's `Eviction`, checked against every dataset's generation lengths (a budget
    under the protected window, k over max_new_tokens) before anything is written."""
    from dge_jax.eviction.evict import check_eviction

    adaptive = config.adaptive()
    evictions = {}
    for c in config.cells:
        where = ""
        try:
            evictions[c] = ev = c.eviction(identity[RULE_OPTIONS_KEY], adaptive,
                                           config.draft_weight, config.ties, config.sliding,
                                           config.lookahead)
            for d, ns in lengths.items() if ev is not None else ():
                where = f" on {d}"
                for n in ns:
                    check_eviction(ev, n)
        except (ValueError, TypeError) as e:
            raise UsageError(f"cell {c.id}{where}: {e} (--window, --kernel, --pooling, --gqa, "
                             "--budgets and --k set these)") from e
    return evictions


def evaluate(config: RunConfig, state: dict) -> int:
    """Loads the model and the suite's rows (every flag is checked already, in `config`),
    then claims the run folder (nothing is written before), predicts every missing (sample,
    cell) and reports.

    `state["store"]` is the prediction store once the folder is claimed (for the message of
    an interrupted run)."""
    import dge_jax

    started = time.time()
    share, mesh = distributed.start(config.distributed, config.mesh)  # before any device use
    model = dge_jax.load(config.model, dtype=config.dtype, mesh=mesh)
    check_model(config, model, mesh)
    suite = config.suite
    datasets = list(config.datasets) if config.datasets is not None else None
    if datasets is None:
        try:
            datasets = suite.resolve(suite.default_datasets(config.rows), config.rows.metric)
        except ValueError as e:
            raise UsageError(str(e)) from e
    rows = suite_rows(model, suite, config.rows, datasets, config.num_samples)  # strict
    max_length, length_note = prompt_length(config, model, rows)
    if config.protocol != "query_aware":
        context_protocols.check_rows(rows, model.tokenizer, max_length, config.answer_prefix,
                                     config.protocol, config.anchor)
    identity = run_identity(config, model, max_length)
    evictions = grid_evictions(config, identity, generation_lengths(rows))
    data = data_checksums(config, datasets)
    extent = {"datasets": datasets, "cells": [c.id for c in config.cells],
              "num_samples": config.num_samples}
    out_dir = pathlib.Path(config.out_dir or default_out_dir(suite.name, config.model, identity))
    # Everything above only reads; from here on the folder is claimed, by one runner at once.
    state["out_dir"] = out_dir
    # the command as typed (sys.argv[0] is the module's file path under `python -m`)
    command = ("python -m experiments.longbench " + shlex.join(sys.argv[1:])).rstrip()

    def open_folder():
        return open_run(out_dir, identity, data, extent, command, extend=config.extend,
                        prompt=protocol.prompt_format_note(model.tokenizer))

    if share.first:
        print(length_note)
    with distributed.claimed(share, out_dir, open_folder, run_id(identity)):
        return predict(config, state, out_dir, model, rows, identity, evictions, max_length,
                       started, share)


def predict(config: RunConfig, state: dict, out_dir: pathlib.Path, model, rows: dict,
            identity: dict, evictions: dict, max_length: int, started: float,
            share: distributed.Share = distributed.ALONE) -> int:
    """Predicts every (sample, cell) the folder lacks (this process's batches of them),
    then writes the report (the first process, once every process is done)."""
    from dge_jax.generation import generate_grid
    from experiments.report import write_report

    cells = config.cells
    tag = {"run_id": run_id(identity)}
    cell_hash = {c: config_hash(cell_config(identity, c)) for c in cells}
    store = state["store"] = share.store(out_dir)
    state["saved_before"] = len(store.rows)
    pending = {d: missing_cells(r, d, cells, cell_hash, store) for d, r in rows.items()}
    distributed.all_read(share)  # every process has read the folder: writing may start
    work = distributed.assign(pending, config.batch_size, share)
    if config.protocol == "shared_context":  # one batch per context, all its questions
        work = context_protocols.assign_contexts(rows, pending, share, config.anchor)
    total = sum(map(len, rows.values()))
    todo = sum(map(len, pending.values()))
    mine = sum(len(b) for batches in work.values() for _, b in batches)
    options = config.rule_options
    where = "" if share.mode != "data" else (
        f"; process {share.index} of {share.count} predicts {mine} of them")
    print(f"{len(cells)} cells x {total} samples -> {out_dir} ({total - todo} samples done"
          f"{where}; SnapKV family: window {options['window']}, kernel {options['kernel']}, "
          f"{options['pooling']}-pool)")

    from tqdm import tqdm

    # initial= counts the samples already done without timing them, so the rate on resume is
    # the rate of this run's own samples.
    bar = (tqdm(total=total, initial=total - todo, unit="sample", dynamic_ncols=True)
           if share.mode != "data" else tqdm(total=mine, unit="sample", dynamic_ncols=True))
    grid = Grid(generate_grid, cells, cell_hash, evictions, max_length, tag)
    try:
        for dataset in rows:
            run_dataset(config, model, grid, dataset, work[dataset], store, bar, share.writes)
            if share.writes:
                bar.write(summary_line(dataset, store, cells, cell_hash))
    finally:
        bar.close()
    distributed.all_done(share)
    if not share.first:
        print(f"process {share.index}: " + (
            f"{saved(state)}" if share.writes else "every batch computed with process 0, "
            "which writes the predictions") + "; process 0 writes the report")
        return 0
    write_report(out_dir)
    print((out_dir / "results.md").read_text(), end="")
    where = store.path if share.count == 1 else f"{out_dir}/predictions*.jsonl"
    print(f"wall time {time.time() - started:.0f} s; predictions in {where}")
    return 0


def check_model(config: RunConfig, model, mesh) -> None:
    """Refuses a model the runner cannot use (no tokenizer, a batch the mesh cannot split)."""
    if model.tokenizer is None:
        raise ValueError(f"{config.model} has no tokenizer.json; the runner needs one")
    if mesh is not None:
        from dge_jax.distribution.sharding import row_multiple

        rows = row_multiple(model.config, dict(mesh.shape))
        if config.batch_size % rows:
            raise ValueError(f"--batch_size {config.batch_size} must be a multiple of {rows} "
                             f"to spread samples over the mesh {config.mesh}")


def missing_cells(rows, dataset, cells, cell_hash, store) -> list[tuple[dict, tuple[Cell, ...]]]:
    """(row, the cells it still lacks) for every row of `dataset` not fully predicted."""
    pending = []
    for row in rows:
        missing = tuple(c for c in cells
                        if prediction_key(cell_hash[c], dataset, row["_id"]) not in store.done)
        if missing:
            pending.append((row, missing))
    return pending


@dataclasses.dataclass(frozen=True)
class Grid:
    """What every batch of a run shares: the generator, the cells, their hashes (prediction
    keys) and evictions, the prompt length and the tag every line carries."""

    generate_grid: Callable
    cells: tuple[Cell, ...]
    cell_hash: dict
    evictions: dict
    max_length: int
    tag: dict


def run_dataset(config: RunConfig, model, grid: Grid, dataset: str, batches: list,
                store: PredictionStore, bar, writes: bool = True) -> None:
    """Predicts one dataset's `batches` (`batches_of`) and appends their lines to the store
    (`writes`; False: another process writes what this one computed)."""
    tok, suite = model.tokenizer, suites.for_dataset(dataset)
    stop = protocol.stop_rule(dataset)
    extra_eos = stop.extra_eos_ids(tok)
    for max_new, batch in batches:
        # Rows of one batch share one grid: the union of what any of them still misses.
        todo: list[Cell] = [c for c in grid.cells if any(c in m for _, m in batch)]
        samples = [protocol.model_sample(row, dataset, tok, grid.max_length,
                                         config.answer_prefix) for row, _ in batch]
        ids = [tok.encode(s.text) for s in samples]
        t0 = time.time()
        options = dict(max_new_tokens=max_new, extra_eos_ids=extra_eos, chunk=config.chunk,
                       min_new_tokens=stop.min_new_tokens, attention=config.attention,
                       sliding_cache=config.sliding_cache, kv_quant=config.kv_quant)  # fmt: skip
        evictions, order = [grid.evictions[c] for c in todo], None
        if config.protocol == "query_aware":
            results = grid.generate_grid(model, ids, evictions, **options)
        else:
            results, order = context_protocols.generate(
                model, tok, samples, batch, dataset, evictions, config.protocol, **options)
            ids = list(results[0].prompt_tokens)
        seconds = (time.time() - t0) / len(batch)
        lines = []
        for i, (row, missing) in enumerate(batch):
            for cell, result in zip(todo, results, strict=True):
                if order is not None and cell not in missing:  # a context's done rows
                    continue
                key_hash = grid.cell_hash[cell]
                lines.append({
                    "key": prediction_key(key_hash, dataset, row["_id"]),
                    "config_hash": key_hash, **grid.tag, "dataset": dataset,
                    "sample_id": row["_id"], "cell": cell.id, "pred": result.texts[i],
                    "answers": row["answers"], "all_classes": row["all_classes"],
                    "prompt_tokens": len(ids[i]), "new_tokens": len(result.tokens[i]),
                    "truncated": samples[i].truncated, "grid_seconds": round(seconds, 3),
                    "k": None if result.k is None else result.k[i],
                    **({} if order is None else {"question_index": order[i]}),
                    **({} if suite.row_groups is None else {"groups": suite.row_groups(row)}),
                })
        with predictions.sigint_deferred():  # a sample's lines are written whole, or not at all
            if writes:
                store.append(lines)
        bar.update(len(batch))


def summary_line(dataset: str, store: PredictionStore, cells, cell_hash) -> str:
    """`dataset: full 62.5 (n=3) | snapkv/prefill/b128 40.0 (n=3) | ...` over the rows done."""
    parts = []
    for cell in cells:
        rows = [r for r in store if r["dataset"] == dataset and
                r["config_hash"] == cell_hash[cell]]
        if rows:
            score = suites.score_dataset(dataset, [r["pred"] for r in rows],
                                  [r["answers"] for r in rows], rows[0]["all_classes"])
            parts.append(f"{cell.id} {score:.1f} (n={len(rows)})")
    return f"{dataset}: " + " | ".join(parts)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, except: -h is --help, the help flags exit 0 (absl exits 1), and a
    malformed flag is one `error:` line with exit status 2 (absl prints two lines, exit 1)."""
    if "--" in argv:
        cut = argv.index("--")
        argv = [*("--help" if a == "-h" else a for a in argv[:cut]), *argv[cut:]]
    else:
        argv = ["--help" if a == "-h" else a for a in argv]
    try:
        return FLAGS(argv)
    except SystemExit as e:  # the help flags print their text, then exit 1
        raise SystemExit(0 if e.code == 1 else e.code) from None
    except flags.Error as e:
        message = " ".join(str(e).split())
        print(f"error: {message}; see --help", file=sys.stderr)
        raise SystemExit(USAGE) from None


def main() -> None:
    try:
        app.run(run, flags_parser=parse_flags)
    except BrokenPipeError:  # stdout closed early (--help | head): no traceback at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0) from None


if __name__ == "__main__":
    main()
