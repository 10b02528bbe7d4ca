"""Phi-3 / Phi-3.5 (`models/phi3.py`): parity with transformers' Phi3ForCausalLM on tiny random
checkpoints built here, the fused-tensor split, LongRoPE and the strict config.

Variants (f32, two left-padded prompts of different lengths, as `tests/test_parity.py`):

- "default": default RoPE; prefill in chunks of 8;
- "longrope_short": LongRoPE with original_max_position_embeddings=32 and prompt + generated
  tokens within 32: the short factors throughout (transformers and here);
- "longrope_long": the same checkpoint, both prompts longer than 32: the long factors
  throughout. Prefill runs in one chunk: this library picks the factor set per forward call
  (`dge_jax.runtime.rope`), transformers per call over the whole prompt.

Every tiny config sets sliding_window larger than any sequence, except the window test at the
end (a window of 8 on 20-token prompts).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import dge_jax
from dge_jax.checkpoints.hf import CheckpointError, load_hf_checkpoint, parse_config
from dge_jax.config import ConfigError, RopeConfig
from dge_jax.runtime import decoding
from dge_jax.runtime.rope import LongRopeFrequencies, inverse_frequencies, rope_tables
from dge_jax.text.prompts import pad_left
from tests.conftest import BASE_CONFIG, VOCAB, to_old_keys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOGITS_TOL = 1e-4
HEAD_DIM = 16
ORIGINAL = 32
BASE = BASE_CONFIG | dict(
    sliding_window=1024,  # longer than every sequence here: masks nothing
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_rng = np.random.RandomState(3)
SHORT_FACTOR = [round(float(x), 4) for x in 1.0 + 0.5 * _rng.rand(HEAD_DIM // 2)]
LONG_FACTOR = [round(float(x), 4) for x in 1.0 + 7.0 * _rng.rand(HEAD_DIM // 2)]
LONGROPE = dict(
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": SHORT_FACTOR,
        "long_factor": LONG_FACTOR,
    },
    original_max_position_embeddings=ORIGINAL,
)
CHECKPOINTS = {"default": {}, "longrope": LONGROPE, "window": {"sliding_window": 8}}


@dataclasses.dataclass(frozen=True)
class Case:
    checkpoint: str
    lengths: tuple[int, int]
    new_tokens: int
    chunk: int | None  # prefill chunk of generate (None: the platform's, one chunk here)


CASES = {
    "default": Case("default", (20, 13), 24, 8),
    "longrope_short": Case("longrope", (12, 9), 16, 8),  # 12 + 16 <= 32
    "longrope_long": Case("longrope", (45, 40), 16, None),
}


def build(folder: pathlib.Path, extra: dict, seed: int = 0) -> pathlib.Path:
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = transformers.Phi3Config(**(BASE | extra))
    model = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                torch.nn.init.normal_(p, mean=1.0, std=0.2)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    built: dict[str, pathlib.Path] = {}

    def get(name: str) -> pathlib.Path:
        if name not in built:
            built[name] = build(tmp_path_factory.mktemp(name), CHECKPOINTS[name])
        return built[name]

    return get


@functools.cache
def _hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@functools.cache
def _ours(folder):
    return dge_jax.load(folder)


def prompts_of(name: str) -> list[list[int]]:
    rng = np.random.RandomState(sum(map(ord, name)))
    return [rng.randint(3, VOCAB, n).tolist() for n in CASES[name].lengths]


@functools.cache
def _reference(name: str, folder) -> tuple[list[list[int]], list[np.ndarray]]:
    """transformers' greedy tokens per row (unpadded), and its logits over prompt + them."""
    hf, n = _hf(folder), CASES[name].new_tokens
    tokens, logits = [], []
    for row in prompts_of(name):
        ids = torch.tensor([row])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
            new = out[0, len(row) :].tolist()
            tokens.append(new)
            logits.append(hf(torch.tensor([row + new[:-1]])).logits[0].numpy())
    return tokens, logits


def _teacher_forced(model, seqs) -> list[np.ndarray]:
    t = max(map(len, seqs))
    tokens, lengths = pad_left(seqs, t)
    logits = decoding.teacher_forced_logits(
        model.forward, model.config, model.params, jnp.asarray(tokens), jnp.asarray(lengths)
    )
    return [np.asarray(logits[i, t - len(s) :]) for i, s in enumerate(seqs)]


