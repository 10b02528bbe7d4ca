"""What a forward pass runs on: the KV cache and its selection, RoPE, the recorders, the
platform's choices, and the prefill, draft and decode steps."""
