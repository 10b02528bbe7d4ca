"""Evaluate FullKV, eviction baselines and their DGE / DGE-W versions on long-context tasks.

    python -m experiments.longbench                       # embedded SmolLM2, synthetic suite
    python -m experiments.longbench --suite longbench --data_dir DIR \\
        --methods full,snapkv,pyramidkv,h2o,streamingllm,adakv_snapkv \\
        --timings prefill,dge,dge_w --budgets 128,256,512
    python -m experiments.longbench --suite ruler --datasets niah_single_1,vt --ruler_length 4096

One prefill (and one draft per k) per sample serves every cell of the grid. Predictions are
appended to OUT_DIR/predictions.jsonl as they complete, so a killed run resumes where it
stopped; scores.json, results.md and plots are rewritten at the end (and can be rebuilt with
`python -m experiments.report OUT_DIR`). Every flag, dataset and data file is checked before
the folder is claimed; one runner at a time writes a folder (it holds OUT_DIR/.lock).

A mistake in the command or its inputs ends in one `error: <what>; <fix>` line and exit status
2, a fault of the environment (unwritable or full disk, a busy folder) in one line and status
1, Ctrl-C in one line saying how many predictions are saved (rerunning resumes) and status
130; --verbose shows the traceback instead.

SnapKV-family defaults here are KVCache-Factory's LongBench setting (window 8, kernel 7,
max-pool), not the SnapKV paper's window 32: on the embedded 135M model window 32 keeps almost
nothing useful at small budgets (DESIGN §6). Change them with --window/--kernel/--pooling.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pathlib
import re
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator

from absl import app, flags
from absl import logging as absl_logging

from dge_jax.eviction.timing import Adaptive
from dge_jax.rules.registry import POLICIES
from experiments import protocol, ruler, synthetic
from experiments.cells import POLICY_OPTIONS, Cell, build_cells
from experiments.longbench_config import ALL_TASKS
from experiments.predictions import PredictionStore, config_hash, prediction_key
from experiments.run_folder import (
    RunFolderBusy,
    default_out_dir,
    files_fingerprint,
    locked,
    open_run,
    run_id,
    sha256_file,
)

PROTOCOL = "longbench-v1-pred.py"  # experiments.protocol's steps; bump if they change
# The no-argument job (the README's first command) is chosen by measurement (RESULTS.md, the
# no-argument run): the synthetic tasks on which the embedded model's FullKV
# answers well at 512 tokens while SnapKV at budgets 128 / 256 falls far below it, enough
# samples for a paired test, batches of 4, and all of it in under 5 minutes on a 2-core CPU.
MAIN_JOB_TASKS = ("passkey", "essay_qa")
SYNTHETIC_SAMPLES = 20  # --num_samples default of the synthetic suite

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "checkpoint folder or embedded name")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "parameter dtype")
flags.DEFINE_enum("suite", "synthetic", ["synthetic", "longbench", "ruler"], "task suite")
flags.DEFINE_string("data_dir", None, "folder of LongBench {dataset}.jsonl files "
                    f"(default: ${protocol.DATA_DIR_ENV}); for --suite ruler, of RULER "
                    "{task}_{length}.jsonl files to read instead of generating the rows "
                    f"(default: ${ruler.DATA_DIR_ENV}'s file where it holds one, else generated)")
flags.DEFINE_list("datasets", None, "datasets/tasks to run (default: synthetic "
                  f"{','.join(MAIN_JOB_TASKS)}; longbench: those present in --data_dir; ruler: "
                  "all eleven, or those present in --data_dir)")
flags.DEFINE_list("methods", ["full", "snapkv"], f"{', '.join(POLICIES)}, <wrapper>_<rule> "
                  "(criticalkv_expectedattention), adakv_<policy> (AdaKV head budgets) and "
                  "global_<policy> (one pool across layers and heads)")
flags.DEFINE_list("timings", ["prefill", "dge", "dge_w"], "prefill, dge, dge_w; decode "
                  "(compress only while decoding, at each --decode_budgets)")
flags.DEFINE_list("k", ["2"], "answer tokens drafted with the full cache before DGE eviction")
flags.DEFINE_list("budgets", ["128", "256"], "entries kept per kv head")
flags.DEFINE_list("decode_budgets", [], "also compress while decoding: each cell gets variants "
                  "that every --intervals new tokens go back to these entries per kv head "
                  "(cells .../d<budget>/i<interval>)")
flags.DEFINE_list("intervals", ["32"], "decode steps between compressions (with "
                  "--decode_budgets)")
flags.DEFINE_integer("num_samples", None, "samples per dataset (default: synthetic and ruler "
                     f"{SYNTHETIC_SAMPLES}, longbench all)")
flags.DEFINE_integer("max_length", None, "prompt tokens kept by middle truncation (default: "
                     "the model's context minus the longest generation, chat template and "
                     "answer prefix)")
flags.DEFINE_integer("synthetic_length", 512, "synthetic prompt length in model tokens "
                     "(before the chat template)")
flags.DEFINE_integer("ruler_length", 4096, "RULER's max_seq_length in model tokens: the prompt "
                     "(chat template and answer prefix included) plus the task's generation "
                     "budget; also the {length} of RULER row files")
flags.DEFINE_bool("answer_prefix", True, "synthetic and RULER suites: end each prompt with the "
                  "task's answer prefix (e.g. 'The pass key is'); --noanswer_prefix lets the "
                  "model start its answer unprompted")
flags.DEFINE_integer("batch_size", 4, "samples per batch (left-padded)")
flags.DEFINE_string("out_dir", None, "output folder (default runs/<suite>/<model>-<run id>: "
                    "one folder per configuration)")
flags.DEFINE_bool("extend", False, "add cells, datasets or samples to an --out_dir that holds "
                  "the same configuration (without it, asking for more than it holds is "
                  "refused)")
flags.DEFINE_bool("verbose", False, "show third-party INFO logging and tracebacks of errors")
flags.DEFINE_integer("seed", 0, "synthetic and RULER suite seed (decoding is greedy)")
flags.DEFINE_integer("window", 8, "observation window (SnapKV/PyramidKV) or recent window "
                     "(H2O)")
flags.DEFINE_integer("kernel", 7, "SnapKV/PyramidKV pooling kernel")
flags.DEFINE_enum("pooling", "max", ["max", "avg"], "SnapKV/PyramidKV pooling")
flags.DEFINE_enum("gqa", "mean", ["mean", "max"], "GQA aggregation of scores")
flags.DEFINE_bool("gqa_before_pool", False, "SnapKV/PyramidKV: aggregate the kv group's "
                  "attention before pooling (default: pool each query head first, kvpress's "
                  "order)")
flags.DEFINE_enum("ties", "later", ["later", "earlier"], "which of equal scores is kept: the "
                  "later slot (default) or the earlier position")
flags.DEFINE_integer("chunk", 512, "prefill chunk (tokens)")
flags.DEFINE_string("mesh", None, "device mesh, e.g. data=2,model=4: parameters and caches are "
                    "sharded, and each batch of --batch_size samples is spread over the data "
                    "axis (--batch_size must then be a multiple of it)")
flags.DEFINE_enum("adaptive_rule", None, ["entropy", "top1"], "also run adaptive-k DGE cells "
                  "that stop drafting when the next-token entropy rises above / top-1 "
                  "probability falls below --adaptive_threshold")
flags.DEFINE_float("adaptive_threshold", 1.0, "threshold of --adaptive_rule")
flags.DEFINE_integer("k_max", 8, "most answer tokens an adaptive cell drafts")
flags.DEFINE_float("draft_weight", 1.0, "weight of draft queries relative to prompt-window "
                   "queries in DGE scores (1 = the paper's DGE)")


class UsageError(ValueError):
    """A mistake in the command line: one `error: ...` line and exit status 2."""


def list_flag(name: str, integers: bool = False, may_be_empty: bool = False) -> list | None:
    """The items of list flag --name, each checked: no empty list (unless `may_be_empty`), no
    empty item (a stray comma), no repeat, and with `integers` whole numbers >= 1 (as ints).
    None when the flag has no default and was not given (--datasets)."""
    items = getattr(FLAGS, name)
    if items is None:
        return None
    default = FLAGS[name].default
    example = f"--{name} {','.join(default)}" if default else f"--{name} a,b"
    if not items and not may_be_empty:
        raise UsageError(f"--{name} is empty; give one or more comma-separated items, e.g. "
                         f"{example}" + ("" if default else f", or leave --{name} out"))
    values: list = []
    for item in items:
        if item == "":
            raise UsageError(f"--{name} {','.join(items)!r} has an empty item; remove the "
                             "stray comma")
        value: int | str = item
        if integers:
            if not re.fullmatch(r"[-+]?[0-9]+", item):
                raise UsageError(f"--{name}: {item!r} is not an integer; give comma-separated "
                                 f"whole numbers, e.g. {example}")
            value = int(item)
            if value < 1:
                raise UsageError(f"--{name} must be >= 1, got {item!r}; give comma-separated "
                                 f"whole numbers, e.g. {example}")
        if value in values:
            raise UsageError(f"--{name} gives {item!r} twice; give each item once")
        values.append(value)
    return values


def default_datasets(suite: str, data_dir: str | None, ruler_length: int = 4096) -> list[str]:
    """The main job's synthetic tasks; for LongBench, those whose file is in the data folder;
    for RULER, every task, or those whose {task}_{length}.jsonl is in --data_dir."""
    if suite == "synthetic":
        return list(MAIN_JOB_TASKS)
    if suite == "ruler":
        if data_dir is None:
            return list(ruler.TASKS)
        present = [d for d, t in ruler.TASKS.items()
                   if (pathlib.Path(data_dir) / f"{t.name}_{ruler_length}.jsonl").is_file()]
        if not present:
            raise FileNotFoundError(f"{data_dir} holds no RULER {{task}}_{ruler_length}.jsonl "
                                    "file (leave --data_dir out to generate the rows)")
        return present
    folder = protocol.resolve_data_dir(data_dir)
    present = [d for d in ALL_TASKS if (folder / f"{d}.jsonl").is_file()]
    if not present:
        raise FileNotFoundError(f"{folder} holds no LongBench {{dataset}}.jsonl file")
    return present


def load_suite(model, suite: str, datasets: list[str], num_samples: int | None,
               data_dir: str | None, length: int, seed: int) -> dict[str, list[dict]]:
    """Rows per dataset, in the official schema (generated for the synthetic suite)."""
    if suite == "synthetic":
        unknown = [d for d in datasets if d not in synthetic.TASKS]
        if unknown:
            raise ValueError(f"unknown synthetic tasks {unknown}; known: {list(synthetic.TASKS)}")
        return synthetic.make_suite(model.tokenizer, datasets, num_samples, length, seed)
    if suite == "ruler":  # files where there are some, else generated (ruler.rows_file)
        return ruler.load_suite(model.tokenizer, model.tokenizer.apply_chat_template, datasets,
                                num_samples, length, seed, data_dir)
    return {d: protocol.load_rows(data_dir, d, num_samples) for d in datasets}


def run_identity(model, max_length: int) -> dict:
    """Everything besides the grid and the samples that changes a prediction: a run folder
    holds one identity (`experiments.run_folder`)."""
    import dge_jax

    return {
        "model": str(FLAGS.model), "model_files": files_fingerprint(model.path),
        "dtype": FLAGS.dtype, "suite": FLAGS.suite, "protocol": PROTOCOL,
        "dge_jax": dge_jax.__version__, "max_length": max_length, "chunk": FLAGS.chunk,
        "batch_size": FLAGS.batch_size,  # left padding may change results in the last bits
        "synthetic_length": FLAGS.synthetic_length if FLAGS.suite == "synthetic" else None,
        "seed": FLAGS.seed if FLAGS.suite in ("synthetic", "ruler") else None,
        **({"ruler_length": FLAGS.ruler_length} if FLAGS.suite == "ruler" else {}),
        # only when off, so the folders of every earlier run keep their identity
        **({} if FLAGS.answer_prefix else {"answer_prefix": False}),
        "policy_options": {k: getattr(FLAGS, k) for k in POLICY_OPTIONS},
        "draft_weight": FLAGS.draft_weight, "ties": FLAGS.ties,
        "adaptive": (None if FLAGS.adaptive_rule is None else
                     {"rule": FLAGS.adaptive_rule, "threshold": FLAGS.adaptive_threshold,
                      "k_max": FLAGS.k_max}),
    }


def cell_config(identity: dict, cell: Cell) -> dict:
    """What a cell's predictions depend on: the run identity, cut to what the cell uses (a
    line's key hashes it, so a line is only ever reused by the cell that wrote it)."""
    uses_drafts = cell.timing == "dge"
    return {
        **identity, "cell": cell.id,
        "policy_options": cell.policy_options(identity["policy_options"]),
        "draft_weight": identity["draft_weight"] if uses_drafts else None,
        "ties": identity["ties"] if cell.method != "full" else None,
        "adaptive": identity["adaptive"] if cell.adaptive else None,
    }


