"""Whether a change touched the CPU programs at all: the compiled XLA:CPU programs of the
default path, hashed without their source locations, at two commits.

    python -m benchmarks.cost.cpu_programs --out after.json                  # here
    (cd OLD_CHECKOUT && PYTHONPATH=. python -m benchmarks.cost.cpu_programs --out before.json)
    python -m benchmarks.cost.cpu_programs --compare before.json after.json

(An OLD_CHECKOUT from before benchmarks/ was split into cost/ and peers/ holds this module at
benchmarks/cpu_programs.py.)

On the embedded SmolLM2-135M-Instruct, one device, batch 1: `decoding.prefill_prompt` (a
1,024-token prompt in 512-token chunks, capacity 1,088) and `decoding.decode_loop` (FullKV,
greedy, 16 new tokens) after it. Each program's text (`compiled.as_text()`) is hashed with its
metadata (op names, source files and lines) removed, which moves with every edit of the
source; what is left is the program XLA runs: its instructions, layouts, fusions and
schedule. The same hashes at two commits mean the same CPU programs, so the same speed
(a stronger check than timing them on a noisy machine, for changes meant to leave CPU
alone); different hashes say nothing about speed: time them (`benchmarks.shape_speed`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re

import jax
import jax.numpy as jnp

PROMPT, CAPACITY, CHUNK, NEW_TOKENS = 1024, 1088, 512, 16
# What moves with the source and not with the program: each instruction's metadata, and
# the tables of source files, functions, lines and frames it points into.
_METADATA = (r", metadata=\{[^}]*\}", r"(?:, )?stack_frame_id=\d+")
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def program_text(compiled) -> str:
    """The compiled program's text without source locations: the metadata of every
    instruction removed, and the tables it points into (source files, functions, lines,
    frames: each a header line and its entries up to a blank line) dropped."""
    text = compiled.as_text()
    for pattern in _METADATA:
        text = re.sub(pattern, "", text)
    kept, in_table = [], False
    for line in text.splitlines():
        if line.strip() in _TABLES:
            in_table = True
        elif in_table and not line.strip():
            in_table = False
        elif not in_table:
            kept.append(line)
    return "\n".join(kept)


def digest(compiled) -> str:
    return hashlib.sha256(program_text(compiled).encode()).hexdigest()[:16]


def programs() -> dict[str, str]:
    """{step: hash} for the default path's prefill and decode programs on one CPU device."""
    import dge_jax
    from dge_jax.runtime import decoding
    from dge_jax.text.sampling import Greedy

    model = dge_jax.load("smollm2-135m-instruct")
    statics = (model.family.forward, model.config, model.params)
    tokens = jnp.ones((1, PROMPT), jnp.int32)
    lengths = jnp.full((1,), PROMPT, jnp.int32)
    spec = decoding.PrefillSpec(capacity=CAPACITY, chunk=CHUNK)
    prefill = decoding.prefill_prompt.lower(*statics, tokens, lengths, spec).compile()
    out = prefill(*statics[2:], tokens, lengths)
    eos = (0,)  # a static argument: any id compiles the same program
    first = jnp.argmax(out.logits, -1).astype(jnp.int32)
    state = decoding.start_state(out.cache, first, lengths, NEW_TOKENS, eos, jax.random.PRNGKey(0))
    steps = decoding.StepSpec(sampler=Greedy(), eos_ids=eos)
    decode = decoding.decode_loop.lower(*statics, state, steps).compile()
    return {"prefill_prompt": digest(prefill), "decode_loop": digest(decode)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cost.cpu_programs",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--out", help="write the hashes to this JSON file")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = p.parse_args(argv)
    if args.compare:
        before, after = (json.load(open(f)) for f in args.compare)
        for step in sorted(set(before) | set(after)):
            a, b = before.get(step), after.get(step)
            print(f"{step}: {a} -> {b}: {'same program' if a == b else 'DIFFERENT'}")
        return
    found = programs()
    print(json.dumps(found))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(found, f)


if __name__ == "__main__":
    main()
