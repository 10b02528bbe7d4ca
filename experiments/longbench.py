"""Evaluate FullKV, eviction baselines and their DGE / DGE-W versions on long-context tasks.

    python -m experiments.longbench                       # embedded SmolLM2, synthetic suite
    python -m experiments.longbench --suite longbench --data_dir DIR \\
        --rules full,snapkv,pyramidkv,h2o,streamingllm,adakv_snapkv \\
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
max-pool), not the SnapKV paper's window 32 (RESULTS.md compares the two on the embedded
model). Change them with --window/--kernel/--pooling.

The runner is `experiments.runner` (this module only calls its `main`, so that the documented
command keeps working); the suites are `experiments.suites`.
"""

from absl import flags

from experiments import run_config
from experiments.runner import main

# --help lists the main module's key flags: the runner's are defined in run_config.
flags.adopt_module_key_flags(run_config)

if __name__ == "__main__":
    main()
