"""The XLA cost model: compiled programs read, counted and compared (TPU without a TPU, CPU)."""
