"""Command line: `python -m dge_jax generate --model PATH --prompt TEXT [--chat] [--json]`.

`--dtype bfloat16 --mesh data=1,model=8` loads the model sharded over a (data, model) mesh of
this process's devices (the syntax of `convert --mesh` and the runner's `--mesh`), e.g. an 8B
checkpoint over the 8 chips of one TPU VM: the same tokens and kept positions as without it.

`python -m dge_jax convert --model PATH_OR_NAME --out DIR` writes an orbax folder (params +
config + tokenizer) that `dge_jax.load(DIR, mesh=...)` restores sharded.

Eviction flags: `--rule snapkv --budget 128 --timing dge --k 2 [--head_budget adakv --alpha 0.2]
[--ties earlier] [--decode_budget 128 --interval 32]` (the last two also compress while
decoding; `--json` then lists what each compression kept, `kept_over_time`); they are refused
with the default `--rule full` (no eviction), where they would do nothing, as
`--top_k/--top_p` are with the default `--temperature 0` (greedy). Rule options
(`--window --kernel --pooling --gqa --gqa_before_pool`, and any field as
`--rule_option NAME=VALUE`) are refused, naming them, by a rule that does not take them;
a field set twice (a flag and a --rule_option, two --rule_option, one flag twice) is refused.

Errors: one line on stderr, `error: <what is wrong>; <the fix>`, exit status 2 for a usage
error and 1 for a fault of the environment (a model cache that cannot be written, unreadable
files); `--verbose` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from dge_jax.eviction.decode_spec import DecodeCompression
from dge_jax.eviction.evict import HEAD_BUDGETS, Eviction
from dge_jax.eviction.timing import KINDS, Lookahead, Timing
from dge_jax.model import DEFAULT_MODEL
from dge_jax.rules.registry import RULES, make_rule, resolve
from dge_jax.runtime import platform
from dge_jax.runtime.quantized import check_kv_quant
from dge_jax.runtime.selection import TIES
from dge_jax.text.sampling import Greedy, Sampling

# Eviction flags default to None so that a flag the user gave is told from one left out.
EVICTION_DEFAULTS = {
    "budget": 256, "timing": "dge", "k": 2, "head_budget": "uniform", "ties": "later",
    "alpha": 0.2,
}  # fmt: skip
RULE_OPTIONS = ("window", "kernel", "pooling", "gqa", "gqa_before_pool")
DECODE_FLAGS = ("decode_budget", "interval")
LOOKAHEAD_FLAGS = ("lookahead_budget", "lookahead_window")


class _StoreOnce(argparse.Action):
    """argparse's "store", but an option given twice is an error naming both values (argparse
    would keep the last one silently)."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = namespace.__dict__.setdefault("_given", {})
        if self.dest in seen:
            first_flag, first = seen[self.dest]
            parser.error(
                f"{first_flag} {first} and {option_string} {values} both set {self.dest}; "
                "give it once"
            )
        seen[self.dest] = (option_string, values)
        setattr(namespace, self.dest, values)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, `error: <what>; <the fix>` (exit
    status 2), and whose options may each be given once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def error(self, message: str):
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def rule_name(text: str) -> str:
    """--rule's check: a registered rule or a wrapper around one (argparse reports it)."""
    try:
        resolve(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} ({err})") from None
    return text


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = Parser(prog="python -m dge_jax", description=__doc__)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--verbose", action="store_true",
        help="on an error, show its traceback instead of the one-line message",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub.add_parser("generate", help="generate text for one prompt", parents=[common]))
    _add_convert(
        sub.add_parser(
            "convert",
            help="convert a checkpoint to an orbax folder that `load` restores sharded",
            parents=[common],
        )
    )
    return parser


def _add_generate(g: argparse.ArgumentParser) -> None:
    """The `generate` subcommand's flags: the prompt and sampling, then the eviction group."""
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"checkpoint folder or embedded model name (default {DEFAULT_MODEL})",
    )
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max_new_tokens", type=int, default=64)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument(
        "--mesh", default=None,
        help="load the model sharded over a mesh of this process's devices, e.g. "
        "data=1,model=8 (the syntax of convert --mesh and the runner's --mesh)",
    )  # fmt: skip
    g.add_argument("--temperature", type=float, default=0.0, help=">= 0; 0 = greedy")
    g.add_argument("--top_k", type=int, default=None, help="sampling: >= 0, 0 = no cut")
    g.add_argument("--top_p", type=float, default=None, help="sampling: in (0, 1], 1 = no cut")
    g.add_argument("--seed", type=int, default=0)
    _add_kernels(g)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    _add_eviction(g.add_argument_group("eviction"))


