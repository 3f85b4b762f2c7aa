"""One batch's layout as a picture: rows down, positions across, a colour per example, prompts
shaded.

``python -m seqjax.data --plot FILE.png`` draws the first batch the configured
strategy builds, so a reader sees what was packed together and what the loss
scores: each segment (document or example) gets its own hue, tokens with
weight 0 inside a segment (a prompt, a user turn) are drawn pale, padding white.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from seqjax.data.contract import Batch


def layout_image(batch: Batch) -> np.ndarray:
    """``[rows, width, 3]`` RGB in [0, 1]: hue per segment, pale where not scored, white on
    padding."""
    segments = np.asarray(batch["segment_ids"])
    scored = np.asarray(batch["weights"]) > 0
    # Each example of the batch gets its own number (segment ids restart at 1 in every row: coloured
    # by them, the first example of every row looked the same), and consecutive numbers far-apart
    # hues (golden-ratio steps).
    before = np.concatenate([[0], np.cumsum(segments.max(axis=1))[:-1]])
    example = np.where(segments > 0, segments + before[:, None], 0)
    value = np.where(scored, 0.8, 0.97)
    if "pair_ids" in batch:  # preference pairs: one hue per pair, its rejected sequence darker, a shared prompt grey
        pair_ids = np.asarray(batch["pair_ids"])
        per_row = (pair_ids.max(axis=1) + 1) // 2
        before = np.concatenate([[0], np.cumsum(per_row)[:-1]])
        example = np.where(pair_ids > 0, (pair_ids + 1) // 2 + before[:, None], 0)
        value = np.where(scored & (pair_ids % 2 == 0), 0.55, value)
    hue = (example * 0.618034) % 1.0
    import matplotlib.colors as colors  # (imported only when a picture is drawn)

    rgb = colors.hsv_to_rgb(np.stack([hue, np.where(scored, 0.85, 0.3) * (example > 0), value], -1))
    rgb[segments == 0] = 1.0
    return rgb


def draw_batch(batch: Batch, path: str | Path, title: str, owners: list[int] | None = None) -> None:
    """Write the layout picture of ``batch`` to ``path`` (PNG). ``owners``: the device holding each
    equal chunk of a row split over mesh.context (seqjax.model.context.chunk_owners), drawn as
    dashed bounds labelled with the device."""
    # matplotlib takes half a second to import: only the --plot flag needs it (a Figure of its own, no pyplot: no
    # global figure manager or backend for one PNG)
    from matplotlib.figure import Figure

    image = layout_image(batch)
    rows, width = image.shape[:2]
    fig = Figure(figsize=(min(16, 4 + width / 64), min(10, 1.5 + rows * 0.3)))
    ax = fig.subplots()
    ax.imshow(image, aspect="auto", interpolation="nearest")
    for j, device in enumerate(owners or ()):
        ax.axvline(j * width / len(owners) - 0.5, color="black", linestyle="--", linewidth=0.6)
        ax.text((j + 0.5) * width / len(owners) - 0.5, -0.55, f"d{device}", ha="center", fontsize=7)
    ax.set_xlabel("position in row (token)" + ("; dashed: mesh.context's chunks, dN above: the device holding it"
                                               if owners else ""))
    ax.set_ylabel("row")
    scored = float(np.asarray(batch["weights"]).astype(bool).mean())
    padding = float((np.asarray(batch["segment_ids"]) == 0).mean())
    patches = ""
    if "patch_segment_ids" in batch:  # chats with images: the second budget
        patches = f"; patches: {float((np.asarray(batch['patch_segment_ids']) > 0).mean()):.1%} of the rows' budget"
    ax.set_title(f"{title}\none colour per example; pale: not scored (prompt); white: padding "
                 f"({padding:.1%}); scored: {scored:.1%} of slots{patches}", fontsize=9, pad=12 if owners else 6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
