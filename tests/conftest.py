"""Shared fixtures: tiny random Hugging Face checkpoints and a tiny tokenizer, all built in code.

`checkpoint(name)` builds (once per session) a random transformers model of one of the
`VARIANTS` below with `torch.manual_seed`, saves it with `save_pretrained`, and returns the
folder. Variants cover every family, RoPE kind, head layout and config style the loader reads:

    name              family   heads q/kv  head   rope                      config keys
    llama             llama    4/2 (GQA)   untied default                   new (rope_parameters)
    llama_linear_old  llama    4/4 (MHA)   tied   linear x2, +attn/mlp bias old (rope_scaling.type)
    llama3            llama    4/1 (MQA)   untied llama3, original max 32   new
    llama3_old        llama    4/1 (MQA)   untied llama3, original max 32   old (rope_scaling)
    mistral_old       mistral  4/2         untied default, theta 1e6        old (rope_theta)
    qwen2             qwen2    4/2         tied   default, q/k/v biases     new
    qwen3             qwen3    4/2, hd 32  untied default, q/k norms        new
    mistral_sliding   mistral  4/2         untied every layer a window of 8 new
    qwen2_sliding     qwen2    4/2         tied   layer 1 a window of 8     new
    gemma2            gemma2   4/2         tied   window 8 on layer 0, soft caps, scalar 24
    gemma3            gemma3   4/2         tied   window 8 on layer 0 (rope theta 100),
                                                  global linear x2, q/k norms, scalar 24
    llama_sharded     llama    = llama, saved as several shards + model.safetensors.index.json
    llama_chat        llama    = llama's sizes, with tokenizer.json + chat template (text/CLI)

Norm weights are 1 + N(0, 0.2²) and biases N(0, 0.2²): random init leaves them at 1 and 0,
which would hide a missing norm weight or bias. Everything is tiny (hidden 64, 2 layers,
vocab 128) so the whole parity suite runs in a couple of minutes on two CPU cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402 (after JAX_PLATFORMS, before anything imports JAX)

# The tests' programs are tiny, so compiling them is most of the suite's time: LLVM's
# optimisation passes off (XLA's HLO passes, fusion included, still run) take about a fifth
# off its CPU time. Set before JAX starts, in this process and the subprocesses it launches.
_NO_LLVM_OPT = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", "")]
    + [f for f in _NO_LLVM_OPT if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
).strip()

VOCAB = 128
BASE_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # Wider than the default 0.02 so logits spread out and greedy argmaxes are far from ties.
    initializer_range=0.1,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One tiny checkpoint: family, config overrides, and how it is written to disk.

    old_keys: rewrite config.json with `rope_theta` + `rope_scaling` + `torch_dtype` (the
    pre-transformers-5 spelling) instead of `rope_parameters` + `dtype`; old_rope_type_key is
    the key naming the rope kind in `rope_scaling` ("type" in the oldest configs).
    """

    model_type: str
    config: dict = dataclasses.field(default_factory=dict)
    seed: int = 0
    old_keys: bool = False
    old_rope_type_key: str = "rope_type"
    max_shard_size: str | None = None
    tokenizer: bool = False


