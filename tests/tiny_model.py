"""A tiny random Llama checkpoint folder with a working byte-level BPE tokenizer, built in code.

`tests/conftest.py`'s `llama_chat` checkpoint has a 128-word WordLevel vocabulary (everything
else is <unk>) and 256 positions: too short for LongBench prompts cut to 512 tokens, and the
synthetic suite needs a tokenizer that encodes any text. This one is built offline:

- tokenizer.json: `tokenizers.ByteLevelBPETokenizer` trained on the LongBench and synthetic
  prompt templates (so template words are a few tokens each; anything else falls back to
  bytes), plus the ChatML special tokens; EOS is <|endoftext|>.
- tokenizer_config.json: a ChatML chat template and the eos token.
- config.json + model.safetensors: `transformers.LlamaForCausalLM` (hidden 32, 2 layers,
  4 query / 2 kv heads, 4096 positions, vocab = the tokenizer's) with seeded random weights.

Everything is deterministic in `seed`, and the folder builds in about a second.
"""

from __future__ import annotations

import json
import pathlib

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BPE_VOCAB = 600
MAX_POSITIONS = 4096
SENTENCES = (
    "The quick brown fox jumps over the lazy dog. What is the answer to the question?",
    "Dialogue: Summary: Question: Type: Answer: Passage: Paragraph: Abstract: Code:",
    "Please read the following text and answer the question below in a few words.",
    "There is an important pass key hidden inside a lot of irrelevant text.",
    "One of the special magic numbers for the key is: 1234567. The pass key is 98765.",
)


def training_corpus() -> list[str]:
    """Prompt templates of both suites plus a few plain sentences: the BPE training text."""
    from experiments.suites import synthetic
    from experiments.suites.longbench_config import DATASET2PROMPT

    texts = list(SENTENCES) + list(DATASET2PROMPT.values())
    texts += [t.template + t.answer_prefix for t in synthetic.TASKS.values()]
    return texts


def write_tokenizer(folder: pathlib.Path) -> int:
    """Writes tokenizer.json + tokenizer_config.json into `folder`; returns the vocab size."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    # Training is deterministic for a fixed corpus; it runs single-threaded on tiny text.
    tok.train_from_iterator(
        training_corpus(), vocab_size=BPE_VOCAB, min_frequency=1,
        special_tokens=SPECIAL_TOKENS, show_progress=False,
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    return tok.get_vocab_size(with_added_tokens=True)


def build_tiny_llama(folder: str | pathlib.Path, seed: int = 0, **config) -> pathlib.Path:
    """Builds the tokenizer and a seeded random tiny Llama into `folder` and returns it;
    config: LlamaConfig fields over the tiny defaults (another model's layer shape)."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    folder = pathlib.Path(folder)
    vocab = write_tokenizer(folder)
    eos_id = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(EOS_TOKEN)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{
        **dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=MAX_POSITIONS, initializer_range=0.1, bos_token_id=None,
               eos_token_id=eos_id, pad_token_id=eos_id),
        **config,
    })
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return folder


if __name__ == "__main__":  # python tests/tiny_model.py OUT_FOLDER
    import sys

    print(build_tiny_llama(sys.argv[1]))


def jax_config(**overrides):
    """The tiny Llama the rule tests share, as a config (GQA 4/2, hidden 64, head 16, 2
    layers, vocab 128); overrides make a config no other test compiled."""
    from dge_jax.config import ModelConfig

    base = dict(
        family="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
    )  # fmt: skip
    return ModelConfig(**(base | overrides))


def jax_model(cfg=None, seed: int = 0, scale: float = 0.3, tokenizer=None):
    """A `dge_jax.Model` of `jax_config()` (or cfg) with seeded random weights built in JAX
    (no checkpoint folder): N(0, scale²) weights spread the logits, away from ties."""
    import jax

    from dge_jax.families import get_family
    from dge_jax.model import Model
    from models.llama_like import init_params

    cfg = cfg or jax_config()
    params = init_params(cfg, jax.random.PRNGKey(seed), scale=scale)
    return Model(get_family("llama"), cfg, params, tokenizer=tokenizer)