def data_checksums(datasets: list[str]) -> dict[str, str]:
    """sha256 of where each dataset's rows come from: the LongBench or RULER file, or the
    synthetic or RULER task's definition and the haystack (essays, word lists) it fills with."""
    if FLAGS.suite == "longbench":
        folder = protocol.resolve_data_dir(FLAGS.data_dir)
        return {d: sha256_file(folder / f"{d}.jsonl") for d in datasets}
    if FLAGS.suite == "ruler":
        files = {d: ruler.rows_file(d, FLAGS.ruler_length, FLAGS.data_dir) for d in datasets}
        return {d: sha256_file(path) if path else
                config_hash(ruler.generator_definition(d, FLAGS.ruler_length))
                for d, path in files.items()}
    haystack = files_fingerprint(synthetic.haystack_dir())
    return {d: config_hash({"task": repr(synthetic.TASKS[d]), "haystack": haystack})
            for d in datasets}


def quiet_logging() -> None:
    """Third-party INFO lines ("Unable to initialize backend 'tpu'", "generated new
    fontManager") read like errors; --verbose brings them back."""
    if not FLAGS.verbose:
        absl_logging.set_verbosity(absl_logging.WARNING)
        logging.getLogger().setLevel(logging.WARNING)


# Exit statuses: a mistake in the command or its inputs, a fault of the environment (a file
# system, another runner, memory), and Ctrl-C (128 + SIGINT, as a shell reports it).
USAGE, ENVIRONMENT, INTERRUPTED = 2, 1, 130


