"""What a forward pass runs on: the KV cache, attention, RoPE, the prefill, draft and decode
steps, prompts, sampling, the tokenizer and the device mesh."""
