"""The attention kernels (XLA, Pallas flash prefill and decode) and the per-layer dispatch."""
