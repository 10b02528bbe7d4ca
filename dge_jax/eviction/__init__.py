"""When and how a cache is evicted: the Eviction spec, timings, what is observed, head
budgets, selection, and compression while decoding."""
