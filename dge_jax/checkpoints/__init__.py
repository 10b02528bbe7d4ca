"""Every checkpoint reader in one place.

- `hf`: Hugging Face folders (config.json + safetensors), read strictly through the family's
  key table; the one-line errors for damaged folders and how to recover (`recovery`).
- `gguf`: GGUF files converted to a Hugging Face-layout folder (dequantized, q/k permutation
  undone, tokenizer rebuilt).
- `embedded`: the embedded models' names -> their cached converted folders (offline).
- `tokenizer`: a folder's tokenizer, chat template and EOS ids, and how its model is prompted
  (`prompt_format`); a damaged file gets `hf`'s error.
- `orbax_io`: converted folders (orbax-checkpoint parameters + config + tokenizer), written by
  `python -m dge_jax convert` and restored straight onto a mesh.
"""