VARIANTS: dict[str, Variant] = {
    "llama": Variant("llama"),
    "llama_linear_old": Variant(
        "llama",
        dict(
            num_key_value_heads=4,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
        seed=1,
        old_keys=True,
        old_rope_type_key="type",
    ),
    "llama3": Variant("llama", dict(num_key_value_heads=1, rope_parameters=LLAMA3_ROPE), seed=2),
    "llama3_old": Variant(
        "llama", dict(num_key_value_heads=1, rope_parameters=LLAMA3_ROPE), seed=3, old_keys=True
    ),
    "mistral_old": Variant(
        "mistral",
        dict(sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        seed=4,
        old_keys=True,
    ),
    "qwen2": Variant("qwen2", dict(tie_word_embeddings=True), seed=5),
    "qwen3": Variant("qwen3", dict(head_dim=32), seed=6),
    # Sliding windows of 8 keys: every parity prompt (13 to 91 tokens) runs past them.
    "mistral_sliding": Variant("mistral", dict(sliding_window=8), seed=8),
    "qwen2_sliding": Variant(
        "qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), seed=9
    ),
    "gemma2": Variant(
        "gemma2",
        dict(sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=1.5,
             final_logit_softcapping=3.0, head_dim=16),
        seed=10,
    ),  # fmt: skip
    "gemma3": Variant(
        "gemma3_text",
        dict(sliding_window=8, query_pre_attn_scalar=24, head_dim=16,
             layer_types=["sliding_attention", "full_attention"],
             rope_parameters={
                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
        seed=11,
    ),  # fmt: skip
    "llama_sharded": Variant("llama", max_shard_size="20KB"),  # same seed: same weights as llama
    "llama_chat": Variant("llama", seed=7, tokenizer=True),
}

# ---------------------------------------------------------------------------------------------
# Tokenizer: a word-level vocabulary of exactly VOCAB entries, so every model id decodes.

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = (
    "system user assistant the a cat dog sat ran on mat what is capital of france paris "
    "hello world you are helpful answer question and to in it"
).split()
FILLER = [f"w{i}" for i in range(VOCAB - len(SPECIAL_TOKENS) - len(WORDS))]
VOCAB_WORDS = SPECIAL_TOKENS + WORDS + FILLER
EOS_TOKEN, EOS_ID = "</s>", 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tokenizer(folder: pathlib.Path, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """Writes tokenizer.json (word level, whitespace split) and tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    assert len(set(VOCAB_WORDS)) == VOCAB
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB_WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": EOS_TOKEN,
        "unk_token": "<unk>",
        "model_max_length": 256,
        "add_bos_token": False,
    }
    if chat_template is not None:
        tcfg["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))


# ---------------------------------------------------------------------------------------------
# Checkpoints


def _perturb(model) -> None:
    """Norm weights 1 + N(0, 0.2²), biases N(0, 0.2²): visible if the loader drops them."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                torch.nn.init.normal_(p, mean=1.0, std=0.2)
            elif name.endswith(".bias"):
                torch.nn.init.normal_(p, mean=0.0, std=0.2)


def to_old_keys(config: dict, rope_type_key: str = "rope_type") -> dict:
    """config.json in the pre-transformers-5 spelling: rope_theta + rope_scaling, torch_dtype."""
    config = dict(config)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    config["rope_scaling"] = None if kind == "default" else {rope_type_key: kind, **rope}
    config["torch_dtype"] = config.pop("dtype")
    return config


def build_checkpoint(variant: Variant, folder: pathlib.Path) -> pathlib.Path:
    """Builds the variant's random model with transformers and saves it to `folder`."""
    import torch
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3_text": transformers.Gemma3TextConfig,
    }[variant.model_type]
    transformers.utils.logging.disable_progress_bar()  # keeps captured stderr clean
    torch.manual_seed(variant.seed)
    config = config_cls(**(BASE_CONFIG | variant.config))
    if variant.tokenizer:
        config.bos_token_id, config.eos_token_id = 1, EOS_ID
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _perturb(model)
    kwargs = {"max_shard_size": variant.max_shard_size} if variant.max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    if variant.old_keys:
        path = folder / "config.json"
        raw = to_old_keys(json.loads(path.read_text()), variant.old_rope_type_key)
        path.write_text(json.dumps(raw, indent=2))
    if variant.tokenizer:
        write_tokenizer(folder)
    return folder


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drops every compiled executable after each test module.

    XLA:CPU maps each executable's machine code into memory mappings of its own; the full
    suite compiles enough of them to pass Linux's per-process limit (vm.max_map_count,
    65,530 by default; 40k+ by 60 % of the suite), after which the compiler's next mmap fails
    and the process segfaults inside `backend_compile_and_load`. Clearing after each module
    keeps the count near 1,100 (measured with /proc/self/maps), at the cost of recompiling
    what a later module shares with an earlier one.
    """
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> folder of the tiny `VARIANTS[name]` checkpoint (built once)."""
    import torch

    torch.set_num_threads(1)  # two shared cores: one each for torch and XLA
    built: dict[str, pathlib.Path] = {}

    def get(name: str) -> pathlib.Path:
        if name not in built:
            built[name] = build_checkpoint(VARIANTS[name], tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture
def checkpoint_copy(checkpoint, tmp_path):
    """checkpoint_copy(name) -> a writable copy of a tiny checkpoint, for breaking it."""

    def copy(name: str) -> pathlib.Path:
        target = tmp_path / name
        shutil.copytree(checkpoint(name), target)
        return target

    return copy


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> pathlib.Path:
    """A folder with only tokenizer.json + tokenizer_config.json (chat template, eos </s>)."""
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(folder)
    return folder


# ---------------------------------------------------------------------------------------------
# Real data rows: ../shared/data beside the checkout, or the folders the variables name


SHARED_DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
DATA_VARIABLES = {"DGE_LONGBENCH_DIR": "longbench", "DGE_RULER_DIR": "ruler",
                  "DGE_LOOGLE_DIR": "loogle"}
for _variable, _folder in DATA_VARIABLES.items():
    # Set for the library and the runner subprocesses too, so nothing needs exporting.
    if not os.environ.get(_variable) and (SHARED_DATA / _folder).is_dir():
        os.environ[_variable] = str(SHARED_DATA / _folder)


def shared_data_dir(variable: str) -> pathlib.Path:
    """The rows folder of `variable` (set, or found at ../shared/data beside the checkout).

    Without it the test skips with the reason, so a user without ../shared still gets a green
    run of everything else; under CI (CI=true) it fails instead, since a CI run that skipped
    its real-data tests would prove nothing about them.
    """
    path = os.environ.get(variable)
    if path and pathlib.Path(path).is_dir():
        return pathlib.Path(path)
    reason = (f"{variable}={path} is not a folder" if path else
              f"no real rows: {SHARED_DATA / DATA_VARIABLES[variable]} is absent and "
              f"{variable} is unset (put ../shared beside the checkout or set {variable})")
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def data_dir() -> pathlib.Path:
    """The shared LongBench rows folder (`shared_data_dir`)."""
    return shared_data_dir("DGE_LONGBENCH_DIR")


@pytest.fixture(scope="session")
def loogle_dir() -> pathlib.Path:
    """The shared LooGLE rows folder (`shared_data_dir`)."""
    return shared_data_dir("DGE_LOOGLE_DIR")


# ---------------------------------------------------------------------------------------------
# Slow tests: the real model, the docs' and notebook's examples, long runner and benchmark runs.
# A plain `python -m pytest` (the README's command) reports them as skipped, naming how to run
# them; `--slow` runs them too, and naming a test file or test on the command line runs its
# slow tests. CI (.ci/run) runs the README's command, then the slow tests that are not also
# marked long (`python -m pytest --slow -m "slow and not long"`): a long test takes minutes
# (4,096-token parity, 2-process runs) and runs with `--slow` only.


def pytest_addoption(parser):
    parser.addoption(
        "--slow", action="store_true", help="also run the tests marked slow (CI runs them)"
    )


def _named_on_command_line(config) -> bool:
    """True when the command line names a test file or a test (not only folders)."""
    return any(".py" in str(arg) for arg in config.args)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow") or _named_on_command_line(config):
        return
    slow = pytest.mark.skip(reason="slow: run with --slow (CI runs it; see docs/usage.md)")
    long = pytest.mark.skip(
        reason="long: run with --slow (minutes; CI leaves it out; see docs/usage.md)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(long)
        elif "slow" in item.keywords:
            item.add_marker(slow)
