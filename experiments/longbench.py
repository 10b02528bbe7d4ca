"""Evaluate FullKV, eviction baselines and their DGE / DGE-W versions on long-context tasks.

    python -m experiments.longbench                       # embedded SmolLM2, synthetic suite
    python -m experiments.longbench --suite longbench --data_dir DIR \\
        --methods full,snapkv,pyramidkv,h2o,streamingllm,adakv_snapkv \\
        --timings prefill,dge,dge_w --budgets 128,256,512

One prefill (and one draft per k) per sample serves every cell of the grid. Predictions are
appended to OUT_DIR/predictions.jsonl as they complete, so a killed run resumes where it
stopped; scores.json, results.md and plots are rewritten at the end (and can be rebuilt with
`python -m experiments.report OUT_DIR`).

SnapKV-family defaults here are KVCache-Factory's LongBench setting (window 8, kernel 7,
max-pool), not the SnapKV paper's window 32: on the embedded 135M model window 32 keeps almost
nothing useful at small budgets (DESIGN §6). Change them with --window/--kernel/--pooling.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from absl import app, flags

from dge_jax.timing import Adaptive
from experiments import protocol, synthetic
from experiments.cells import POLICY_OPTIONS, Cell, build_cells
from experiments.longbench_config import ALL_TASKS
from experiments.predictions import PredictionStore, config_hash, prediction_key

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "checkpoint folder or embedded name")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "parameter dtype")
flags.DEFINE_enum("suite", "synthetic", ["synthetic", "longbench"], "task suite")
flags.DEFINE_string("data_dir", None, "folder of LongBench {dataset}.jsonl files "
                    f"(default: ${protocol.DATA_DIR_ENV})")
flags.DEFINE_list("datasets", None, "datasets/tasks to run (default: all of the suite; for "
                  "longbench, those present in --data_dir)")
flags.DEFINE_list("methods", ["full", "snapkv"], "full, snapkv, pyramidkv, h2o, streamingllm, "
                  "random, knorm, tova, and adakv_<policy>")
flags.DEFINE_list("timings", ["prefill", "dge", "dge_w"], "prefill, dge, dge_w")
flags.DEFINE_list("k", ["2"], "answer tokens drafted with the full cache before DGE eviction")
flags.DEFINE_list("budgets", ["128", "256"], "entries kept per kv head")
flags.DEFINE_integer("num_samples", None, "samples per dataset (default: synthetic 3, "
                     "longbench all)")
flags.DEFINE_integer("max_length", None, "prompt tokens kept by middle truncation (default: "
                     "the model's context minus the longest generation)")
flags.DEFINE_integer("synthetic_length", 960, "synthetic prompt length in model tokens "
                     "(with the chat template, prompts fit the 1024-token bucket)")
flags.DEFINE_integer("batch_size", 1, "samples per batch (left-padded)")
flags.DEFINE_string("out_dir", None, "output folder (default runs/<suite>)")
flags.DEFINE_integer("seed", 0, "synthetic suite seed (decoding is greedy)")
flags.DEFINE_integer("window", 8, "observation window (SnapKV/PyramidKV) or recent window "
                     "(H2O)")
flags.DEFINE_integer("kernel", 7, "SnapKV/PyramidKV pooling kernel")
flags.DEFINE_enum("pooling", "max", ["max", "avg"], "SnapKV/PyramidKV pooling")
flags.DEFINE_enum("gqa", "mean", ["mean", "max"], "GQA aggregation of scores")
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


def default_datasets(suite: str, data_dir: str | None) -> list[str]:
    """All tasks of the suite; for LongBench, the ones whose file is in the data folder."""
    if suite == "synthetic":
        return list(synthetic.TASKS)
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
        return synthetic.make_suite(model.tokenizer, datasets, num_samples or 3, length, seed)
    return {d: protocol.load_rows(data_dir, d, num_samples) for d in datasets}


def run_config(model_name: str, max_length: int) -> dict:
    """Everything besides the cell that changes a prediction (hashed into each line's key)."""
    return {
        "model": model_name, "dtype": FLAGS.dtype, "suite": FLAGS.suite,
        "max_length": max_length, "chunk": FLAGS.chunk,
        "synthetic_length": FLAGS.synthetic_length if FLAGS.suite == "synthetic" else None,
        "seed": FLAGS.seed if FLAGS.suite == "synthetic" else None,
        "policy_options": {k: getattr(FLAGS, k) for k in POLICY_OPTIONS},
        "draft_weight": FLAGS.draft_weight,
        "adaptive": (None if FLAGS.adaptive_rule is None else
                     {"rule": FLAGS.adaptive_rule, "threshold": FLAGS.adaptive_threshold}),
    }


def cell_config(config: dict, cell: Cell) -> dict:
    """What a cell's predictions depend on: the run settings, cut to what the cell uses (so
    changing SnapKV's window does not recompute FullKV or StreamingLLM)."""
    uses_drafts = cell.timing == "dge"
    return {
        **config, "cell": cell.id,
        "policy_options": cell.policy_options(config["policy_options"]),
        "draft_weight": config["draft_weight"] if uses_drafts else None,
        "adaptive": config["adaptive"] if cell.adaptive else None,
        "batch_size": FLAGS.batch_size,  # left padding may change results in the last bits
    }


def run(argv) -> int:
    del argv
    import dge_jax
    from dge_jax.api import generate_grid
    from experiments.report import write_report

    started = time.time()
    mesh = None
    if FLAGS.mesh:
        from dge_jax.sharding import parse_mesh, row_multiple

        mesh = parse_mesh(FLAGS.mesh)
    model = dge_jax.load(FLAGS.model, dtype=FLAGS.dtype, mesh=mesh)
    if mesh is not None:
        rows = row_multiple(model.config, dict(mesh.shape))
        if FLAGS.batch_size % rows:
            raise ValueError(f"--batch_size {FLAGS.batch_size} must be a multiple of {rows} "
                             f"to spread samples over the mesh {FLAGS.mesh}")
    if model.tokenizer is None:
        raise ValueError(f"{FLAGS.model} has no tokenizer.json; the runner needs one")
    cells = build_cells(FLAGS.methods, FLAGS.timings, [int(k) for k in FLAGS.k],
                        [int(b) for b in FLAGS.budgets],
                        adaptive_k_max=FLAGS.k_max if FLAGS.adaptive_rule else None)
    datasets = FLAGS.datasets or default_datasets(FLAGS.suite, FLAGS.data_dir)
    longest = max(protocol.max_new_tokens(d) for d in datasets)
    max_length = FLAGS.max_length or model.config.max_position_embeddings - longest
    out_dir = pathlib.Path(FLAGS.out_dir or f"runs/{FLAGS.suite}")
    out_dir.mkdir(parents=True, exist_ok=True)
    config = run_config(str(FLAGS.model), max_length)
    (out_dir / "config.json").write_text(json.dumps(
        {**config, "datasets": datasets, "cells": [c.id for c in cells],
         "num_samples": FLAGS.num_samples, "batch_size": FLAGS.batch_size,
         "command": " ".join(sys.argv)}, indent=2) + "\n")
    cell_hash = {c: config_hash(cell_config(config, c)) for c in cells}
    adaptive = (None if FLAGS.adaptive_rule is None else
                Adaptive(FLAGS.adaptive_rule, FLAGS.adaptive_threshold))
    evictions = {c: c.eviction(config["policy_options"], adaptive, FLAGS.draft_weight)
                 for c in cells}
    suite = load_suite(model, FLAGS.suite, datasets, FLAGS.num_samples, FLAGS.data_dir,
                       FLAGS.synthetic_length, FLAGS.seed)
    store = PredictionStore(out_dir)
    print(f"{len(cells)} cells x {sum(map(len, suite.values()))} samples -> {out_dir} "
          f"(SnapKV family: window {FLAGS.window}, kernel {FLAGS.kernel}, {FLAGS.pooling}-pool)")

    from tqdm import tqdm

    bar = tqdm(total=sum(map(len, suite.values())), unit="sample", dynamic_ncols=True)
    for dataset, rows in suite.items():
        run_dataset(model, generate_grid, dataset, rows, cells, cell_hash, evictions,
                    max_length, store, bar)
        bar.write(summary_line(dataset, store, cells, cell_hash))
    bar.close()
    write_report(out_dir)
    print((out_dir / "results.md").read_text(), end="")
    print(f"wall time {time.time() - started:.0f} s; predictions in {store.path}")
    return 0


def run_dataset(model, generate_grid, dataset, rows, cells, cell_hash, evictions, max_length,
                store, bar) -> None:
    """Predicts every missing (sample, cell) of one dataset, a batch of samples at a time."""
    tok = model.tokenizer
    stop = protocol.stop_rule(dataset)
    extra_eos = stop.extra_eos_ids(tok)
    max_new = protocol.max_new_tokens(dataset)
    pending = []
    for row in rows:
        missing = [c for c in cells
                   if prediction_key(cell_hash[c], dataset, row["_id"]) not in store.done]
        if missing:
            pending.append((row, tuple(missing)))
        else:
            bar.update(1)
    for start in range(0, len(pending), FLAGS.batch_size):
        batch = pending[start:start + FLAGS.batch_size]
        # Rows of one batch share one grid: the union of what any of them still misses.
        todo: list[Cell] = [c for c in cells if any(c in m for _, m in batch)]
        samples = [protocol.prepare_sample(row, dataset, tok, max_length,
                                           tok.apply_chat_template) for row, _ in batch]
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
                    "config_hash": cell_hash[cell], "dataset": dataset,
                    "sample_id": row["_id"], "cell": cell.id, "pred": result.texts[i],
                    "answers": row["answers"], "all_classes": row["all_classes"],
                    "prompt_tokens": len(ids[i]), "new_tokens": len(result.tokens[i]),
                    "truncated": samples[i].truncated, "grid_seconds": round(seconds, 3),
                    "k": None if result.k is None else result.k[i],
                })
        store.append(lines)
        bar.update(len(batch))


def summary_line(dataset: str, store: PredictionStore, cells, cell_hash) -> str:
    """`dataset: full 62.5 | snapkv/prefill/b128 40.0 | ...` over the rows done so far."""
    from experiments.metrics import score_dataset

    parts = []
    for cell in cells:
        rows = [r for r in store if r["dataset"] == dataset and
                r["config_hash"] == cell_hash[cell]]
        if rows:
            score = score_dataset(dataset, [r["pred"] for r in rows],
                                  [r["answers"] for r in rows], rows[0]["all_classes"])
            parts.append(f"{cell.id} {score:.1f}")
    return f"{dataset}: " + " | ".join(parts)


def main() -> None:
    app.run(run)


if __name__ == "__main__":
    main()
