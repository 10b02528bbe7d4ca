"""Bad eviction requests fail early with a clear error naming the fix.

Most checks run before anything is compiled; the few that need a model use a 1-layer random
Llama that is never asked to generate past the check.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dge_jax import cli
from dge_jax.config import ModelConfig
from dge_jax.eviction.evict import Eviction, check_eviction, select_for
from dge_jax.eviction.timing import Timing
from dge_jax.families import get_family
from dge_jax.generation import generate
from dge_jax.model import Model
from dge_jax.rules.h2o import H2O
from dge_jax.rules.pyramidkv import PyramidKV
from dge_jax.rules.registry import make_rule
from dge_jax.rules.snapkv import SnapKV
from dge_jax.rules.streamingllm import StreamingLLM
from dge_jax.rules.tova import TOVA
from dge_jax.runtime.cache import init_cache
from dge_jax.runtime.records import DraftRecord, Observation

NL, B, HQ, HKV, S, D = 2, 1, 4, 2, 12, 8


@pytest.fixture(scope="module")
def model() -> Model:
    from models.llama_like import init_params

    cfg = ModelConfig(
        family="llama",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=128,
    )
    return Model(get_family("llama"), cfg, init_params(cfg, jax.random.PRNGKey(0)), None)


def _generate(model: Model, ev: Eviction, n: int = 20, max_new_tokens: int = 4):
    prompt = [i % 32 for i in range(n)]
    return generate(model, [prompt], max_new_tokens=max_new_tokens, eviction=ev)


# ---------------------------------------------------------------------------------------------
# Budgets


@pytest.mark.parametrize("budget", [0, -3, np.array([4, 0])], ids=["0", "-3", "per-layer"])
def test_budget_below_one(budget):
    """Refused when the Eviction is built (it used to wait for generate)."""
    with pytest.raises(ValueError, match=r"budget must be >= 1 entry per head, got (0|-3)"):
        Eviction(StreamingLLM(sinks=0), budget=budget, timing=Timing("prefill", 1))


def test_budget_not_an_integer():
    """A TypeError when the Eviction is built (it was a ValueError from check_eviction)."""
    with pytest.raises(TypeError, match="budget .* must be an int"):
        Eviction(SnapKV(), budget=64.5)


@pytest.mark.parametrize(
    "rule, timing, budget, need",
    [
        (SnapKV(window=8), Timing("prefill", 1), 7, 8),
        (SnapKV(window=8), Timing("dge", 2), 8, 9),  # the draft entry is kept too
        (SnapKV(window=8), Timing("dge_w", 4), 10, 11),  # three draft entries
        (H2O(window=16), Timing("dge", 2), 16, 17),
        (StreamingLLM(sinks=4), Timing("prefill", 1), 3, 4),
        (StreamingLLM(sinks=4), Timing("dge", 3), 5, 6),
        (PyramidKV(window=32), Timing("prefill", 1), 31, 32),
    ],
    ids=["snapkv", "snapkv-dge2", "snapkv-dge_w4", "h2o-dge2", "sinks", "sinks-dge3", "pyramid"],
)
def test_budget_smaller_than_protected_entries(model, rule, timing, budget, need):
    ev = Eviction(rule, budget=budget, timing=timing)
    name = type(rule).__name__
    with pytest.raises(ValueError, match=rf"budget {budget} is smaller than what {name} always"):
        _generate(model, ev, n=40)
    with pytest.raises(ValueError, match=rf"= {need}\); raise the budget or shrink the window"):
        check_eviction(ev, max_new_tokens=8)
    check_eviction(Eviction(rule, budget=need, timing=timing), max_new_tokens=8)  # enough


def test_per_layer_budget_for_a_scheduling_rule():
    ev = Eviction(PyramidKV(window=8), budget=np.array([64, 32]))
    with pytest.raises(ValueError, match="PyramidKV sets per-layer budgets itself"):
        check_eviction(ev, max_new_tokens=8)


def test_capacity_too_small_for_what_is_kept(model):
    # After the draft step 2 of the 4 answer tokens exist: 10 kept + 2 to come > 11 slots.
    ev = Eviction(SnapKV(window=4), budget=10, timing=Timing("dge", 2), capacity=11)
    with pytest.raises(ValueError, match=r"compaction needs 12 slots per head \(10 kept \+ 2 new"):
        _generate(model, ev, n=40, max_new_tokens=4)


def test_unknown_head_budget():
    with pytest.raises(ValueError, match="head_budget must be one of"):
        Eviction(SnapKV(), head_budget="pyramid")


@pytest.mark.parametrize(
    "fields, error, message",
    [
        (dict(capacity=0), ValueError, r"Eviction\.capacity must be an integer >= 1, got 0"),
        (dict(capacity=64.0), TypeError, r"Eviction\.capacity must be an integer >= 1, got 64\.0"),
        (dict(alpha=1.5), ValueError, r"Eviction\.alpha must be a number in \[0, 1\], got 1\.5"),
        (dict(alpha="0.2"), TypeError, r"Eviction\.alpha must be a number in \[0, 1\]"),
        (dict(compact="no"), TypeError, r"Eviction\.compact must be True or False, got 'no'"),
    ],
)
def test_bad_eviction_fields_fail_at_construction(fields, error, message):
    with pytest.raises(error, match=message):
        Eviction(SnapKV(), **fields)
    assert Eviction(SnapKV(), capacity=np.int64(64)).capacity == 64


# ---------------------------------------------------------------------------------------------
# Timings


@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_k_below_one_or_not_an_integer(k):
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        Timing("dge", k)


def test_unknown_timing_kind():
    with pytest.raises(ValueError, match="unknown timing 'later'; choose one of prefill, dge"):
        Timing("later", 2)


@pytest.mark.parametrize("kind", ["dge", "dge_w"])
def test_k_above_max_new_tokens(model, kind):
    ev = Eviction(SnapKV(window=4), budget=8, timing=Timing(kind, 5))
    with pytest.raises(ValueError, match="k=5 answer tokens are drafted .* max_new_tokens=4"):
        _generate(model, ev, max_new_tokens=4)
    check_eviction(Eviction(SnapKV(window=4), budget=8, timing=Timing(kind, 4)), 4)  # k == max


# ---------------------------------------------------------------------------------------------
# Rules


def test_unknown_rule_name():
    known = r"known: chunkkv, .*full, h2o, .*tova, and chunkkv_<rule>"
    with pytest.raises(ValueError, match=rf"unknown rule 'snapkv2'; {known}"):
        make_rule("snapkv2")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['windw'\] for rule 'snapkv'"):
        make_rule("snapkv", windw=8)
    assert make_rule("SnapKV", window=8) == SnapKV(window=8)  # names are case-insensitive


def _cache_and_obs():
    cache = init_cache(NL, B, HKV, S, D)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (NL, B, HKV, S))
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=cache.k.shape), jnp.float32)
    cache = type(cache).stacked(k=k, v=k, pos=pos, index=S)
    full = Observation(
        q=jnp.asarray(rng.normal(size=(NL, B, HQ, 4, D)), jnp.float32),
        q_pos=jnp.asarray([[8, 9, 10, 11]], jnp.int32),
        attn_sum=jnp.ones((NL, B, HQ, S), jnp.float32),
        is_draft=jnp.zeros((4,), bool),
        prompt_end=jnp.asarray([S - 1], jnp.int32),
    )
    return cache, full


@pytest.mark.parametrize(
    "rule, missing",
    [
        (SnapKV(window=4), "q"),
        (TOVA(), "q"),
        (PyramidKV(window=4), "q"),
        (H2O(window=2), "attn_sum"),
    ],
    ids=["snapkv", "tova", "pyramidkv", "h2o"],
)
def test_rule_needs_data_the_forward_did_not_record(rule, missing):
    cache, full = _cache_and_obs()
    lacking = Observation(
        q=None if missing == "q" else full.q,
        q_pos=None if missing == "q" else full.q_pos,
        attn_sum=None,
        is_draft=None,
        prompt_end=full.prompt_end,
    )
    message = f"this rule needs obs.{missing}, which the forward did not record"
    with pytest.raises(ValueError, match=message):
        rule.score(cache, lacking)
    with pytest.raises(ValueError, match=message):
        select_for(
            cache, lacking, None, jnp.int32(6), jnp.asarray(False), rule=rule
        ).block_until_ready()
    # A draft record does not stand in for the prompt's observation.
    none = jnp.zeros((B, 1), jnp.float32)
    drafts = DraftRecord(
        q=None, q_pos=jnp.full((B, 1), -1, jnp.int32), probs=None, entropy=none, top1=none
    )
    with pytest.raises(ValueError, match=message):
        select_for(cache, lacking, drafts, jnp.int32(6), jnp.asarray(True), rule=rule)
    # With everything recorded the same call works and keeps 6 entries per head on average
    # (PyramidKV moves some between layers).
    keep = select_for(cache, full, None, jnp.int32(6), jnp.asarray(False), rule=rule)
    assert int(np.asarray(keep).sum()) == NL * B * HKV * 6


# ---------------------------------------------------------------------------------------------
# Command line


def test_cli_prefill_with_k_exits_2_with_one_line(capsys):
    argv = ["generate", "--prompt", "hello", "--rule", "snapkv", "--timing", "prefill"]
    assert cli.main(argv + ["--k", "3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    want = "error: --k applies to --timing dge/dge_w/dge_d/lookahead; prefill evicts at k=1"
    assert lines == [want]


def _cli_error(capsys, *flags: str) -> str:
    """The one stderr line of a generate call that must exit 2 before loading any model."""
    assert cli.main(["generate", "--model", "/no/such/model", "--prompt", "hi", *flags]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--budget", "-5", "--k", "0"], "--budget, --k"),
        (["--timing", "prefill"], "--timing"),
        (["--head_budget", "adakv"], "--head_budget"),
        (["--window", "8", "--gqa", "max"], "--window, --gqa"),
        (["--rule", "full", "--budget", "128"], "--budget"),
        (["--decode_budget", "64", "--interval", "8"], "--decode_budget, --interval"),
        (["--lookahead_budget", "64"], "--lookahead_budget"),
    ],
)
def test_cli_eviction_flags_without_an_evicting_rule_are_refused(capsys, flags, named):
    """With --rule full (the default) these flags would be silently ignored."""
    line = _cli_error(capsys, *flags)
    evicting = "(chunkkv, criticalkv, expectedattention, h2o, keydiff, knorm, kvzip, lagkv"
    assert line.startswith(f"error: {named} only apply with an evicting --rule {evicting}")
    assert line.endswith("--rule full (the default) keeps the whole cache")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--budget", "0"], "--budget must be >= 1 (entries kept per kv head), got 0"),
        (["--budget", "-5", "--timing", "prefill"], "--budget must be >= 1"),
        (["--k", "0"], "--k must be >= 1 (answer tokens before eviction), got 0"),
        (["--k", "-2", "--timing", "dge_w"], "--k must be >= 1"),
        (["--k", "2", "--timing", "prefill"], "--k applies to --timing dge/dge_w/dge_d/lookahe"),
        (["--k", "1", "--timing", "dge_d"], "timing dge_d observes only the k - 1 drafted"),
        (["--lookahead_budget", "64"], "--lookahead_budget apply to --timing lookahead"),
        (["--timing", "lookahead", "--lookahead_window", "0"], "Lookahead.window must be an"),
        (["--interval", "8"], "--interval applies with --decode_budget"),
        (["--timing", "decode"], "--timing decode evicts only while decoding: give --decode_"),
        (["--decode_budget", "0"], "--decode_budget must be >= 1 (entries per kv head), got 0"),
        (["--decode_budget", "64", "--interval", "0"], "--interval must be >= 1"),
        (["--timing", "decode", "--decode_budget", "64", "--k", "3"], "--k applies to --timing"),
    ],
)
def test_cli_bad_budget_or_k_is_one_line(capsys, flags, message):
    assert _cli_error(capsys, "--rule", "snapkv", *flags).startswith(f"error: {message}")


def test_cli_prefill_accepts_k_1(capsys):
    """k = 1 is what prefill means: accepted, as is leaving --k out."""
    line = _cli_error(capsys, "--rule", "snapkv", "--timing", "prefill", "--k", "1")
    assert "/no/such/model" in line and "--k" not in line  # the flags passed; the model did not
    parse = cli.build_parser().parse_args
    base = ["generate", "--prompt", "hi", "--rule", "snapkv", "--timing", "prefill"]
    for extra in (["--k", "1"], []):
        ev = cli.eviction_from_args(parse(base + extra))
        assert ev.timing == Timing("prefill", 1) and ev.budget == 256
    ev = cli.eviction_from_args(parse(["generate", "--prompt", "hi", "--rule", "h2o"]))
    assert ev.timing == Timing("dge", 2) and ev.head_budget == "uniform"
    assert cli.eviction_from_args(parse(["generate", "--prompt", "hi"])) is None


def test_cli_unknown_rule_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--prompt", "hello", "--rule", "snapkv2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --rule: invalid choice: 'snapkv2'" in err


def test_cli_unknown_rule_option_is_one_line(checkpoint, capsys):
    """An option the rule does not take (--kernel for H2O) is one line, not a traceback."""
    argv = ["generate", "--model", str(checkpoint("llama_chat")), "--prompt", "hi"]
    argv += ["--rule", "h2o"]
    assert cli.main(argv + ["--kernel", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown option(s) ['kernel'] for rule")


def test_cli_budget_too_small_is_one_line(checkpoint, capsys):
    argv = ["generate", "--model", str(checkpoint("llama_chat")), "--prompt", "the cat sat"]
    argv += ["--rule", "snapkv", "--window", "8", "--budget", "8", "--timing", "dge"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: budget 8 is smaller than what SnapKV")
