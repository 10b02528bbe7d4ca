"""dge_jax side by side with transformers and kvpress: speed, memory, compile cost, agreement.

    bash benchmarks/peers/setup_peers.sh                    # once: the peers' venv (kvpress 0.5.5)
    python -m benchmarks.run --suite cpu              # the full CPU suite (tens of minutes)
    python -m benchmarks.run --suite cpu --quick      # small sizes: every code path, minutes
    python -m benchmarks.run --suite gpu              # one NVIDIA GPU, JAX's CUDA build: batch
                                                      # 1 / 8 / 32 and 32k x 1, xla and cudnn
                                                      # prefill attention, < 10 min on an H200
                                                      # (= python -m benchmarks.gpu_suite)

Writes `benchmarks/results/<suite>[-quick].json` and a Markdown twin, and prints the tables.

This module is the command line. What runs: `benchmarks.suites`; its sizes: `benchmarks.plans`;
how it is timed: `benchmarks.harness`; scenario (a) and the grid: `benchmarks.scenario_a`;
scenario (b) and the GPU suite's model: `benchmarks.scenario_b`; the peers' worker:
`benchmarks.peers.peer_client`; agreement: `benchmarks.peers.agreement`; targets:
`benchmarks.targets`; the Markdown and JSON: `benchmarks.report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import shlex
import sys
import time
from collections.abc import Sequence

import jax.numpy as jnp

from benchmarks import machine
from benchmarks.harness import CompileLog, Memory, log
from benchmarks.plans import make_plan
from benchmarks.report import markdown, write_results
from benchmarks.suites import cpu_suite, gpu_suite
from benchmarks.targets import targets

ROOT = pathlib.Path(__file__).resolve().parent


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n", 1)[0]
    )
    p.add_argument("--suite", choices=("cpu", "gpu"), default="cpu")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes: every path, minutes")
    size.add_argument("--tiny", action="store_true", help="smallest sizes (tests; needs --model)")
    p.add_argument("--model", default=None, help="scenario (a)'s model: embedded name or folder")
    p.add_argument("--no-peers", action="store_true", help="skip transformers and kvpress")
    p.add_argument("--out", default=str(ROOT / "results"), help="results folder")
    p.add_argument("--peak-tflops", type=float, default=None, help="GPU peak (bf16 TFLOP/s)")
    p.add_argument("--peak-tbps", type=float, default=None, help="GPU peak bandwidth (TB/s)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    plan = make_plan(args.suite, size)
    if args.model:
        plan = dataclasses.replace(plan, model=args.model)
    command = "python -m benchmarks.run " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(f"$ {command}")
    start = time.perf_counter()
    load_start = os.getloadavg()
    compiles, memory = CompileLog.get(), Memory()
    dtype = jnp.bfloat16 if args.suite == "gpu" else jnp.float32
    log("[machine] measuring matmul peak and read bandwidth")
    limits = machine.measure(quick=size != "full", dtype=dtype)
    result: dict = {
        "suite": args.suite,
        "size": size,
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine.describe(),
        "limits": limits,
        "memory_kind": memory.kind,
        "plan": dataclasses.asdict(plan),
        "load_start": " ".join(f"{x:.2f}" for x in load_start),
    }
    if args.suite == "cpu":
        result |= cpu_suite(plan, limits, compiles, memory, use_peers=not args.no_peers)
    else:
        peaks = machine.peaks_for(
            result["machine"]["device_kind"], limits, args.peak_tflops, args.peak_tbps
        )
        result["peaks"] = peaks
        result |= gpu_suite(plan, limits, peaks, compiles, memory)
    result["targets"] = targets(plan, result, limits)
    result["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    result["wall_s"] = time.perf_counter() - start
    text = markdown(result)
    out = pathlib.Path(args.out)
    stem = args.suite + ("" if size == "full" else f"-{size}")
    write_results(result, text, out, stem)
    print()
    print(text)
    print(f"\nwrote {out / (stem + '.json')} and {out / (stem + '.md')}")
    return result


if __name__ == "__main__":
    main()