def run(argv) -> int:
    """The runner: every user mistake and environment fault ends in one `error: <what>;
    <fix>` line on stderr (exit 2 for a mistake, 1 for the environment; Ctrl-C: 130, saying
    what is saved); --verbose shows the traceback instead."""
    quiet_logging()
    state: dict = {"store": None, "saved_before": 0, "out_dir": None}
    try:
        if len(argv) > 1:
            raise UsageError(f"unexpected argument {argv[1]!r}: flags take one value each, "
                             "lists without spaces (--budgets 128,256); see --help")
        return evaluate(state)
    except KeyboardInterrupt:
        if FLAGS.verbose:
            raise
        print(f"error: {interrupted(state)}", file=sys.stderr)
        return INTERRUPTED
    except Exception as e:
        status, message = error_line(e, state)
        if status is None or FLAGS.verbose:
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
    if isinstance(e, RunFolderBusy):
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


def check_scalar_flags() -> None:
    """Refuses integer and number flags out of range (before anything is loaded or written)."""
    least = {"batch_size": 1, "chunk": 1, "num_samples": 1, "max_length": 2,
             "synthetic_length": 1, "ruler_length": 1, "window": 0, "kernel": 1}
    if FLAGS.adaptive_rule:
        least["k_max"] = 1
    for name, low in least.items():
        value = getattr(FLAGS, name)
        if value is not None and value < low:
            raise UsageError(f"--{name} must be >= {low}, got {value}; see --help")
    if FLAGS.draft_weight < 0:
        raise UsageError(f"--draft_weight must be >= 0, got {FLAGS.draft_weight}; see --help")
    if not FLAGS.answer_prefix and FLAGS.suite == "longbench":
        raise UsageError("--noanswer_prefix: LongBench prompts have no answer prefix; it "
                         "applies to --suite synthetic and --suite ruler")


