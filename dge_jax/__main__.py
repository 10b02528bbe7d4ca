"""`python -m dge_jax ...`: see `dge_jax.cli`."""

from dge_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
