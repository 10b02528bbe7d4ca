"""Side by side with transformers and kvpress: the peers' worker, its client, agreement checks."""
