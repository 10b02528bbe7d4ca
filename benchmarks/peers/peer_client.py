"""The peers' worker seen from the benchmark: one subprocess in the peers' venv.

`benchmarks/peers/peers.py --serve` runs transformers and kvpress in the peers' virtual
environment (`bash benchmarks/peers/setup_peers.sh`: benchmarks/.peers/venv), after every
dge_jax measurement, never concurrently;
`peer_row` turns one of its results into a row of the figure tables.
"""

from __future__ import annotations

import json
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent
PEERS_PYTHON = ROOT.parent / ".peers" / "venv" / "bin" / "python"  # benchmarks/.peers/venv
SETUP_COMMAND = "bash benchmarks/peers/setup_peers.sh"


class Peers:
    """The peers' worker: `benchmarks/peers/peers.py --serve` in the peers' venv, one for the run.

    `run(jobs)` sends jobs as JSON lines and waits for each result, so a configuration's peer
    runs follow its dge_jax runs within minutes, under the same machine load, and the two
    processes never compute at the same time.
    """

    def __init__(self, python: pathlib.Path = PEERS_PYTHON):
        cmd = [str(python), str(ROOT / "peers.py"), "--serve"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)  # fmt: skip
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"{' '.join(cmd)} exited with {self.proc.wait()}")
        self.versions = json.loads(hello)["versions"]
        self.results: dict[str, dict] = {}

    @classmethod
    def start(cls, use: bool) -> tuple[Peers | None, str]:
        """(the worker, "") or (None, why there is none)."""
        if not use:
            return None, "--no-peers"
        if not PEERS_PYTHON.exists():
            return None, f"{PEERS_PYTHON} is missing; run `{SETUP_COMMAND}`"
        return cls(), ""

    def run(self, jobs: list[dict]) -> None:
        for job in jobs:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the peers' worker died on job {job['id']}")
            self.results[job["id"]] = json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def peer_row(
    result: dict, scenario: str, method: str, tokens: int, batch: int, budget: int | None
) -> dict:
    rows = batch
    return {
        "scenario": scenario,
        "system": result["system"],
        "method": method,
        "prompt_tokens": tokens,
        "batch": batch,
        "budget": budget,
        "prefill_s": result["prefill_s"],
        "prefill_tok_s": rows * tokens / result["prefill_s"],
        "ttft_s": result["ttft_s"],
        "draft_s": None,
        "evict_s": result["evict_s"],
        "decode_s": result["decode_s"],
        "decode_steps": result["decode_steps"],
        "decode_tok_s": rows * result["decode_steps"] / result["decode_s"],
        "e2e_s": result["e2e_s"],
        "peak_mem": result["peak_rss"],
        "cache_bytes": result["cache_bytes"],
        "compile_s": None,
        "compilations": None,
    }