def _add_kernels(g: argparse.ArgumentParser) -> None:
    """How generate runs its attention and stores its cache."""
    g.add_argument(
        "--attention", default="auto", choices=platform.ATTENTION,
        help="attention kernels: auto (the platform's: pallas on TPU, xla elsewhere), xla, "
        "pallas (the Pallas flash kernel for prefill and KVzip's passes, a decode kernel for "
        "draft and decode steps; interpret mode off TPU, slow) or cudnn (GPU only: cuDNN's "
        "flash attention for prefill and KVzip's passes; draft and decode steps on xla)",
    )  # fmt: skip
    g.add_argument(
        "--kv_quant", default="none", type=check_kv_quant,
        help="how the cache stores keys and values: none (the model's dtype), int8 (one "
        "scale per token per kv head) or int4 (KIVI's 4 bits: keys per channel, values per "
        "token, in groups of 32, the last 128 slots full precision; int4-g<G>-r<R> sets "
        "both); attention and every rule read them dequantized",
    )  # fmt: skip


def _add_eviction(ev) -> None:
    """The `generate` subcommand's eviction group."""
    ev.add_argument(
        "--rule",
        default="full",
        type=rule_name,
        help=f"scoring rule (full = no eviction): {', '.join(sorted(RULES))}; a wrapper "
        "around another rule as <wrapper>_<rule>, e.g. criticalkv_expectedattention",
    )
    ev.add_argument("--budget", type=int, default=None, help="entries kept per kv head (256)")
    ev.add_argument("--timing", default=None, choices=KINDS, help="when to evict (dge)")
    ev.add_argument(
        "--k",
        type=int,
        default=None,
        help="answer tokens generated with the full cache before eviction (2; prefill: 1)",
    )
    ev.add_argument("--head_budget", default=None, choices=HEAD_BUDGETS, help="(uniform)")
    ev.add_argument(
        "--alpha", type=float, default=None,
        help="adakv / global: each head's floor, a fraction of the budget (0.2; KVzip's: 0)",
    )  # fmt: skip
    ev.add_argument("--window", type=int, default=None, help="observation / recent window")
    ev.add_argument("--kernel", type=int, default=None, help="SnapKV/PyramidKV pooling kernel")
    ev.add_argument("--pooling", default=None, choices=["max", "avg"])
    ev.add_argument("--gqa", default=None, choices=["mean", "max"])
    ev.add_argument(
        "--gqa_before_pool",
        action="store_true",
        default=None,  # None = not given, so --rule full / h2o ... can refuse it
        help="SnapKV/PyramidKV: aggregate the GQA group's attention, then pool",
    )
    ev.add_argument(
        "--ties", default=None, choices=TIES, help="equal scores keep the later / earlier (later)"
    )
    ev.add_argument(
        "--decode_budget", type=int, default=None,
        help="also compress while decoding: every --interval new tokens, back to this many "
        "entries per kv head (with --timing decode: only while decoding)",
    )  # fmt: skip
    ev.add_argument(
        "--interval", type=int, default=None, help="decode steps between compressions (32)"
    )
    _add_lookahead(ev)
    ev.add_argument(
        "--rule_option",
        action="append",
        default=None,
        metavar="NAME=VALUE",
        help="any other field of the rule (repeatable), e.g. lag_size=64, chunk_length=10",
    )


def _add_lookahead(ev) -> None:
    """--timing lookahead's first stage (LAQ's defaults where not given)."""
    ev.add_argument(
        "--lookahead_budget", type=int, default=None,
        help="--timing lookahead (LAQ): entries per kv head of the compressed copy its --k "
        "lookahead tokens come from (512)",
    )  # fmt: skip
    ev.add_argument(
        "--lookahead_window", type=int, default=None,
        help="--timing lookahead: the query window that copy is compressed with (32)",
    )  # fmt: skip


def _add_convert(c: argparse.ArgumentParser) -> None:
    """The `convert` subcommand's flags."""
    c.add_argument("--model", required=True, help="checkpoint folder or embedded model name")
    c.add_argument("--out", required=True, help="new folder to write")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--mesh", default=None, help="read sharded on a mesh, e.g. data=1,model=8")


def run_convert(args: argparse.Namespace) -> dict:
    """Converts `--model` into an orbax folder at `--out`; returns the JSON-able summary."""
    from dge_jax.checkpoints import orbax_io

    out = orbax_io.convert(args.model, args.out, dtype=args.dtype, mesh=mesh_from_args(args))
    return {"out": str(out)}