def check_datasets(suite: str, datasets: list[str] | None) -> list[str] | None:
    """The datasets named on the command line, known to the suite (RULER's names as ours)."""
    if datasets is None:
        return None
    if suite == "ruler":  # RULER's task names (vt) or ours (ruler_vt)
        return [ruler.dataset_name(d) for d in datasets]
    known = synthetic.TASKS if suite == "synthetic" else ALL_TASKS
    unknown = [d for d in datasets if d not in known]
    if unknown:
        raise UsageError(f"unknown {suite} tasks {unknown} in --datasets; known: "
                         f"{sorted(known)}")
    return datasets


def grid_evictions(cells: list[Cell], identity: dict, datasets: list[str]) -> dict:
    """Each cell's `Eviction`, checked against every dataset's generation length (a budget
    under the protected window, k over max_new_tokens) before anything is written."""
    from dge_jax.eviction.evict import check_eviction

    adaptive = (None if FLAGS.adaptive_rule is None else
                Adaptive(FLAGS.adaptive_rule, FLAGS.adaptive_threshold))
    evictions = {}
    for c in cells:
        where = ""
        try:
            evictions[c] = ev = c.eviction(identity["policy_options"], adaptive,
                                           FLAGS.draft_weight, FLAGS.ties)
            for d in datasets if ev is not None else ():
                where = f" on {d}"
                check_eviction(ev, protocol.max_new_tokens(d))
        except (ValueError, TypeError) as e:
            raise UsageError(f"cell {c.id}{where}: {e} (--window, --kernel, --pooling, --gqa, "
                             "--budgets and --k set these)") from e
    return evictions


