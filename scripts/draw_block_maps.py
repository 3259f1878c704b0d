"""Draw the block maps that docs/attention.md shows, with the library's own BlockMask.plot.

8,192 queries and keys at tiled's default tiles: causal, a 512-key sliding window, and 8
packed documents of 1,024 tokens. ``python scripts/draw_block_maps.py [--out docs/images]``.
"""

import argparse
from pathlib import Path

import torch

from octlm.attention import block_mask
from octlm.attention.block_masks import causal_mod, document_mod, sliding_window_mod

LENGTH = 8192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    documents = torch.repeat_interleave(torch.arange(8), LENGTH // 8).unsqueeze(0)  # (1, T)
    maps = {
        "causal": (causal_mod(LENGTH, LENGTH), "causal"),
        "window": (sliding_window_mod(LENGTH, LENGTH, 512), "causal, window 512"),
        "documents": (document_mod(documents, LENGTH), "causal, 8 documents of 1,024"),
    }
    for name, (pattern, title) in maps.items():
        mask = block_mask(pattern, 1, 1, LENGTH, LENGTH)
        path = out / f"block-map-{name}.png"
        mask.plot(title=f"{title}: {LENGTH:,} tokens").savefig(path, dpi=90)
        print(path, mask.counts())


if __name__ == "__main__":
    main()
