"""Command line: `python -m dge_jax generate --model PATH --prompt TEXT [--chat] [--json]`.

`python -m dge_jax convert --model PATH_OR_NAME --out DIR` writes an orbax folder (params +
config + tokenizer) that `dge_jax.load(DIR, mesh=...)` restores sharded.

Eviction flags: `--policy snapkv --budget 128 --timing dge --k 2 [--head_budget adakv]`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from dge_jax.eviction import HEAD_BUDGETS, Eviction
from dge_jax.model import DEFAULT_MODEL
from dge_jax.policies import POLICIES, make_policy
from dge_jax.timing import KINDS, Timing


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="python -m dge_jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"checkpoint folder or embedded model name (default {DEFAULT_MODEL})",
    )
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max_new_tokens", type=int, default=64)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top_k", type=int, default=0)
    g.add_argument("--top_p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    ev = g.add_argument_group("eviction")
    ev.add_argument(
        "--policy",
        default="full",
        choices=sorted(POLICIES),
        help="scoring rule (full = no eviction)",
    )
    ev.add_argument("--budget", type=int, default=256, help="entries kept per kv head")
    ev.add_argument("--timing", default="dge", choices=KINDS)
    ev.add_argument(
        "--k",
        type=int,
        default=2,
        help="answer tokens generated with the full cache before eviction",
    )
    ev.add_argument("--head_budget", default="uniform", choices=HEAD_BUDGETS)
    ev.add_argument("--window", type=int, default=None, help="observation / recent window")
    ev.add_argument("--kernel", type=int, default=None, help="SnapKV/PyramidKV pooling kernel")
    ev.add_argument("--pooling", default=None, choices=["max", "avg"])
    ev.add_argument("--gqa", default=None, choices=["mean", "max"])
    c = sub.add_parser(
        "convert", help="convert a checkpoint to an orbax folder that `load` restores sharded"
    )
    c.add_argument("--model", required=True, help="checkpoint folder or embedded model name")
    c.add_argument("--out", required=True, help="new folder to write")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--mesh", default=None, help="read sharded on a mesh, e.g. data=1,model=8")
    return parser


def run_convert(args: argparse.Namespace) -> dict:
    """Converts `--model` into an orbax folder at `--out`; returns the JSON-able summary."""
    from dge_jax import orbax_io
    from dge_jax.sharding import parse_mesh

    mesh = parse_mesh(args.mesh) if args.mesh else None
    out = orbax_io.convert(args.model, args.out, dtype=args.dtype, mesh=mesh)
    return {"out": str(out)}


def eviction_from_args(args: argparse.Namespace) -> Eviction | None:
    """The `Eviction` the flags describe (None for --policy full); unknown combos raise."""
    if args.policy == "full":
        return None
    options = {
        name: getattr(args, name)
        for name in ("window", "kernel", "pooling", "gqa")
        if getattr(args, name) is not None
    }
    policy = make_policy(args.policy, **options)
    k = args.k if args.timing != "prefill" else 1
    return Eviction(
        policy=policy,
        budget=args.budget,
        timing=Timing(args.timing, k),
        head_budget=args.head_budget,
    )


def run_generate(args: argparse.Namespace) -> dict:
    """Loads the model, generates, and returns the JSON-able result."""
    import dge_jax
    from dge_jax.sampling import Greedy, Sampling

    sampler = (
        Greedy()
        if args.temperature == 0
        else Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    )
    model = dge_jax.load(args.model, dtype=args.dtype)
    result = dge_jax.generate(
        model,
        [args.prompt],
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        sampler=sampler,
        seed=args.seed,
        eviction=eviction_from_args(args),
    )
    out = {"prompt_tokens": result.prompt_tokens, "tokens": result.tokens, "text": result.texts}
    if result.kept is not None:
        out["kept"] = result.kept[0]  # first row: [layer][kv head] -> kept positions
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; bad input exits with status 2 and a one-line message, not a traceback."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "convert":
            print(json.dumps(run_convert(args)))
            return 0
        if args.timing == "prefill" and args.k != 2:
            raise ValueError("--k applies to --timing dge/dge_w; prefill evicts at k=1")
        out = run_generate(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, ensure_ascii=False))
    else:
        print(out["text"][0])
    return 0
