"""Draws docs/dge_timing.png, the README's picture of *when* each timing evicts.

    python docs/make_figure.py [OUT.png]

A schematic, not a measurement: three lanes (baseline, DGE, DGE-W) over the same prompt,
showing which queries the scoring rule observes, where eviction happens, and which answer
tokens come from the full cache. Pure matplotlib (Agg), no model, so it runs anywhere.
"""

from __future__ import annotations

import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent / "dge_timing.png"

PROMPT = 16  # prompt tokens drawn (the real ones are thousands)
WINDOW = 4  # observation window w
ANSWER = 5  # answer tokens drawn
COLORS = {
    "prompt": "#d9d9d9",
    "observed": "#3b78c2",
    "full": "#59a14f",
    "compressed": "#f28e2b",
    "evict": "#c0392b",
}
LANES = (
    # title, draft steps before eviction, draft queries observed
    ("baseline (SnapKV etc.): evict after prefill", 0, False),
    ("DGE, k = 2: draft t1, evict, scores see t1's query", 1, True),
    ("DGE-W, k = 2: same timing, scores see prompt queries only", 1, False),
)


def draw_lane(ax, y: float, title: str, draft_steps: int, observe_drafts: bool) -> None:
    """One timeline: prompt cells, then answer cells; a red line where eviction happens."""
    for i in range(PROMPT):
        kind = "observed" if i >= PROMPT - WINDOW else "prompt"
        ax.add_patch(Rectangle((i, y), 0.9, 0.8, color=COLORS[kind]))
    # Answer token j (t1, t2, ...) sits at x = PROMPT + 1 + j. t1 comes from the prefill logits
    # (full cache) in every lane; draft steps feed t1..t_k-1, so their queries exist before
    # eviction, and tokens up to t_k come from the full cache.
    x0 = PROMPT + 1
    for j in range(ANSWER):
        full = j <= draft_steps
        ax.add_patch(
            Rectangle((x0 + j, y), 0.9, 0.8, color=COLORS["full" if full else "compressed"])
        )
        ax.text(x0 + j + 0.45, y + 0.4, f"t{j + 1}", ha="center", va="center", fontsize=8)
        if j < draft_steps and observe_drafts:  # t_j's query was fed and is observed
            ax.add_patch(
                Rectangle((x0 + j, y - 0.24), 0.9, 0.17, color=COLORS["observed"], clip_on=False)
            )
    evict_x = x0 + draft_steps + 1 - 0.05
    ax.plot([evict_x, evict_x], [y - 0.25, y + 1.05], color=COLORS["evict"], lw=2.5)
    ax.text(evict_x + 0.1, y + 1.0, "evict", color=COLORS["evict"], fontsize=8, va="bottom")
    ax.text(-0.3, y + 0.4, title, ha="right", va="center", fontsize=9)


def make_figure(out: pathlib.Path = OUT) -> pathlib.Path:
    """Writes the figure to `out` (PNG, ~1000x300 px) and returns the path."""
    fig, ax = plt.subplots(figsize=(10, 3.0), dpi=100)
    for row, (title, steps, observe) in enumerate(LANES):
        draw_lane(ax, 2.0 * (len(LANES) - 1 - row), title, steps, observe)
    ax.text(PROMPT / 2, 6.35, "prompt (prefill with the full cache)", ha="center", fontsize=9)
    ax.text(PROMPT + 1 + ANSWER / 2, 6.35, "answer", ha="center", fontsize=9)
    ax.set_xlim(-0.5, PROMPT + ANSWER + 2)
    ax.set_ylim(-0.6, 6.8)
    ax.axis("off")
    ax.legend(
        handles=[
            Patch(color=COLORS["observed"], label="queries the score observes"),
            Patch(color=COLORS["full"], label="token from the full cache"),
            Patch(color=COLORS["compressed"], label="token from the compressed cache"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.02),
        ncol=3,
        frameon=False,
        fontsize=9,
    )
    fig.savefig(out, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(make_figure(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
