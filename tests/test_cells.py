"""The evaluation grid (`experiments.cells`): ids, ordering, errors, and the Eviction of a cell."""

import pytest

from dge_jax.eviction.timing import Adaptive, Timing
from dge_jax.rules.h2o import H2O
from dge_jax.rules.snapkv import SnapKV
from dge_jax.rules.streamingllm import StreamingLLM
from experiments.cells import Cell, build_cells, check_rule, parse_cell_id

OPTIONS = {"window": 4, "kernel": 5, "pooling": "avg", "gqa": "max"}


def test_ids_round_trip_through_parse_cell_id():
    cells = build_cells(
        ["full", "snapkv", "adakv_snapkv", "h2o", "streamingllm"],
        ["prefill", "dge", "dge_w"],
        [1, 2, 8],
        [16, 128],
    )
    assert len({c.id for c in cells}) == len(cells)
    for cell in cells:
        assert parse_cell_id(cell.id) == cell
    # A cell built by hand (a dge cell at k=1 keeps its k in the id).
    assert parse_cell_id("snapkv/dge/k1/b16") == Cell("snapkv", "dge", 1, 16)
    assert Cell("snapkv", "dge", 1, 16).id == "snapkv/dge/k1/b16"
    adaptive = build_cells(["snapkv"], ["dge", "dge_w"], [2, 8], [16], adaptive_k_max=8)
    assert sum(c.adaptive for c in adaptive) == 2
    for cell in adaptive:
        assert parse_cell_id(cell.id) == cell


def test_id_spelling():
    assert Cell("full").id == "full"
    assert Cell("snapkv", "prefill", 1, 128).id == "snapkv/prefill/b128"
    assert Cell("adakv_snapkv", "dge_w", 4, 64).id == "adakv_snapkv/dge_w/k4/b64"
    assert Cell("snapkv", "dge", 8, 64, adaptive=True).id == "snapkv/dge/k8a/b64"


def test_build_cells_ordering():
    """FullKV first wherever it is listed; then rule, timing, k, budget in the order given;
    prefill cells once (k=1) whatever the ks; duplicates dropped."""
    ids = [c.id for c in build_cells(["snapkv", "full", "h2o"], ["dge", "prefill"], [2, 4],
                                     [128, 64])]
    assert ids == [
        "full",
        "snapkv/dge/k2/b128", "snapkv/dge/k2/b64", "snapkv/dge/k4/b128", "snapkv/dge/k4/b64",
        "snapkv/prefill/b128", "snapkv/prefill/b64",
        "h2o/dge/k2/b128", "h2o/dge/k2/b64", "h2o/dge/k4/b128", "h2o/dge/k4/b64",
        "h2o/prefill/b128", "h2o/prefill/b64",
    ]
    dup = build_cells(["snapkv", "snapkv"], ["prefill", "prefill"], [2, 2], [16, 16])
    assert [c.id for c in dup] == ["snapkv/prefill/b16"]
    assert build_cells(["full"], ["dge"], [2], [16]) == [Cell("full")]
    assert build_cells(["snapkv"], ["prefill"], [3], [16]) == [Cell("snapkv", "prefill", 1, 16)]


def test_build_cells_adaptive_cells_follow_each_dge_timing():
    ids = [c.id for c in build_cells(["full", "snapkv"], ["prefill", "dge", "dge_w"], [2],
                                     [16, 64], adaptive_k_max=8)]
    assert ids == [
        "full", "snapkv/prefill/b16", "snapkv/prefill/b64",
        "snapkv/dge/k2/b16", "snapkv/dge/k2/b64", "snapkv/dge/k8a/b16", "snapkv/dge/k8a/b64",
        "snapkv/dge_w/k2/b16", "snapkv/dge_w/k2/b64", "snapkv/dge_w/k8a/b16",
        "snapkv/dge_w/k8a/b64",
    ]


@pytest.mark.parametrize(
    "args, match",
    [
        ((["snapkvv"], ["prefill"], [2], [16]), "unknown rule 'snapkvv'"),
        ((["adakv_nope"], ["prefill"], [2], [16]), "unknown rule 'adakv_nope'"),
        ((["adakv_full"], ["prefill"], [2], [16]), "unknown rule 'adakv_full'"),
        ((["snapkv"], ["later"], [2], [16]), "unknown timing 'later'"),
        ((["snapkv"], ["dge"], [0], [16]), "k must be >= 1"),
        ((["snapkv"], ["dge"], [2], [0]), "budgets must be >= 1"),
        ((["snapkv"], ["dge"], [2], [16, -4]), "budgets must be >= 1"),
    ],
)
def test_build_cells_errors(args, match):
    with pytest.raises(ValueError, match=match):
        build_cells(*args)


def test_check_rule_lists_the_known_rules():
    with pytest.raises(ValueError, match=r"known: full, .*snapkv.*adakv_<rule>"):
        check_rule("bogus")
    for ok in ("full", "snapkv", "pyramidkv", "h2o", "streamingllm", "tova", "adakv_pyramidkv"):
        check_rule(ok)


def test_full_cell_has_no_eviction():
    assert Cell("full").eviction(OPTIONS) is None


