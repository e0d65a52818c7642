"""Draw the block masks of docs/flex.md's catalogue into docs/img/flex_catalogue.png.

    .venv/bin/python scripts/flex_catalogue.py [T] [BLOCK]

Each panel is ``create_block_mask(mask_mod, None, None, T, T, BLOCK_SIZE=BLOCK)``
of one catalogue mask, drawn as its tiles: skipped (never visited), partial
(mask_mod applied per entry) and full (no mask read). The mods are the ones
docs/flex.md shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap

from flashtile.torch.flex import block_states, create_block_mask


def catalogue(T: int) -> dict:
    docs = torch.arange(T) // (T // 4) if T >= 4 else torch.zeros(T, dtype=torch.long)
    prefix, window, dilation = T // 4, T // 4, 3

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    def document(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    def dilated(b, h, q_idx, kv_idx):
        near = (q_idx >= kv_idx) & (q_idx - kv_idx <= 2 * window)
        return near & ((q_idx - kv_idx) % dilation == 0)

    return {
        "causal": causal,
        f"sliding window {window}": sliding_window,
        f"prefix LM ({prefix} keys)": prefix_lm,
        "4 documents, causal": document,
        "dilated window (every 3rd key)": dilated,
    }


def main(T: int = 256, block: int = 16) -> Path:
    masks = catalogue(T)
    fig, axes = plt.subplots(1, len(masks), figsize=(3 * len(masks), 3.3))
    colours = ListedColormap(["#f2f2f2", "#f4a261", "#2a9d8f"])
    for ax, (name, mask_mod) in zip(axes, masks.items(), strict=True):
        states = block_states(create_block_mask(mask_mod, None, None, T, T, BLOCK_SIZE=block))
        ax.imshow(states[0, 0], cmap=colours, vmin=0, vmax=2, interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("key tile")
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0].set_ylabel("query tile")
    fig.suptitle(
        f"T={T}, {block}x{block} tiles: grey skipped, orange partial (mask_mod per entry), "
        f"green full",
        fontsize=9,
    )
    fig.tight_layout()
    path = Path(__file__).resolve().parent.parent / "docs" / "img" / "flex_catalogue.png"
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    print(main(*(int(a) for a in sys.argv[1:3])))
