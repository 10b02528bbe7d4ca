"""The needle-in-a-haystack figure of a `--suite niah` run: the score at every (depth, length)
of the grid for every cell, one color scale for all of them, and under them the difference of
each DGE / DGE-W cell from its rule's prefill cell at the same budget (DGE − baseline, one
diverging scale). Each square is the mean row score (the key found in the answer: 100) over
the rows of that grid cell, written on it.

    python -m experiments.heatmaps OUT_DIR [--out FILE.png]

The report draws it too (`niah_heatmap.png`) whenever a folder holds `niah` rows.
"""

from __future__ import annotations

import argparse
import pathlib
from collections import defaultdict

import numpy as np

from experiments import suites
from experiments.cells import WITH_K, cell_order, parse_cell_id
from experiments.suites.niah import DATASET, grid_cell

Grid = tuple[list[int], list[int], dict[str, np.ndarray]]  # lengths, depths, cell -> [D, L]


def grids(rows: list[dict]) -> Grid:
    """(lengths, depths, per cell the mean score in percent [depth, length]; NaN where a
    grid cell has no row) from a folder's prediction lines."""
    found: dict[str, dict[tuple[int, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        where = grid_cell(r["sample_id"]) if r["dataset"] == DATASET else None
        if where is not None:
            score = suites.row_score(DATASET, r["pred"], r["answers"], r["all_classes"])
            found[r["cell"]][where].append(100 * score)
    lengths = sorted({n for cells in found.values() for n, _ in cells})
    depths = sorted({d for cells in found.values() for _, d in cells})
    out = {}
    for cell in sorted(found, key=cell_order):
        m = np.full((len(depths), len(lengths)), np.nan)
        for (n, d), scores in found[cell].items():
            m[depths.index(d), lengths.index(n)] = np.mean(scores)
        out[cell] = m
    return lengths, depths, out


def differences(cells: dict[str, np.ndarray]) -> dict[str, tuple[str, np.ndarray]]:
    """Each drafting (or lookahead) cell's map minus its rule's prefill cell at the same
    budget, by the cell's id: (the baseline's id, the difference)."""
    out = {}
    for cell, m in cells.items():
        c = parse_cell_id(cell)
        base = f"{c.rule}/prefill/b{c.budget}"
        if c.timing in WITH_K and base in cells:
            out[cell] = (base, m - cells[base])
    return out


def _panel(ax, m: np.ndarray, lengths, depths, title: str, cmap: str, limits,
           first: bool) -> object:
    image = ax.imshow(m, cmap=cmap, vmin=limits[0], vmax=limits[1], aspect="auto",
                      origin="upper")
    for (i, j), v in np.ndenumerate(m):
        if not np.isnan(v):
            diverging = limits[0] < 0  # viridis is dark at 0, RdBu at both ends
            dark = abs(v) > 60 if diverging else v < 50
            ax.text(j, i, f"{v:+.0f}" if diverging else f"{v:.0f}", ha="center",
                    va="center", fontsize=6, color="white" if dark else "black")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
    ax.set_yticks(range(len(depths)), [f"{d} %" for d in depths] if first else [],
                  fontsize=7)
    ax.set_xlabel("prompt length (tokens)", fontsize=8)
    ax.set_title(title, fontsize=8)
    return image


def niah_heatmap(rows: list[dict], title_text: str, out_dir: pathlib.Path,
                 name: str = "niah_heatmap.png") -> pathlib.Path | None:
    """The figure (module docstring) into out_dir/name; None when no row is a `niah` row."""
    lengths, depths, cells = grids(rows)
    if not cells:
        return None
    diffs = differences(cells)
    from experiments.plots import _pyplot

    plt = _pyplot()
    cols = max(len(cells), 1)
    nrows = 2 if diffs else 1
    fig, axes = plt.subplots(nrows, cols, figsize=(2.6 * cols + 1.4, 4.0 * nrows),
                             squeeze=False, gridspec_kw={"wspace": 0.12, "hspace": 0.42})
    for i, (ax, (cell, m)) in enumerate(zip(axes[0], cells.items(), strict=False)):
        image = _panel(ax, m, lengths, depths, cell, "viridis", (0, 100), i == 0)
    fig.colorbar(image, ax=list(axes[0]), label="score (key in the answer, %)", shrink=0.8)
    axes[0][0].set_ylabel("needle depth", fontsize=8)
    for ax in axes[0][len(cells):]:
        ax.axis("off")
    if diffs:
        for i, (ax, (cell, (base, m))) in enumerate(zip(axes[1], diffs.items(), strict=False)):
            image = _panel(ax, m, lengths, depths, f"{cell}\n− {base}", "RdBu", (-100, 100),
                           i == 0)
        fig.colorbar(image, ax=list(axes[1]), label="difference (points)", shrink=0.8)
        axes[1][0].set_ylabel("needle depth", fontsize=8)
        for ax in axes[1][len(diffs):]:
            ax.axis("off")
    fig.suptitle(f"{title_text}\nneedle in a haystack: pass key at each depth and length",
                 fontsize=9)
    path = out_dir / name
    fig.savefig(path, dpi=120, bbox_inches="tight")  # colorbars span rows: no tight_layout
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    from experiments.predictions import read_folder
    from experiments.run_folder import check_lines, read_config

    parser = argparse.ArgumentParser(prog="python -m experiments.heatmaps",
                                     description="The NIAH heatmaps of a --suite niah run.")
    parser.add_argument("out_dir", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, help="the PNG to write (default: "
                        "OUT_DIR/niah_heatmap.png)")
    args = parser.parse_args(argv)
    rows = read_folder(args.out_dir)
    check_lines(rows, str(args.out_dir))
    config = read_config(args.out_dir)
    per_cell = {r["cell"]: 0 for r in rows}
    for r in rows:
        per_cell[r["cell"]] += 1
    n = sorted(set(per_cell.values()))
    title = (f"{config['identity']['model']} on {config['identity']['suite']}, "
             if config and "identity" in config else "")
    title += f"n = {'-'.join(map(str, n[:1] + n[-1:] if len(n) > 1 else n))} samples per cell"
    target = args.out or args.out_dir / "niah_heatmap.png"
    path = niah_heatmap(rows, title, target.parent, target.name)
    if path is None:
        parser.error(f"{args.out_dir} holds no niah rows: run it with --suite niah")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
