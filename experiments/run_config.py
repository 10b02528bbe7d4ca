"""The runner's command line as one value: absl flags are defined here, read once into a
frozen `RunConfig` (`RunConfig.from_flags`), and every runner helper takes that value; none
reads the global `FLAGS`.
"""

from __future__ import annotations

import dataclasses
import re

from absl import flags

from dge_jax.cli import RULE_OPTIONS
from dge_jax.eviction.timing import Adaptive, Lookahead
from dge_jax.rules.registry import RULES
from dge_jax.runtime.platform import ATTENTION
from dge_jax.runtime.quantized import check_kv_quant
from experiments import suites
from experiments.cells import Cell, build_cells
from experiments.suites import longbench, ruler, synthetic
from experiments.suites.base import RowSettings, Suite

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "checkpoint folder or embedded name")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "parameter dtype")
flags.DEFINE_enum("suite", suites.DEFAULT, list(suites.SUITES), "task suite")
flags.DEFINE_string("data_dir", None, "folder of LongBench {dataset}.jsonl files "
                    f"(default: ${longbench.DATA_DIR_ENV}); for --suite ruler, of RULER "
                    "{task}_{length}.jsonl files to read instead of generating the rows "
                    f"(default: ${ruler.DATA_DIR_ENV}'s file where it holds one, else generated); "
                    "for --suite kvpress, of *.parquet / *.jsonl files in kvpress's schema; for "
                    "--suite loogle, of LooGLE {task}.jsonl files")
flags.DEFINE_list("datasets", None, "datasets/tasks to run (default: synthetic "
                  f"{','.join(synthetic.MAIN_JOB_TASKS)}; longbench: those present in "
                  "--data_dir; ruler: all eleven, or those present in --data_dir; kvpress: "
                  "every task in --data_dir; loogle: those present in --data_dir)")
flags.DEFINE_string("metric", None, "--suite kvpress: score every task with this metric "
                    "instead of the one its task name picks (an unknown name is refused with "
                    "the list)")
DEFAULT_RULES = ["full", "snapkv"]
flags.DEFINE_list("rules", DEFAULT_RULES, f"scoring rules: {', '.join(RULES)}, "
                  "<wrapper>_<rule> (criticalkv_expectedattention), adakv_<rule> (AdaKV head "
                  "budgets) and global_<rule> (one pool across layers and heads)")
flags.DEFINE_list("timings", ["prefill", "dge", "dge_w"], "prefill, dge, dge_w, dge_d; decode "
                  "(compress only while decoding, at each --decode_budgets)")
flags.DEFINE_list("k", ["2"], "answer tokens generated with the full cache before DGE "
                  "eviction: the first from prefill, the other k-1 from k-1 draft steps")
flags.DEFINE_list("budgets", ["128", "256"], "entries kept per kv head")
flags.DEFINE_list("decode_budgets", [], "also compress while decoding: each cell gets variants "
                  "that every --intervals new tokens go back to these entries per kv head "
                  "(cells .../d<budget>/i<interval>)")
flags.DEFINE_list("intervals", ["32"], "decode steps between compressions (with "
                  "--decode_budgets)")
flags.DEFINE_integer("num_samples", None, "samples per dataset (default: synthetic and ruler "
                     f"{synthetic.SUITE.num_samples}, longbench all)")
flags.DEFINE_integer("max_length", None, "prompt tokens kept by middle truncation (default: "
                     "the model's context minus the longest generation, chat template and "
                     "answer prefix)")
flags.DEFINE_integer("synthetic_length", 512, "synthetic prompt length in model tokens "
                     "(before the chat template)")
flags.DEFINE_integer("ruler_length", 4096, "RULER's max_seq_length in model tokens: the prompt "
                     "(chat template and answer prefix included) plus the task's generation "
                     "budget; also the {length} of RULER row files")
flags.DEFINE_bool("answer_prefix", True, "synthetic and RULER suites: end each prompt with the "
                  "task's answer prefix (e.g. 'The pass key is'); --noanswer_prefix lets the "
                  "model start its answer unprompted")
