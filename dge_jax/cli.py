"""Command line: `python -m dge_jax generate --model PATH --prompt TEXT [--chat] [--json]`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from dge_jax.model import DEFAULT_MODEL


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
    return parser


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
    )
    return {"prompt_tokens": result.prompt_tokens, "tokens": result.tokens, "text": result.texts}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; bad input exits with status 2 and a one-line message, not a traceback."""
    args = build_parser().parse_args(argv)
    try:
        out = run_generate(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, ensure_ascii=False))
    else:
        print(out["text"][0])
    return 0