@pytest.fixture(params=list(CASES))
def case(request, checkpoint):
    name = request.param
    folder = checkpoint(CASES[name].checkpoint)
    return name, folder, _ours(folder), prompts_of(name)


def test_config_parses_as_intended(case):
    name, folder, model, _ = case
    cfg = model.config
    assert cfg.family == "phi3" and (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.layer_windows == (1024, 1024)
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm)
    hf_rope = _hf(folder).config.rope_parameters
    assert hf_rope["rope_type"] == cfg.rope.kind
    if cfg.rope.kind == "longrope":
        assert cfg.rope.short_factor == tuple(SHORT_FACTOR)
        assert cfg.rope.long_factor == tuple(LONG_FACTOR)
        assert cfg.rope.original_max_position_embeddings == ORIGINAL
        assert cfg.rope.factor == 256 / ORIGINAL
        assert cfg.rope.attention_factor == pytest.approx(
            np.sqrt(1 + np.log(256 / ORIGINAL) / np.log(ORIGINAL))
        )


def test_teacher_forced_logits_match_transformers(case):
    name, folder, model, prompts = case
    ref_tokens, ref_logits = _reference(name, folder)
    seqs = [p + g[:-1] for p, g in zip(prompts, ref_tokens, strict=True)]
    for i, ours in enumerate(_teacher_forced(model, seqs)):
        err = np.abs(ours - ref_logits[i]).max()
        assert err <= LOGITS_TOL, f"{name} row {i}: max |Δlogits| = {err:.2e}"


def test_greedy_generation_matches_transformers(case):
    name, folder, model, prompts = case
    c = CASES[name]
    kwargs = {} if c.chunk is None else {"chunk": c.chunk}
    result = dge_jax.generate(model, prompts, max_new_tokens=c.new_tokens, **kwargs)
    ref_tokens, _ = _reference(name, folder)
    for i in range(len(prompts)):
        assert result.tokens[i] == ref_tokens[i], f"{name} row {i}"


def test_long_prompts_use_the_long_factors(checkpoint):
    """longrope_long's parity is not vacuous: the same model with its long factors replaced by
    the short ones gives clearly different logits on prompts past 32 positions."""
    model = _ours(checkpoint("longrope"))
    prompts = prompts_of("longrope_long")
    assert min(map(len, prompts)) > ORIGINAL
    rope = dataclasses.replace(model.config.rope, long_factor=model.config.rope.short_factor)
    short = dataclasses.replace(model, config=dataclasses.replace(model.config, rope=rope))
    for a, b in zip(_teacher_forced(model, prompts), _teacher_forced(short, prompts), strict=True):
        assert np.abs(a - b).max() > 1e-2


def test_rope_tables_switch_at_the_original_length():
    """Short factors while the call's largest position + 1 <= original, long beyond; cos and
    sin times the attention factor (transformers' `longrope_frequency_update`)."""
    rope = RopeConfig(kind="longrope", short_factor=tuple(SHORT_FACTOR),
                      long_factor=tuple(LONG_FACTOR), original_max_position_embeddings=ORIGINAL,
                      attention_factor=1.25)  # fmt: skip
    freqs = inverse_frequencies(rope, HEAD_DIM)
    assert isinstance(freqs, LongRopeFrequencies)
    exponents = np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM
    for last, factors in ((ORIGINAL - 1, SHORT_FACTOR), (ORIGINAL, LONG_FACTOR)):
        positions = jnp.arange(last + 1)[None]
        cos, sin = rope_tables(positions, freqs)
        inv = 1.0 / (np.asarray(factors, np.float32) * 10000.0**exponents)
        angles = np.arange(last + 1)[:, None] * inv[None]
        angles = np.concatenate([angles, angles], -1)
        np.testing.assert_allclose(cos[0], 1.25 * np.cos(angles), atol=1e-5)
        np.testing.assert_allclose(sin[0], 1.25 * np.sin(angles), atol=1e-5)


def test_fused_tensors_split_into_the_llama_fields(checkpoint):
    """Each split field equals its slice of the fused tensor (transposed to [in, out])."""
    folder = checkpoint("default")
    stored = load_file(folder / "model.safetensors")
    layers = _ours(folder).params.layers
    q, kv = 4 * HEAD_DIM, 2 * HEAD_DIM
    for i in range(2):
        qkv = stored[f"model.layers.{i}.self_attn.qkv_proj.weight"]
        gate_up = stored[f"model.layers.{i}.mlp.gate_up_proj.weight"]
        assert qkv.shape == (q + 2 * kv, 64) and gate_up.shape == (2 * 96, 64)
        np.testing.assert_array_equal(layers.wq[i], qkv[:q].T)
        np.testing.assert_array_equal(layers.wk[i], qkv[q : q + kv].T)
        np.testing.assert_array_equal(layers.wv[i], qkv[q + kv :].T)
        np.testing.assert_array_equal(layers.w_gate[i], gate_up[:96].T)
        np.testing.assert_array_equal(layers.w_up[i], gate_up[96:].T)