flags.DEFINE_integer("batch_size", 4, "samples per batch (left-padded)")
flags.DEFINE_string("out_dir", None, "output folder (default runs/<suite>/<model>-<run id>: "
                    "one folder per configuration)")
flags.DEFINE_bool("extend", False, "add cells, datasets or samples to an --out_dir that holds "
                  "the same configuration (without it, asking for more than it holds is "
                  "refused)")
flags.DEFINE_bool("verbose", False, "show third-party INFO logging and tracebacks of errors")
flags.DEFINE_integer("seed", 0, "synthetic and RULER suite seed (decoding is greedy)")
flags.DEFINE_integer("window", 8, "observation window (SnapKV/PyramidKV) or recent window "
                     "(H2O)")
flags.DEFINE_integer("kernel", 7, "SnapKV/PyramidKV pooling kernel")
flags.DEFINE_enum("pooling", "max", ["max", "avg"], "SnapKV/PyramidKV pooling")
flags.DEFINE_enum("gqa", "mean", ["mean", "max"], "GQA aggregation of scores")
flags.DEFINE_bool("gqa_before_pool", False, "SnapKV/PyramidKV: aggregate the kv group's "
                  "attention before pooling (default: pool each query head first, kvpress's "
                  "order)")
flags.DEFINE_enum("ties", "later", ["later", "earlier"], "which of equal scores is kept: the "
                  "later slot (default) or the earlier position")
flags.DEFINE_enum("sliding", "window", ["window", "evict"], "models with sliding-window "
                  "layers (Gemma 2/3, Mistral v0.1, Phi-3): a sliding layer keeps what its "
                  "window still shows (window, default) or is held to the budget too (evict); "
                  "recorded in the run identity when evict")
flags.DEFINE_enum("sliding_cache", "auto", ["auto", "bounded", "full"], "how prefill's cache "
                  "holds sliding-window layers: their window plus one prefill step (bounded), "
                  "the prompt's length (full), or bounded unless a cell needs full (auto, "
                  "default: KVzip, --sliding evict, decode-time compression); recorded in the "
                  "run identity unless auto")
flags.DEFINE_enum("protocol", "query_aware", ["query_aware", "query_agnostic", "shared_context"],
                  "when the question is seen: in the prompt before eviction (query_aware, "
                  "default), after the context is compressed alone (query_agnostic; DGE and "
                  "DGE-W draft on it first), or one compressed cache per context for all its "
                  "questions (shared_context); recorded in the run identity unless query_aware")
flags.DEFINE_integer("anchor", 0, "shared_context: the question of each context (0: its first "
                     "row) DGE and DGE-W draft on; recorded in the run identity unless 0")
flags.DEFINE_integer("chunk", None, "prefill chunk (tokens; default: the platform's, 512 on "
                     "CPU; on TPU and GPU 8192 / the rows per device, in multiples of 512, "
                     "at least 512: 2048 at --batch_size 4)")
flags.DEFINE_enum("attention", "auto", list(ATTENTION), "attention kernels: auto (the "
                  "platform's: pallas on TPU, xla elsewhere), xla, pallas (the Pallas flash "
                  "kernel for prefill and KVzip's passes, a decode kernel for draft and decode "
                  "steps; interpret mode off TPU) or cudnn (GPU only: cuDNN's flash attention "
                  "for prefill and KVzip's passes; draft and decode steps on xla); recorded in "
                  "the run identity unless it resolves to xla")
flags.DEFINE_string("kv_quant", "none", "how the cache stores keys and values: none (the "
                    "model's dtype, default), int8 (one scale per token per kv head) or int4 "
                    "(KIVI's 4 bits, keys per channel and values per token in groups of 32, the "
                    "last 128 slots full precision; int4-g<G>-r<R> sets both); attention and "
                    "every rule read them dequantized; recorded in the run identity unless none")


def _kv_quant_ok(value: str) -> bool:
    """Whether `parse_kv_quant` reads `value` (the --kv_quant flag's validator)."""
    try:
        check_kv_quant(value)
    except ValueError:
        return False
    return True


