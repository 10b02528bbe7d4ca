"""One model sharded across processes, for `tests/test_multihost.py`: run as one process or as
several (`python -m experiments.launch --processes 2 --cpu_devices 4 -- python
tests/multihost_checks.py CKPT OUT`), always over 8 CPU devices in all.

Loads mesh_checks' random llama (8 query / 4 kv heads) on an 8-device mesh (data=2, model=4:
the model axis inside a process, the data axis across the two) and, separately, on
data=1, model=8 (every weight split across both processes), counting the bytes each process
reads from the safetensors files; then generates FullKV and a DGE(2)-SnapKV cell. Each
process writes OUT.p<index>.json: its tokens, kept positions and bytes read.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import numpy as np


def count_reads(hf) -> dict:
    """Wraps the loader's `safe_open` so every slice read adds its bytes to the result."""
    read = {"bytes": 0}
    opened = hf.safe_open

    class Slice:
        def __init__(self, inner):
            self.inner = inner

        def __getitem__(self, index):
            block = self.inner[index]
            read["bytes"] += int(np.asarray(block).nbytes)
            return block

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class Handle:
        def __init__(self, *args, **kwargs):
            self.inner = opened(*args, **kwargs)

        def __enter__(self):
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_slice(self, name):
            return Slice(self.file.get_slice(name))

        def __getattr__(self, name):  # keys(), metadata(): the file's own
            return getattr(self.file, name)

    hf.safe_open = Handle
    return read


def main(ckpt: str, out: str) -> None:
    import jax

    from dge_jax.distribution import multihost

    connected = bool(os.environ.get(multihost.COORDINATOR))
    processes = multihost.initialize() if connected else multihost.current()
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import mesh_checks as mc

    import dge_jax
    from dge_jax.checkpoints import hf
    from dge_jax.distribution import sharding as sh
    from dge_jax.generation import generate_grid

    assert len(jax.devices()) == 8, jax.devices()
    read = count_reads(hf)
    facts: dict = {"process": processes.index, "processes": processes.count}
    for data, model_axis in ((2, 4), (1, 8)):
        read["bytes"] = 0
        model = dge_jax.load(ckpt, mesh=sh.make_mesh(data, model_axis))
        name = f"{data}x{model_axis}"
        facts[f"read_{name}"] = read["bytes"]
        results = generate_grid(model, mc.prompts(), list(mc.CELLS[:2]),
                                max_new_tokens=mc.MAX_NEW)
        facts[f"tokens_{name}"] = [r.tokens for r in results]
        facts[f"kept_{name}"] = results[1].kept
    stored = sum(f.stat().st_size for f in pathlib.Path(ckpt).glob("*.safetensors"))
    facts["checkpoint_bytes"] = stored
    pathlib.Path(f"{out}.p{processes.index}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
