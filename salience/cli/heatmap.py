"""A causal-tracing grid as a PNG: one panel per hook point, layers down, positions across, each
cell shaded by the share of the clean run's metric it restores (white 0, dark blue 1), as ROME's
figures draw it. Pillow only: the client install draws it without a plotting library."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["write_heatmap"]

CELL = 22  # pixels a side
MARGIN = 8


def write_heatmap(
    path: Path, panels: dict[str, list[list[float]]], layers: Sequence[int], labels: Sequence[str], title: str
) -> None:
    """`panels[point][i][j]`: the restored share at layers[i], position j (labelled labels[j])."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    label_width = max(int(font.getlength(text)) for text in labels) + MARGIN
    row_label = int(font.getlength(str(max(layers)))) + MARGIN
    panel_width = row_label + CELL * len(labels)
    height = 2 * MARGIN + 32 + CELL * len(layers) + label_width
    width = MARGIN + len(panels) * (panel_width + 2 * MARGIN)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((MARGIN, MARGIN), title, fill="black", font=font)
    for k, (point, grid) in enumerate(panels.items()):
        left = MARGIN + k * (panel_width + 2 * MARGIN)
        top = MARGIN + 32
        draw.text((left + row_label, top - 12), point, fill="black", font=font)
        for i, layer in enumerate(layers):
            y = top + i * CELL
            draw.text((left, y + CELL // 4), str(layer), fill="black", font=font)
            for j, share in enumerate(grid[i]):
                x = left + row_label + j * CELL
                draw.rectangle([x, y, x + CELL - 1, y + CELL - 1], fill=_shade(share), outline=(230, 230, 230))
        for j, text in enumerate(labels):  # the tokens, written downwards under their columns
            strip = Image.new("RGB", (label_width, CELL), "white")
            ImageDraw.Draw(strip).text((2, CELL // 4), text, fill="black", font=font)
            image.paste(strip.rotate(90, expand=True), (left + row_label + j * CELL, top + len(layers) * CELL + 2))
    image.save(path)


def _shade(share: float) -> tuple[int, int, int]:
    t = min(max(share, 0.0), 1.0)
    return (round(255 - 225 * t), round(255 - 185 * t), round(255 - 75 * t))