def eviction_from_args(args: argparse.Namespace) -> Eviction | None:
    """The `Eviction` the flags describe (None for --rule full); flags that would be ignored
    and values out of range raise, naming the flag."""
    if args.rule == "full":
        names = (*EVICTION_DEFAULTS, *RULE_OPTIONS, *DECODE_FLAGS, *LOOKAHEAD_FLAGS,
                 "rule_option")  # fmt: skip
        given = [f"--{name}" for name in names if getattr(args, name) is not None]
        if given:
            evicting = ", ".join(sorted(set(RULES) - {"full"}))
            raise ValueError(
                f"{', '.join(given)} only apply with an evicting --rule ({evicting}); "
                "--rule full (the default) keeps the whole cache"
            )
        return None
    decode = decode_compression_from_args(args)
    if args.timing == "decode" and args.budget is None and decode is not None:
        args = argparse.Namespace(**{**vars(args), "budget": decode.budget})
    budget, timing, k, head_budget, ties, alpha = (
        default if getattr(args, name) is None else getattr(args, name)
        for name, default in EVICTION_DEFAULTS.items()
    )
    if budget < 1:
        raise ValueError(f"--budget must be >= 1 (entries kept per kv head), got {budget}")
    if k < 1:
        raise ValueError(f"--k must be >= 1 (answer tokens before eviction), got {k}")
    if args.alpha is not None and head_budget == "uniform":
        raise ValueError("--alpha applies to --head_budget adakv / global, not uniform budgets")
    if timing in ("prefill", "decode"):
        if k != 1 and args.k is not None:
            when = "evicts at k=1" if timing == "prefill" else "evicts while decoding"
            raise ValueError(f"--k applies to --timing dge/dge_w/dge_d/lookahead; {timing} {when}")
        k = 1
    options = {
        name: getattr(args, name) for name in RULE_OPTIONS if getattr(args, name) is not None
    }
    extra = parse_rule_options(args.rule_option or ())
    for name in sorted(extra.keys() & options.keys()):
        flag = f"--{name}" + ("" if options[name] is True else f" {options[name]}")
        raise ValueError(
            f"{flag} and --rule_option {name}={extra[name][1]} both set the field {name}; "
            "give it once"
        )
    options |= {name: value for name, (value, _) in extra.items()}
    return Eviction(
        rule=make_rule(args.rule, **options),
        budget=budget,
        timing=Timing(timing, k, lookahead=lookahead_from_args(args, timing)),
        head_budget=head_budget,
        alpha=alpha,
        ties=ties,
        decode=decode,
    )


def lookahead_from_args(args: argparse.Namespace, timing: str) -> Lookahead | None:
    """--lookahead_budget / --lookahead_window as timing lookahead's first stage (LAQ's
    defaults where not given; None for the other timings, which refuse the flags)."""
    given = {name: getattr(args, name) for name in LOOKAHEAD_FLAGS if getattr(args, name)
             is not None}  # fmt: skip
    if timing != "lookahead":
        if given:
            raise ValueError(f"{', '.join('--' + n for n in given)} apply to --timing lookahead")
        return None
    return Lookahead(**{name.removeprefix("lookahead_"): v for name, v in given.items()})


def decode_compression_from_args(args: argparse.Namespace) -> DecodeCompression | None:
    """--decode_budget / --interval as a `DecodeCompression` (None without them)."""
    if args.decode_budget is None:
        if args.interval is not None:
            raise ValueError("--interval applies with --decode_budget (compression while decoding)")
        if args.timing == "decode":
            raise ValueError("--timing decode evicts only while decoding: give --decode_budget")
        return None
    if args.decode_budget < 1:
        raise ValueError(
            f"--decode_budget must be >= 1 (entries per kv head), got {args.decode_budget}"
        )
    interval = 32 if args.interval is None else args.interval
    if interval < 1:
        raise ValueError(f"--interval must be >= 1 (decode steps), got {interval}")
    return DecodeCompression(budget=args.decode_budget, interval=interval)


