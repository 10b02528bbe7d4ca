"""The decode-time compression spec (`Eviction.decode`) and its checks.

Apart from `dge_jax.eviction.decode_compression` (the loop) so that `dge_jax.eviction.evict`
can hold the spec without importing the loop that imports it.
"""

from __future__ import annotations

import dataclasses

from dge_jax.rules.base import Rule, check_fields

# Head caps are rounded to this many slots: nearby budgets share a compiled loop, and a
# decode step (which reads every slot) wastes at most 15 of them.
CAP_MULTIPLE = 16


@dataclasses.dataclass(frozen=True)
class DecodeCompression:
    """Compress while decoding: every `interval` new tokens, back to `budget` per kv head.

    The rule, head-budget mode and tie rule are the `Eviction`'s that holds this spec
    (`Eviction.decode`): one rule per cell. budget counts every entry a head keeps right
    after a compression (the protected recent ones included); the cache holds at most
    `head_cap + interval` slots per head (`capacity`).
    """

    budget: int = 256
    interval: int = 32
    window_floor: int = 0

    def __post_init__(self) -> None:
        check_fields(self, ints={"budget": 1, "interval": 1, "window_floor": 0})

    def head_cap(self, spread: bool = False) -> int:
        """Most entries one head may keep: the budget rounded up to a slot bucket (so nearby
        budgets share a compilation); twice that when budgets are spread unevenly over heads
        or layers (AdaKV, global, PyramidKV: a head's share is capped here, and what the cap
        cuts off is not re-split). At least `window_floor`, rounded the same way: set by
        `grid_plan.check_cells` to a model's longest window less one where sliding layers
        keep their window, which the loop's one capacity for all layers must then hold (the
        global layers still keep the budget; the slots beyond it stay empty)."""
        cap = -(-self.budget // CAP_MULTIPLE) * CAP_MULTIPLE
        cap = 2 * cap if spread else cap
        return max(cap, -(-self.window_floor // CAP_MULTIPLE) * CAP_MULTIPLE)

    def capacity(self, spread: bool = False) -> int:
        """Slots per head of the decode loop's cache: `head_cap` + `interval`."""
        return self.head_cap(spread) + self.interval


def check_decode_rule(rule: Rule, spec: DecodeCompression, protected: int) -> None:
    """Clear errors for rules and budgets decode-time compression cannot serve."""
    if rule.needs.reconstruction is not None:
        raise ValueError(
            f"{type(rule).__name__} scores from a reconstruction pass over the prompt, which "
            "has no decode-time form; use it at prefill (no Eviction.decode) or pick another rule"
        )
    if rule.needs.recorders:
        names = [r.name for r in rule.needs.recorders]
        raise ValueError(
            f"{type(rule).__name__} reads statistics of its own recorders ({names}), which "
            "the decode-time loop does not record; use it before decoding (no Eviction.decode) "
            "or pick another rule"
        )
    # The block's own entries are protected by the attention rules (they are the observed
    # queries'), and sinks / windows by theirs: the budget must hold all of them.
    need = protected + spec.interval
    if spec.budget < need:
        raise ValueError(
            f"decode budget {spec.budget} is smaller than what a compression always keeps "
            f"({protected} window/sink entries + {spec.interval} entries of the interval = "
            f"{need}); raise the decode budget or shorten the interval"
        )