flags.register_validator("kv_quant", _kv_quant_ok,
                         "kv_quant must be none, int8 or int4[-g<G>][-r<R>]")
flags.DEFINE_string("mesh", None, "device mesh, e.g. data=2,model=4: parameters and caches are "
                    "sharded, and each batch of --batch_size samples is spread over the data "
                    "axis (--batch_size must then be a multiple of it)")
flags.DEFINE_bool("distributed", False, "one of several processes (JAX's multi-controller "
                  "runtime: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or "
                  "detected on a TPU pod / GPU cluster; `python -m experiments.launch` starts "
                  "them locally): without --mesh, or with one of a process's own devices, the "
                  "processes split the batches; with a --mesh of every process's devices, one "
                  "model is sharded across them")
flags.DEFINE_enum("adaptive_rule", None, ["entropy", "top1"], "also run adaptive-k DGE cells "
                  "that stop drafting when the next-token entropy rises above / top-1 "
                  "probability falls below --adaptive_threshold")
flags.DEFINE_float("adaptive_threshold", 1.0, "threshold of --adaptive_rule")
flags.DEFINE_integer("k_max", 8, "most answer tokens an adaptive cell drafts")
flags.DEFINE_float("draft_weight", 1.0, "weight of draft queries relative to prompt-window "
                   "queries in DGE scores (1 = the paper's DGE)")
flags.DEFINE_integer("lookahead_budget", 512, "timing lookahead (LAQ): entries per kv head of "
                     "the compressed copy its k lookahead tokens are generated from")
flags.DEFINE_integer("lookahead_window", 32, "timing lookahead (LAQ): the query window the "
                     "rule compresses that copy with")



class UsageError(ValueError):
    """A mistake in the command line: one `error: ...` line and exit status 2."""


def list_flag(values: flags.FlagValues, name: str, integers: bool = False,
              may_be_empty: bool = False) -> list | None:
    """The items of list flag --name, each checked: no empty list (unless `may_be_empty`), no
    empty item (a stray comma), no repeat, and with `integers` whole numbers >= 1 (as ints).
    None when the flag has no default and was not given (--datasets)."""
    items = getattr(values, name)
    if items is None:
        return None
    default = values[name].default
    example = f"--{name} {','.join(default)}" if default else f"--{name} a,b"
    if not items and not may_be_empty:
        raise UsageError(f"--{name} is empty; give one or more comma-separated items, e.g. "
                         f"{example}" + ("" if default else f", or leave --{name} out"))
    values: list = []
    for item in items:
        if item == "":
            raise UsageError(f"--{name} {','.join(items)!r} has an empty item; remove the "
                             "stray comma")
        value: int | str = item
        if integers:
            if not re.fullmatch(r"[-+]?[0-9]+", item):
                raise UsageError(f"--{name}: {item!r} is not an integer; give comma-separated "
                                 f"whole numbers, e.g. {example}")
            value = int(item)
            if value < 1:
                raise UsageError(f"--{name} must be >= 1, got {item!r}; give comma-separated "
                                 f"whole numbers, e.g. {example}")
        if value in values:
            raise UsageError(f"--{name} gives {item!r} twice; give each item once")
        values.append(value)
    return values


