"""The timing harness: compile events, peak memory, per-stage timers, jit cache sizes.

How dge_jax is timed. Scenario (a) calls the public API (`dge_jax.generate`, one call per
method) with a stage hook that times its jitted steps (`decoding.prefill_prompt`,
`draft_tokens`, `rewind_state`, `decode_loop`, `eviction.keep_masks`, `eviction.apply_eviction`,
...) and blocks on each result (`StageTimer`), so one call gives both its wall time and where it
went. Each call is the first at its shapes, so it compiles: JAX reports every trace, lowering
and XLA compile (`jax.monitoring`), and every time is net of the compilation reported inside it,
which is itself reported (compile seconds and XLA compilations per call). The headline ratios
use warm repeats of the three calls at 4k tokens, timed whole; the grid runs cold, then warm.
(b) compiles every step ahead of time, as `benchmarks.eviction_decode` does, and reuses its
pieces. Best-of-N is used for the machine limits and (b)'s short steps, single runs for the long
ones.

The timers see the library's jitted steps through `dge_jax.generation`'s stage hook
(`hook(stage, fn, *args, **kwargs)`): nothing in the library is patched.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np

from benchmarks.peers.peers import RssSampler
from dge_jax.eviction.evict import select_for_budgets
from dge_jax.runtime import decoding as gen

COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
BACKEND_COMPILE = COMPILE_EVENTS[2]
_START = time.perf_counter()


def log(message: str) -> None:
    """Progress on stdout, with the minutes since the module was imported."""
    print(f"{(time.perf_counter() - _START) / 60:5.1f} min  {message}", flush=True)


class CompileLog:
    """JAX's compile events (tracing, lowering, XLA compilation) as they happen."""

    _instance: CompileLog | None = None

    def __init__(self):
        self.events: list[tuple[str, float]] = []
        jax.monitoring.register_event_duration_secs_listener(self._record)

    @classmethod
    def get(cls) -> CompileLog:
        """The process's one log (a listener cannot be unregistered, so register it once)."""
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _record(self, event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS:
            self.events.append((event, duration))

    def mark(self) -> int:
        return len(self.events)

    def since(self, mark: int) -> tuple[float, int]:
        """(seconds spent compiling, XLA compilations) since `mark`."""
        events = self.events[mark:]
        return sum(d for _, d in events), sum(e == BACKEND_COMPILE for e, _ in events)


class Memory:
    """Peak memory of a region: process RSS on CPU; on GPU the device's peak bytes in use
    (`memory_stats`, a process-wide high-water mark that cannot be reset)."""

    def __init__(self):
        self.device = jax.devices()[0]
        self.on_gpu = self.device.platform == "gpu"
        self.rss = None if self.on_gpu else RssSampler()
        self.kind = "device peak bytes in use" if self.on_gpu else "process peak RSS"

    def mark(self) -> None:
        if self.rss is not None:
            self.rss.mark()

    def peak(self) -> int:
        if self.rss is not None:
            return self.rss.peak_since_mark()
        stats = self.device.memory_stats() or {}
        return int(stats.get("peak_bytes_in_use", 0))


@dataclasses.dataclass
class Call:
    """One measured API call: wall time, compile cost, the stage records, peak memory."""

    wall_s: float
    compile_s: float
    compilations: int
    records: list[dict]
    t0: float
    peak_mem: int


class StageTimer:
    """Times the jitted steps of one `generate` / `generate_grid` call, blocking on each
    result: `measure(call)` passes `hook` to the call (`dge_jax.generation.STAGES`)."""

    def __init__(self, compiles: CompileLog, memory: Memory):
        self.compiles, self.memory = compiles, memory
        self.records: list[dict] = []
        self._call_mark = 0

    def hook(self, name: str, fn: Callable, *args, **kwargs):
        """Runs fn(*args, **kwargs) as stage `name` of the call, recording its time."""
        info: dict = {}
        if name == "decode":  # decode(forward, cfg, params, state, ...): state is donated
            state = args[3]
            info = {
                "start_step": np.asarray(state.step),  # [B] (a scalar before per-row k)
                "cache_bytes": state.cache.nbytes(),
                "rows": int(state.tokens.shape[0]),
            }
        mark = self.compiles.mark()
        self.memory.mark()
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        end = time.perf_counter()
        compile_s, count = self.compiles.since(mark)
        if name == "prefill":
            info["cache_bytes"] = out.cache.nbytes()
        elif name == "apply_eviction":
            info["cache_bytes"] = out.nbytes()
            # What one capacity for all layers (the largest) would hold: k, v and pos all
            # scale with the slots.
            caps = out.capacities
            info["one_capacity_bytes"] = out.nbytes() * len(caps) * max(caps) // sum(caps)
        elif name == "decode":
            # The loop runs until the slowest row is done: its steps are the loop's.
            info["steps"] = int(np.max(np.asarray(out.step) - info.pop("start_step")))
        self.records.append(
            {
                "stage": name,
                "wall_s": end - start,
                "compile_s": compile_s,
                "compilations": count,
                "peak_mem": self.memory.peak(),
                "t_end": end,
                # compile seconds of the whole call so far (for a time to first token
                # net of compilation)
                "compile_at_end": self.compiles.since(self._call_mark)[0],
                **info,
            }
        )
        return out

    def measure(self, call: Callable[[Callable], object]) -> tuple[object, Call]:
        """Runs call(hook), the hook timing each stage; returns its result and the `Call`."""
        self.records = []
        mark = self._call_mark = self.compiles.mark()
        self.memory.mark()
        start = time.perf_counter()
        out = call(self.hook)
        wall = time.perf_counter() - start
        compile_s, count = self.compiles.since(mark)
        peak = max([self.memory.peak()] + [r["peak_mem"] for r in self.records])
        return out, Call(wall, compile_s, count, list(self.records), start, peak)


def jit_cache_sizes() -> dict[str, int]:
    """Compiled variants held by each of the library's jitted steps so far."""
    from dge_jax.eviction import evict as eviction

    fns = {
        "prefill": gen.prefill_prompt,
        "draft": gen.draft_tokens,
        "decode": gen.decode_loop,
        "select_for_budgets": select_for_budgets,
        "compact": eviction.compact,
    }
    return {name: fn._cache_size() for name, fn in fns.items()}


def compiled(compiles: CompileLog, fn, *args, **statics) -> tuple[Callable, float, int]:
    """fn.lower(*args, **statics).compile(), with its compile seconds and XLA compile count."""
    mark = compiles.mark()
    exe = fn.lower(*args, **statics).compile()
    seconds, count = compiles.since(mark)
    return exe, seconds, count


class CompileCost:
    """Compiles steps ahead of time (`compiled`), adding up their compile seconds and count."""

    def __init__(self, compiles: CompileLog):
        self.compiles = compiles
        self.seconds, self.count = 0.0, 0

    def compile(self, fn, *args, **statics) -> Callable:
        exe, seconds, count = compiled(self.compiles, fn, *args, **statics)
        self.seconds, self.count = self.seconds + seconds, self.count + count
        return exe
