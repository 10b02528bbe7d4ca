"""Speed, memory and compile benchmarks, run from a checkout (`python -m benchmarks.run`)."""