def check_scalar_flags(values: flags.FlagValues, suite: Suite) -> None:
    """Refuses integer and number flags out of range (before anything is loaded or written)."""
    least = {"batch_size": 1, "chunk": 1, "num_samples": 1, "max_length": 2,
             "synthetic_length": 1, "ruler_length": 1, "window": 0, "kernel": 1,
             "lookahead_budget": 1, "lookahead_window": 1}
    if values.adaptive_rule:
        least["k_max"] = 1
    for name, low in least.items():
        value = getattr(values, name, None)  # a flag set defined without it: not given
        if value is not None and value < low:
            raise UsageError(f"--{name} must be >= {low}, got {value}; see --help")
    if values.draft_weight < 0:
        raise UsageError(f"--draft_weight must be >= 0, got {values.draft_weight}; see --help")
    if not values.answer_prefix and not suite.has_answer_prefix:
        others = " and ".join(f"--suite {s.name}" for s in suites.SUITES.values()
                              if s.has_answer_prefix)
        raise UsageError(f"--noanswer_prefix: {suite.title} prompts have no answer prefix; it "
                         f"applies to {others}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every setting of one run, read from the flags once (checked: a mistake is a
    `UsageError`). `datasets` is None when --datasets was not given (the suite's default
    then needs the data folder or the model)."""

    model: str
    dtype: str
    suite: Suite
    rows: RowSettings
    datasets: tuple[str, ...] | None
    cells: tuple[Cell, ...]
    num_samples: int | None
    max_length: int | None
    answer_prefix: bool
    batch_size: int
    chunk: int | None
    mesh: str | None
    out_dir: str | None
    extend: bool
    rule_options: dict
    draft_weight: float
    ties: str
    adaptive_rule: str | None
    adaptive_threshold: float
    k_max: int
    attention: str = "auto"
    sliding: str = "window"
    distributed: bool = False
    sliding_cache: str = "auto"
    kv_quant: str = "none"
    protocol: str = "query_aware"
    anchor: int = 0
    lookahead: Lookahead = Lookahead()

    @classmethod
    def from_flags(cls, values: flags.FlagValues) -> RunConfig:
        """The flags' values, checked in the order the runner always refused them: the grid,
        then the numbers, then the datasets."""
        suite = suites.get(values.suite)
        cells = build_cells(
            list_flag(values, "rules"), list_flag(values, "timings"),
            list_flag(values, "k", integers=True), list_flag(values, "budgets", integers=True),
            adaptive_k_max=values.k_max if values.adaptive_rule else None,
            decode_budgets=list_flag(values, "decode_budgets", integers=True,
                                     may_be_empty=True),
            intervals=list_flag(values, "intervals", integers=True))
        check_scalar_flags(values, suite)
        if values.anchor < 0 or (values.anchor and values.protocol != "shared_context"):
            raise UsageError(f"--anchor {values.anchor}: give a question index >= 0, with "
                             "--protocol shared_context (the one with several questions)")
        named = list_flag(values, "datasets")
        try:
            if values.metric is not None:
                suite.check_metric(values.metric)
            datasets = None if named is None else tuple(suite.resolve(named, values.metric))
        except ValueError as e:
            raise UsageError(str(e)) from e
        return cls(
            model=str(values.model), dtype=values.dtype, suite=suite,
            rows=RowSettings(values.data_dir, values.seed, values.synthetic_length,
                             values.ruler_length, values.metric),
            datasets=datasets, cells=tuple(cells),
            num_samples=values.num_samples or suite.num_samples,
            max_length=values.max_length, answer_prefix=values.answer_prefix,
            batch_size=values.batch_size, chunk=values.chunk, mesh=values.mesh,
            out_dir=values.out_dir, extend=values.extend,
            rule_options={k: getattr(values, k) for k in RULE_OPTIONS},
            draft_weight=values.draft_weight, ties=values.ties,
            adaptive_rule=values.adaptive_rule, adaptive_threshold=values.adaptive_threshold,
            k_max=values.k_max, attention=values.attention, sliding=values.sliding,
            distributed=values.distributed, sliding_cache=values.sliding_cache,
            kv_quant=values.kv_quant,
            protocol=values.protocol, anchor=values.anchor,
            lookahead=Lookahead(values.lookahead_budget, values.lookahead_window))

    def adaptive(self) -> Adaptive | None:
        """The adaptive-k rule of the grid's adaptive cells (None without --adaptive_rule)."""
        if self.adaptive_rule is None:
            return None
        return Adaptive(self.adaptive_rule, self.adaptive_threshold)

    @property
    def adaptive_identity(self) -> dict | None:
        """The adaptive rule as the run identity records it."""
        if self.adaptive_rule is None:
            return None
        return {"rule": self.adaptive_rule, "threshold": self.adaptive_threshold,
                "k_max": self.k_max}
