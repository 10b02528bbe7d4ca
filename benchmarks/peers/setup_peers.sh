#!/usr/bin/env bash
# Creates the peers' virtual environment, benchmarks/.peers/venv (gitignored), in one command:
#
#     bash benchmarks/peers/setup_peers.sh
#
# kvpress 0.5.5 pins transformers < 5.3, while dge_jax's own environment (and its parity tests)
# run on current transformers, so the peers (transformers' generate and kvpress's SnapKVPress)
# live in a clean venv of their own; `python -m benchmarks.run` runs benchmarks/peers/peers.py
# with this venv's python as a subprocess and exchanges JSON with it.
#
# torch is pinned to 2.13.0, the version of the main environment. On a machine without a local
# CPU wheel, export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu first to avoid
# pulling the (much larger) CUDA build. PYTHON picks the interpreter (default: python3).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # benchmarks/
venv="$root/.peers/venv"
python="${PYTHON:-python3}"

"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet \
    "torch==2.13.0" \
    "transformers>=4.56,<5.3" \
    "kvpress==0.5.5" \
    "optimum-quanto==0.2.7" \
    gguf accelerate safetensors numpy psutil
"$venv/bin/python" - <<'PY'
import kvpress, optimum.quanto, torch, transformers
print(f"peers venv ready: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"kvpress {getattr(kvpress, '__version__', '0.5.5')}, "
      f"optimum-quanto {getattr(optimum.quanto, '__version__', '0.2.7')}")
PY