def test_adakv_prefix_sets_head_budget():
    ada = Cell("adakv_snapkv", "dge", 2, 64).eviction(OPTIONS)
    plain = Cell("snapkv", "dge", 2, 64).eviction(OPTIONS)
    assert ada.head_budget == "adakv" and plain.head_budget == "uniform"
    assert ada.rule == plain.rule == SnapKV(window=4, kernel=5, pooling="avg", gqa="max")
    assert ada.budget == 64 and ada.timing == Timing("dge", 2)
    assert Cell("adakv_snapkv", "dge", 2, 64).rule_name == "snapkv"
    assert ada.alpha == 0.2


def test_global_prefix_pools_every_layer_with_kvzips_alpha():
    from dge_jax.rules.kvzip import KVzip

    ev = Cell("global_kvzip", "prefill", 1, 64).eviction(OPTIONS)
    assert ev.head_budget == "global" and ev.alpha == 0.0 and ev.rule == KVzip()
    assert Cell("global_kvzip", "dge", 2, 64).id == "global_kvzip/dge/k2/b64"
    check_rule("global_chunkkv_kvzip")
    with pytest.raises(ValueError, match="unknown rule 'global_nope'.*global_<rule>"):
        check_rule("global_nope")


def test_prefill_cell_eviction_timing():
    ev = Cell("snapkv", "prefill", 1, 32).eviction(OPTIONS)
    assert ev.timing == Timing("prefill", 1) and ev.budget == 32


def test_rule_options_are_filtered_per_rule():
    """H2O takes window and gqa, not kernel or pooling; StreamingLLM takes none of them."""
    h2o = Cell("h2o", "dge_w", 2, 16).eviction(OPTIONS).rule
    assert h2o == H2O(window=4, gqa="max")
    stream = Cell("streamingllm", "prefill", 1, 16).eviction(OPTIONS).rule
    assert stream == StreamingLLM()
    # None means "the rule's default".
    snap = Cell("snapkv", "prefill", 1, 16).eviction({"window": None, "kernel": 3}).rule
    assert snap == SnapKV(kernel=3)


def test_adaptive_cell_eviction():
    cell = Cell("snapkv", "dge", 8, 16, adaptive=True)
    rule = Adaptive("top1", 0.5)
    ev = cell.eviction(OPTIONS, rule, draft_weight=0.5)
    assert ev.timing == Timing("dge", 8, adaptive=rule, draft_weight=0.5)
    with pytest.raises(ValueError, match="adaptive"):
        cell.eviction(OPTIONS)
    # A fixed-k cell ignores the rule; a prefill cell ignores the draft weight.
    assert Cell("snapkv", "dge", 2, 16).eviction(OPTIONS, rule).timing == Timing("dge", 2)
    prefill = Cell("snapkv", "prefill", 1, 16).eviction(OPTIONS, None, draft_weight=0.5)
    assert prefill.timing == Timing("prefill", 1)


def test_wrapped_rules_as_cell_rules():
    """A wrapper names its inner rule in the cell's rule ("criticalkv_h2o"); options go to the rule
    that takes them; a wrapper of a wrapper, or of FullKV, is refused by name."""
    from dge_jax.rules.chunkkv import ChunkKV
    from dge_jax.rules.criticalkv import CriticalKV
    from dge_jax.rules.expected_attention import ExpectedAttention

    cells = build_cells(
        ["criticalkv_expectedattention", "adakv_chunkkv_h2o"], ["dge"], [2], [32]
    )
    options = {"window": 8, "kernel": 7}
    crit, chunk = (c.eviction(c.rule_options(options)) for c in cells)
    assert crit.rule == CriticalKV(inner=ExpectedAttention())  # it takes no window
    assert chunk.rule == ChunkKV(inner=H2O(window=8)) and chunk.head_budget == "adakv"
    assert cells[1].id == "adakv_chunkkv_h2o/dge/k2/b32"
    for rule in ("chunkkv_criticalkv", "criticalkv_full", "chunkkv_nope"):
        with pytest.raises(ValueError, match=f"unknown rule '{rule}'|inner rule must be"):
            build_cells([rule], ["dge"], [2], [32])


def test_decode_cells_ids_and_evictions():
    """Cells that also compress while decoding: one variant per decode budget x interval next
    to each cell, timing "decode" at its decode budget; ids round-trip and carry the spec."""
    from dge_jax.eviction.decode_spec import DecodeCompression

    cells = build_cells(["full", "snapkv"], ["prefill", "dge", "decode"], [2], [64],
                        decode_budgets=[32, 48], intervals=[8])
    assert [c.id for c in cells] == [
        "full", "snapkv/prefill/b64", "snapkv/prefill/b64/d32/i8", "snapkv/prefill/b64/d48/i8",
        "snapkv/dge/k2/b64", "snapkv/dge/k2/b64/d32/i8", "snapkv/dge/k2/b64/d48/i8",
        "snapkv/decode/b32/d32/i8", "snapkv/decode/b48/d48/i8",
    ]  # fmt: skip
    for cell in cells:
        assert parse_cell_id(cell.id) == cell
    ev = parse_cell_id("snapkv/dge/k2/b64/d32/i8").eviction(OPTIONS)
    assert ev.decode == DecodeCompression(32, 8) and ev.budget == 64 and ev.timing.k == 2
    ev = parse_cell_id("snapkv/decode/b32/d32/i8").eviction(OPTIONS)
    assert ev.timing.kind == "decode" and ev.budget == 32 and ev.decode.interval == 8
    assert parse_cell_id("snapkv/dge/k2/b64/d32/i8").without_decode.id == "snapkv/dge/k2/b64"
    with pytest.raises(ValueError, match="give decode budgets"):
        build_cells(["snapkv"], ["decode"], [2], [64])
