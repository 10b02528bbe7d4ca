"""Text in and out: prompt requests, tokenization and padding, and the samplers."""