def evaluate(state: dict) -> int:
    """Checks every flag, loads the model and the suite, then claims the run folder (nothing
    is written before), predicts every missing (sample, cell) and reports.

    `state["store"]` is the prediction store once the folder is claimed (for the message of
    an interrupted run)."""
    import dge_jax
    from dge_jax.generation import generate_grid

    started = time.time()
    cells = build_cells(list_flag("methods"), list_flag("timings"),
                        list_flag("k", integers=True), list_flag("budgets", integers=True),
                        adaptive_k_max=FLAGS.k_max if FLAGS.adaptive_rule else None,
                        decode_budgets=list_flag("decode_budgets", integers=True,
                                                 may_be_empty=True),
                        intervals=list_flag("intervals", integers=True))
    check_scalar_flags()
    datasets = check_datasets(FLAGS.suite, list_flag("datasets"))
    mesh = None
    if FLAGS.mesh:
        from dge_jax.runtime.sharding import parse_mesh

        mesh = parse_mesh(FLAGS.mesh)
    model = dge_jax.load(FLAGS.model, dtype=FLAGS.dtype, mesh=mesh)
    check_model(model, mesh)
    if datasets is None:
        datasets = check_datasets(FLAGS.suite, default_datasets(FLAGS.suite, FLAGS.data_dir,
                                                                FLAGS.ruler_length))
    num_samples = FLAGS.num_samples or (SYNTHETIC_SAMPLES if FLAGS.suite != "longbench"
                                        else None)
    length = FLAGS.ruler_length if FLAGS.suite == "ruler" else FLAGS.synthetic_length
    suite = load_suite(model, FLAGS.suite, datasets, num_samples, FLAGS.data_dir, length,
                       FLAGS.seed)  # strict: bad rows stop here
    max_length = FLAGS.max_length or default_max_length(model, suite)
    if max_length < 2:
        raise UsageError(f"{FLAGS.model}'s context ({model.config.max_position_embeddings} "
                         f"positions) leaves no room for prompts of {', '.join(datasets)} "
                         "once their answers fit; use a model with a longer context")
    identity = run_identity(model, max_length)
    evictions = grid_evictions(cells, identity, datasets)
    data = data_checksums(datasets)
    extent = {"datasets": datasets, "cells": [c.id for c in cells], "num_samples": num_samples}
    out_dir = pathlib.Path(FLAGS.out_dir or default_out_dir(FLAGS.suite, FLAGS.model, identity))
    # Everything above only reads; from here on the folder is claimed, by one runner at once.
    state["out_dir"] = out_dir
    # the command as typed (sys.argv[0] is the module's file path under `python -m`)
    command = ("python -m experiments.longbench " + shlex.join(sys.argv[1:])).rstrip()
    with locked(out_dir):
        open_run(out_dir, identity, data, extent, command, extend=FLAGS.extend)
        return predict(state, out_dir, model, generate_grid, suite, cells, identity,
                       evictions, max_length, started)


