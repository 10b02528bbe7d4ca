"""FullKV decode speed on a short prompt, where prefill is small: a check on
`benchmarks.shape_speed`'s decode figure, which subtracts two calls that are mostly prefill.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.decode_rate [--runs 5] [--label NAME]

Runs at any commit that has `dge_jax.generate(model, prompts, max_new_tokens=...,
min_new_tokens=...)`: run it in two checkouts, alternating, to compare them. Prints the median
seconds of a 2-token and a 66-token FullKV `generate` (256-token prompt, EOS banned, warm) and
64 divided by their difference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import dge_jax

PROMPT = list(range(100, 356))  # 256 token ids
SHORT, LONG = 2, 66


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="warm repeats (median)")
    parser.add_argument("--label", default="", help="a name printed with the figures")
    args = parser.parse_args()
    model = dge_jax.load("smollm2-135m-instruct")

    def call(n: int) -> None:
        dge_jax.generate(model, [PROMPT], max_new_tokens=n, min_new_tokens=n)

    for n in (SHORT, LONG):
        call(n)  # compile
    seconds: dict[int, list[float]] = {SHORT: [], LONG: []}
    for _ in range(args.runs):
        for n in (SHORT, LONG):
            start = time.perf_counter()
            call(n)
            seconds[n].append(time.perf_counter() - start)
    short, long = (statistics.median(seconds[n]) for n in (SHORT, LONG))
    rate = (LONG - SHORT) / (long - short)
    print(f"{args.label} {SHORT} tokens {short:.3f} s, {LONG} tokens {long:.3f} s, "
          f"decode {rate:.2f} tok/s".strip())


if __name__ == "__main__":
    main()
