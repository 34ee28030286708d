"""Image prompts in verl's multimodal parquet layout (docs/vision.md).

A row's ``images`` column (``data.image_key``) holds a list of images, each ``{"bytes": ..., "path": ...}``
(as verl's geo3k preprocessing writes them), raw bytes, or a path (absolute, relative to the working
directory, or relative to the parquet file's directory). A prompt message's ``<image>`` marks where
each image goes, in order; a row with more images than markers gets the rest before its first
user message's text, as verl does.

The model's processor renders the chat template and expands each image to its tokens; the
rotary positions are the model's own ``get_rope_index`` (``models/vision.py``).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"


class ImageDecodeError(ValueError):
    """One image of a row does not decode; the data set skips the row and says which."""


def _image_source(entry: Any, base_dir: Path) -> Any:
    """Bytes or a file path for one image entry of a row."""
    if isinstance(entry, Mapping):
        if entry.get("bytes") is not None:
            return io.BytesIO(entry["bytes"])
        entry = entry.get("path") or entry.get("image")
    if isinstance(entry, (bytes, bytearray)):
        return io.BytesIO(entry)
    if isinstance(entry, str):
        path = Path(entry).expanduser()
        if not path.is_absolute() and not path.exists():
            path = base_dir / path
        return path
    raise ImageDecodeError(f"an image entry must be bytes, a path or {{'bytes', 'path'}}, got {type(entry).__name__}")


def decode_image(entry: Any, base_dir: Path):
    """One RGB ``PIL.Image``, fully decoded (a truncated file fails here, not mid-run)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(_image_source(entry, base_dir)) as img:
            img.load()
            return img.convert("RGB")
    except UnidentifiedImageError as err:
        raise ImageDecodeError("not an image file Pillow can read") from err
    except (OSError, ValueError, SyntaxError) as err:
        raise ImageDecodeError(str(err)) from err


def row_images(value: Any, base_dir: Path) -> list:
    """All images of a row's image column (None or an empty list: a text-only row)."""
    if value is None:
        return []
    entries = value.tolist() if isinstance(value, np.ndarray) else list(value) if isinstance(value, (list, tuple)) else [value]
    images = []
    for k, entry in enumerate(entries):
        try:
            images.append(decode_image(entry, base_dir))
        except ImageDecodeError as err:
            raise ImageDecodeError(f"image {k}: {err}") from err
    return images


def vision_messages(messages: list[dict], n_images: int) -> list[dict]:
    """Messages whose ``<image>`` markers become content parts ``{"type": "image"}`` / ``{"type": "text"}``
    (the form Qwen2-VL's chat template reads), in order; images without a marker go first in the first
    user message."""
    markers = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if markers > n_images:
        raise ValueError(f"{markers} {IMAGE_PLACEHOLDER} markers in the prompt but {n_images} images in the row")
    out, extra = [], n_images - markers
    for message in messages:
        parts: list[dict] = []
        if extra and message["role"] == "user":
            parts += [{"type": "image"}] * extra
            extra = 0
        for i, text in enumerate(message["content"].split(IMAGE_PLACEHOLDER)):
            if i:
                parts.append({"type": "image"})
            if text:
                parts.append({"type": "text", "text": text})
        out.append({"role": message["role"], "content": parts})
    return out


def image_token_counts(processor: Any, images: list) -> list[int]:
    """Tokens each image becomes in the prompt (patches / merge²), from the image processor's own resize rule."""
    ip = processor.image_processor
    merge = ip.merge_size ** 2
    return [ip.get_number_of_image_patches(img.height, img.width, {}) // merge for img in images]


def process_prompt(processor: Any, text: str, images: list) -> dict[str, torch.Tensor]:
    """The processor's own output for one rendered prompt: ``input_ids``, ``mm_token_type_ids`` (T,),
    and the pixel inputs ``pixel_values`` / ``image_grid_thw`` when there are images."""
    out = processor(text=[text], images=images or None, return_tensors="pt")
    result = {"input_ids": out["input_ids"][0], "mm_token_type_ids": out["mm_token_type_ids"][0]}
    for key in ("pixel_values", "image_grid_thw"):
        if key in out:
            result[key] = out[key]
    return result