def predict(state, out_dir, model, generate_grid, suite, cells, identity, evictions,
            max_length, started) -> int:
    """Predicts every (sample, cell) the folder lacks, then writes the report."""
    from experiments.report import write_report

    tag = {"run_id": run_id(identity)}
    cell_hash = {c: config_hash(cell_config(identity, c)) for c in cells}
    store = state["store"] = PredictionStore(out_dir)
    state["saved_before"] = len(store.rows)
    pending = {d: missing_cells(rows, d, cells, cell_hash, store) for d, rows in suite.items()}
    total = sum(map(len, suite.values()))
    todo = sum(map(len, pending.values()))
    print(f"{len(cells)} cells x {total} samples -> {out_dir} ({total - todo} samples done; "
          f"SnapKV family: window {FLAGS.window}, kernel {FLAGS.kernel}, {FLAGS.pooling}-pool)")

    from tqdm import tqdm

    # initial= counts the samples already done without timing them, so the rate on resume is
    # the rate of this run's own samples.
    bar = tqdm(total=total, initial=total - todo, unit="sample", dynamic_ncols=True)
    try:
        for dataset in suite:
            run_dataset(model, generate_grid, dataset, pending[dataset], cells, cell_hash,
                        evictions, max_length, store, bar, tag)
            bar.write(summary_line(dataset, store, cells, cell_hash))
    finally:
        bar.close()
    write_report(out_dir)
    print((out_dir / "results.md").read_text(), end="")
    print(f"wall time {time.time() - started:.0f} s; predictions in {store.path}")
    return 0


def default_max_length(model, suite: dict[str, list[dict]]) -> int:
    """The model's context minus, for the most demanding dataset, its generation length and
    what the chat template and answer prefix add around the truncated prompt, so that every
    prompt the runner feeds, with its answer, fits the context."""
    tok = model.tokenizer
    wrap = len(tok.encode(tok.apply_chat_template("")))  # the template around an empty turn
    need = max(protocol.max_new_tokens(d) + wrap + max(
        (len(tok.encode(protocol.answer_prefix(d, row))) for row in rows), default=0)
        for d, rows in suite.items())
    return model.config.max_position_embeddings - need