def parse_rule_options(items: Sequence[str]) -> dict[str, tuple[object, str]]:
    """``NAME=VALUE`` strings to rule options, name -> (value, the text given): integers,
    then floats, then true/false, else the text (an inner rule's name). A name given twice,
    or one that has its own flag outside the rule (--budget ...), is refused."""
    options: dict[str, tuple[object, str]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--rule_option takes NAME=VALUE, got {item!r}")
        if name in options:
            raise ValueError(
                f"--rule_option {name}={options[name][1]} and --rule_option {item} both set "
                f"the field {name}; give it once"
            )
        if name in (*EVICTION_DEFAULTS, *DECODE_FLAGS, *LOOKAHEAD_FLAGS):
            raise ValueError(
                f"--rule_option {item} sets {name}, which is not a field of the rule; "
                f"use --{name} {text}"
            )
        value: object = text
        for cast in (int, float):
            try:
                value = cast(text)
                break
            except ValueError:
                continue
        else:
            value = {"true": True, "false": False}.get(text.lower(), text)
        options[name] = (value, text)
    return options


def sampler_from_args(args: argparse.Namespace) -> Greedy | Sampling:
    """Greedy for --temperature 0, else `Sampling`; bad values raise, naming the flag."""
    if not args.temperature >= 0:  # NaN too
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 0:
        raise ValueError(f"--top_k must be >= 0 (0 = no top-k cut), got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top_p must be in (0, 1] (1 = no nucleus cut), got {args.top_p}")
    if args.temperature == 0:
        given = [f"--{n}" for n in ("top_k", "top_p") if getattr(args, n) is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} only apply when sampling (--temperature > 0); "
                "--temperature 0 (the default) is greedy"
            )
        return Greedy()
    top_p = 1.0 if args.top_p is None else args.top_p
    return Sampling(temperature=args.temperature, top_k=args.top_k or 0, top_p=top_p)


def check_prompt_text(text: str) -> None:
    """--prompt must be valid text: bytes that are not UTF-8 reach Python as lone surrogates
    (errors="surrogateescape"), which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise ValueError(
            f"--prompt is not valid UTF-8 ({byte} at character {e.start}); pass UTF-8 text, "
            "e.g. convert it with iconv -t UTF-8"
        ) from None


def mesh_from_args(args: argparse.Namespace):
    """--mesh as a (data, model) mesh of this process's devices (None without it); a spec
    that does not parse or does not fit the devices raises, naming the flag."""
    if args.mesh is None:
        return None
    from dge_jax.distribution.sharding import parse_mesh

    try:
        return parse_mesh(args.mesh)
    except ValueError as e:
        raise ValueError(f"--mesh {args.mesh}: {e}") from None


def run_generate(args: argparse.Namespace) -> dict:
    """Checks the flags, loads the model, generates, and returns the JSON-able result."""
    import dge_jax

    check_prompt_text(args.prompt)
    sampler, eviction = sampler_from_args(args), eviction_from_args(args)  # before loading
    platform.current(args.attention)  # cudnn off a GPU is refused before loading too
    mesh = mesh_from_args(args)  # a bad --mesh is refused before loading too
    model = dge_jax.load(args.model, dtype=args.dtype, mesh=mesh)
    result = dge_jax.generate(
        model,
        [args.prompt],
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        sampler=sampler,
        seed=args.seed,
        eviction=eviction,
        attention=args.attention,
        kv_quant=args.kv_quant,
        record_compressions=args.json and eviction is not None and eviction.decode is not None,
    )
    out = {"prompt_tokens": result.prompt_tokens, "tokens": result.tokens, "text": result.texts}
    if result.kept is not None:
        out["kept"] = result.kept[0]  # first row: [layer][kv head] -> kept positions
    if result.compressions is not None:  # first row: [{"step", "kept": [layer][kv head]}]
        out["kept_over_time"] = result.compressions[0]
    return out


# Exit statuses: 2 for a usage error (the flags, the prompt, the model named), 1 for a fault of
# the environment (files that cannot be read or written, a missing package, out of memory).
USAGE, ENVIRONMENT = 2, 1


def one_line(error: BaseException) -> str:
    """The error's message on one line (templates and tokenizers write several)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines) or type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Every user mistake or environment fault ends in one stderr line,
    `error: <what is wrong>; <the fix>`, and exit status 2 (usage) or 1 (environment);
    --verbose re-raises instead, to keep the traceback. --help exits 0 (argparse)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "convert":
            print(json.dumps(run_convert(args)))
            return 0
        out = run_generate(args)
    except KeyboardInterrupt:
        if args.verbose:
            raise
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.verbose:
            raise
        if isinstance(e, ValueError | TypeError):
            status, message = USAGE, one_line(e)
        elif isinstance(e, OSError | MemoryError):
            status, message = ENVIRONMENT, one_line(e)
        else:  # a bug: say so, and how to see where
            status = ENVIRONMENT
            message = (
                f"unexpected {type(e).__name__}: {one_line(e)}; rerun with --verbose for the "
                "traceback and report it"
            )
        print(f"error: {message}", file=sys.stderr)
        return status
    if args.json:
        print(json.dumps(out, ensure_ascii=False))
    else:
        print(out["text"][0])
    return 0