def test_fused_tensor_of_another_width_is_refused(checkpoint, tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    source = checkpoint("default")
    (folder / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    key = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[key] = tensors[key][:-4]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"qkv_proj.* 124 wide .* implies 128 \(layers.wq 64"):
        load_hf_checkpoint(folder)
    del tensors[key]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers.wq is missing for layer\(s\) \[1\]"):
        load_hf_checkpoint(folder)


def test_a_checkpoint_saved_by_transformers_5_2_loads(checkpoint, tmp_path):
    """transformers 5.2 wrote `ignore_keys_at_rope_validation: null` into config.json (5.25
    drops it on save); such a folder loads and gives transformers' greedy tokens (transformers
    reads the same folder), and transformers' other bookkeeping keys load as without them."""
    from models.hf_config import TRANSFORMERS_BOOKKEEPING

    source = checkpoint("default")
    raw = json.loads((source / "config.json").read_text())
    assert "ignore_keys_at_rope_validation" not in raw  # 5.25 wrote it without
    extras = {"saved_by_5_2": {"ignore_keys_at_rope_validation": None},
              "bookkeeping": dict.fromkeys(TRANSFORMERS_BOOKKEEPING) | {"_commit_hash": "0" * 40}}
    folders = {}
    for name, extra in extras.items():
        folders[name] = folder = tmp_path / name
        shutil.copytree(source, folder)
        (folder / "config.json").write_text(json.dumps(raw | extra, indent=2))
        family, cfg, params = load_hf_checkpoint(folder)
        assert family.model_type == "phi3" and cfg == parse_config(raw)[1]
        np.testing.assert_array_equal(params.layers.wq, _ours(source).params.layers.wq)
    folder, c = folders["saved_by_5_2"], CASES["default"]
    ref_tokens, _ = _reference("default", folder)
    assert ref_tokens == _reference("default", source)[0]
    result = dge_jax.generate(_ours(folder), prompts_of("default"), max_new_tokens=c.new_tokens,
                              chunk=c.chunk)  # fmt: skip
    assert result.tokens == ref_tokens


def test_a_rope_parameter_transformers_is_told_not_to_validate_is_refused(checkpoint, tmp_path):
    """A non-null `ignore_keys_at_rope_validation` only silences transformers' rope checks: a
    listed unknown parameter would load unchecked there, so it is refused here by name; a
    listed required one fails in transformers (missing), so here too; other names change
    nothing, as in transformers."""
    raw = json.loads((checkpoint("longrope") / "config.json").read_text())
    listed = {"ignore_keys_at_rope_validation": ["mrope_section", "attention_factor"]}
    assert parse_config(raw | listed) == parse_config(raw)
    rope = raw["rope_parameters"] | {"mscale": 1.2}
    folder = tmp_path / "unchecked"
    shutil.copytree(checkpoint("longrope"), folder)
    edited = raw | {"rope_parameters": rope, "ignore_keys_at_rope_validation": ["mscale"]}
    (folder / "config.json").write_text(json.dumps(edited))
    assert transformers.AutoConfig.from_pretrained(folder).rope_parameters["mscale"] == 1.2
    with pytest.raises(ConfigError, match=r"unknown rope parameter\(s\) \['mscale'\] in "
                                          r"rope_parameters: config.json's ignore_keys_at_rope_"
                                          r"validation lists them, so transformers loads them "
                                          r"unchecked"):  # fmt: skip
        load_hf_checkpoint(folder)
    edited = raw | {"ignore_keys_at_rope_validation": ["long_factor"]}
    (folder / "config.json").write_text(json.dumps(edited))
    with pytest.raises(KeyError, match="Missing required keys"):
        transformers.AutoConfig.from_pretrained(folder)
    with pytest.raises(ConfigError, match=r"lists \['long_factor'\], which rope type "
                                          r"'longrope' needs; transformers then counts it as "
                                          r"missing and refuses the config"):  # fmt: skip
        load_hf_checkpoint(folder)


MESH_SCRIPT = """
import sys, numpy as np, jax
from dge_jax.checkpoints.hf import load_hf_checkpoint
from dge_jax.distribution import sharding as sh
_, _, plain = load_hf_checkpoint(sys.argv[1])
_, _, sharded = load_hf_checkpoint(sys.argv[1], mesh=sh.make_mesh(data=1, model=2))
assert len(sharded.layers.wk.sharding.device_set) == 2
for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(sharded), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
print("same")
"""


def test_sharded_loading_reads_each_devices_slice_of_the_fused_tensors(checkpoint):
    """On a (1, 2) mesh each device reads its columns of qkv_proj / gate_up_proj (offset into
    the fused tensor); the result equals the single-device load. 2 CPU devices: a subprocess."""
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                        "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT, str(checkpoint("default"))],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "same" in proc.stdout, proc.stderr[-3000:]


# --- Strict config --------------------------------------------------------------------------

PHI3_CONFIG = {
    "model_type": "phi3",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "original_max_position_embeddings": ORIGINAL,
    "rope_scaling": {"type": "longrope", "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR},
    "sliding_window": 2047,
    "rms_norm_eps": 1e-5,
}


def test_old_rope_keys_and_the_su_name_parse_alike(checkpoint):
    """rope_scaling + rope_theta (Phi-3's published spelling) and "su" (its early name) give
    the ModelConfig of transformers 5's rope_parameters."""
    raw = json.loads((checkpoint("longrope") / "config.json").read_text())
    cfg = parse_config(raw)[1]
    old = to_old_keys(raw)
    assert parse_config(old)[1] == cfg
    old["rope_scaling"]["rope_type"] = "su"
    assert parse_config(old)[1] == cfg


def test_windows_and_defaults():
    cfg = parse_config(PHI3_CONFIG)[1]
    assert cfg.layer_windows == (2047, 2047) and cfg.window(1) == 2047
    assert parse_config(PHI3_CONFIG | {"sliding_window": None})[1].layer_windows == ()
    no_original = {k: v for k, v in PHI3_CONFIG.items() if k != "original_max_position_embeddings"}
    assert parse_config(no_original)[1].rope.original_max_position_embeddings == 4096
    no_eps = {k: v for k, v in PHI3_CONFIG.items() if k != "rms_norm_eps"}
    assert parse_config(no_eps)[1].rms_norm_eps == 1e-5


@pytest.mark.parametrize(
    "change, message",
    [
        ({"partial_rotary_factor": 0.75}, r"partial_rotary_factor=0.75 is not supported"),
        ({"attention_bias": True}, r"attention_bias=true in this phi3 config"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ({"lm_head_scale": 2.0}, r"field\(s\) \['lm_head_scale'\] that this library does not"),
        ({"sliding_window": 0}, r"sliding_window=0: a window is a positive number"),
        ({"rope_scaling": {"type": "longrope", "short_factor": SHORT_FACTOR}},
         r"longrope' needs \['long_factor'\]"),
        ({"rope_scaling": {"type": "longrope", "short_factor": SHORT_FACTOR,
                           "long_factor": LONG_FACTOR, "mscale": 1.0}},
         r"unknown rope parameter\(s\) \['mscale'\]"),
        ({"rope_scaling": {"type": "longrope", "short_factor": SHORT_FACTOR,
                           "long_factor": "fast"}}, r"long_factor must be a list of numbers"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"rope type 'dynamic'.*not supp"),
    ],
)  # fmt: skip
def test_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(PHI3_CONFIG | change)


def test_factor_lists_of_the_wrong_length_are_refused(checkpoint, tmp_path):
    raw = dict(PHI3_CONFIG)
    raw["rope_scaling"] = dict(raw["rope_scaling"], long_factor=LONG_FACTOR[:-1])
    cfg = parse_config(raw)[1]
    with pytest.raises(ConfigError, match=r"long_factor has 7 entries, head_dim 16 needs 8"):
        inverse_frequencies(cfg.rope, cfg.head_dim)


def test_sliding_window_parity(checkpoint):
    """A window of 8 on 20-token prompts: transformers masks keys 8 or more positions back."""
    folder = checkpoint("window")
    model = _ours(folder)
    assert model.config.layer_windows == (8, 8)
    hf = _hf(folder)
    prompts = prompts_of("default")
    for row, ours in zip(prompts, _teacher_forced(model, prompts), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([row])).logits[0].numpy()
        assert np.abs(ours - ref).max() <= LOGITS_TOL