def check_model(model, mesh) -> None:
    """Refuses a model the runner cannot use (no tokenizer, a batch the mesh cannot split)."""
    if model.tokenizer is None:
        raise ValueError(f"{FLAGS.model} has no tokenizer.json; the runner needs one")
    if mesh is not None:
        from dge_jax.runtime.sharding import row_multiple

        rows = row_multiple(model.config, dict(mesh.shape))
        if FLAGS.batch_size % rows:
            raise ValueError(f"--batch_size {FLAGS.batch_size} must be a multiple of {rows} "
                             f"to spread samples over the mesh {FLAGS.mesh}")


def missing_cells(rows, dataset, cells, cell_hash, store) -> list[tuple[dict, tuple[Cell, ...]]]:
    """(row, the cells it still lacks) for every row of `dataset` not fully predicted."""
    pending = []
    for row in rows:
        missing = tuple(c for c in cells
                        if prediction_key(cell_hash[c], dataset, row["_id"]) not in store.done)
        if missing:
            pending.append((row, missing))
    return pending


def run_dataset(model, generate_grid, dataset, pending, cells, cell_hash, evictions, max_length,
                store, bar, tag) -> None:
    """Predicts the pending (row, cells) of one dataset, a batch of samples at a time."""
    tok = model.tokenizer
    stop = protocol.stop_rule(dataset)
    extra_eos = stop.extra_eos_ids(tok)
    max_new = protocol.max_new_tokens(dataset)
    for start in range(0, len(pending), FLAGS.batch_size):
        batch = pending[start:start + FLAGS.batch_size]
        # Rows of one batch share one grid: the union of what any of them still misses.
        todo: list[Cell] = [c for c in cells if any(c in m for _, m in batch)]
        samples = [protocol.prepare_sample(row, dataset, tok, max_length,
                                           tok.apply_chat_template, FLAGS.answer_prefix)
                   for row, _ in batch]
        ids = [tok.encode(s.text) for s in samples]
        t0 = time.time()
        results = generate_grid(model, ids, [evictions[c] for c in todo],
                                max_new_tokens=max_new, extra_eos_ids=extra_eos,
                                min_new_tokens=stop.min_new_tokens, chunk=FLAGS.chunk)
        seconds = (time.time() - t0) / len(batch)
        lines = []
        for i, (row, _) in enumerate(batch):
            for cell, result in zip(todo, results, strict=True):
                lines.append({
                    "key": prediction_key(cell_hash[cell], dataset, row["_id"]),
                    "config_hash": cell_hash[cell], **tag, "dataset": dataset,
                    "sample_id": row["_id"], "cell": cell.id, "pred": result.texts[i],
                    "answers": row["answers"], "all_classes": row["all_classes"],
                    "prompt_tokens": len(ids[i]), "new_tokens": len(result.tokens[i]),
                    "truncated": samples[i].truncated, "grid_seconds": round(seconds, 3),
                    "k": None if result.k is None else result.k[i],
                })
        with sigint_deferred():  # a sample's lines are written whole, or not at all
            store.append(lines)
        bar.update(len(batch))


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Holds Ctrl-C back while in the block: it is acted on (KeyboardInterrupt) right after.

    A Python-level handler, not a signal mask: XLA's threads would take a masked SIGINT and
    the interpreter would still raise it in the main thread, inside the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list = []
    previous = signal.signal(signal.SIGINT, lambda *args: caught.append(args))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(*caught[0])


def summary_line(dataset: str, store: PredictionStore, cells, cell_hash) -> str:
    """`dataset: full 62.5 (n=3) | snapkv/prefill/b128 40.0 (n=3) | ...` over the rows done."""
    from experiments.metrics import score_dataset

    parts = []
    for cell in cells:
        rows = [r for r in store if r["dataset"] == dataset and
                r["config_hash"] == cell_hash[cell]]
        if rows:
            score = score_dataset(dataset, [r["pred"] for r in rows],
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
