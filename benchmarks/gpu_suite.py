"""The GPU check, one command on one NVIDIA GPU with JAX's CUDA build:

    python -m benchmarks.gpu_suite            # the full plan: one H200, ~6-9 min (estimated)
    python -m benchmarks.gpu_suite --quick    # the same shape at small sizes, minutes

What it runs: `benchmarks.run --suite gpu` (`benchmarks.suites.gpu_suite`, sizes in
`benchmarks.plans.make_plan("gpu", ...)`): a random-weight model with Llama-3.1-8B's
geometry (hidden 4096, MLP 14336, 32 layers, 32 / 8 heads x 128; a 1024-token vocabulary)
in bf16 (--quick: the small trunk of scenario (b) with that attention), every step compiled
ahead of time; prefill tok/s and model-FLOP utilisation, then decode tok/s and
HBM-bandwidth utilisation from the full cache and from the SnapKV dge(2) compacted one, at
batch 1, 8 and 32 (8192, 8192 and 4096 tokens) and at 32768 tokens x 1, each under the
`xla` and the `cudnn` prefill attention (decode steps run the XLA path). Utilisation is
against the GPU's vendor peaks (`benchmarks.machine.GPU_PEAKS`; --peak-tflops / --peak-tbps
override them), besides the matmul and bandwidth limits it measures first. On a machine
without a GPU it runs the same code with `xla` attention only (cuDNN runs on GPUs only):
the tests' --tiny path.

What it writes: `benchmarks/results/gpu.json` and `gpu.md` (`gpu-quick.*` with --quick;
--out another folder), and prints the Markdown tables.

Nothing is downloaded: the weights are random (seeded) and the prompts random token ids; no
tokenizer, checkpoint or peer (transformers / kvpress) is used. It is never a test
dependency: tests/test_benchmarks_smoke.py runs its code path on CPU at --tiny sizes.
Every other flag is `benchmarks.run`'s.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from benchmarks import run


def main(argv: Sequence[str] | None = None) -> dict:
    """`benchmarks.run.main(["--suite", "gpu", *argv])`; argv: the command line's when None."""
    return run.main(["--suite", "gpu", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
