"""``ZoomEnv``: the policy may look closer at its image before answering ("thinking with images").

A response holding ``<zoom>x0,y0,x1,y1</zoom>`` (pixel coordinates in the sample's first image, as the file holds
it: x to the right, y down, the box ``[x0, x1) x [y0, y1)``) gets that region back as the next message's image,
enlarged to the first view's pixel count (so a zoom shows the region at the resolution the whole image had); any
other response ends the episode and is the answer ``rl.reward`` scores. A call that cannot be carried out (not four
integers, an empty box, a box outside the image, a box over 200 times longer than wide, which the image processor
refuses) gets a text observation saying why, and the episode goes on.
"""

from __future__ import annotations

import re

import numpy as np

from titanrl.data.manifest import SampleRecord

_CALL = re.compile(r"<zoom>(.*?)</zoom>", re.S)
MAX_ASPECT = 200  # Qwen2-VL's image processor refuses a picture longer than this many times its width


def crop_and_enlarge(image: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    """``image[y0:y1, x0:x1]`` resized (bicubic) to about ``image``'s pixel count, its aspect ratio kept."""
    from PIL import Image

    x0, y0, x1, y1 = box
    crop = image[y0:y1, x0:x1]
    h, w = crop.shape[:2]
    scale = (image.shape[0] * image.shape[1] / (h * w)) ** 0.5
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return np.array(Image.fromarray(crop).resize(size, Image.BICUBIC))


def parse_box(text: str, width: int, height: int) -> tuple[int, int, int, int] | str:
    """The box of a call's arguments, or why it cannot be used."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 4 or not all(re.fullmatch(r"-?\d+", p) for p in parts):
        return f"a zoom takes four integers x0,y0,x1,y1; got {text.strip()!r}"
    x0, y0, x1, y1 = (int(p) for p in parts)
    if not (0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height):
        return f"the box {x0},{y0},{x1},{y1} is not inside the image (width {width}, height {height}) or is empty"
    if max(x1 - x0, y1 - y0) > MAX_ASPECT * min(x1 - x0, y1 - y0):
        return (f"the box {x0},{y0},{x1},{y1} is {x1 - x0} x {y1 - y0} pixels: one side may be at most "
                f"{MAX_ASPECT} times the other")
    return x0, y0, x1, y1


class ZoomEnv:
    """One trajectory's zoom tool over its sample's first image."""

    def __init__(self, record: SampleRecord) -> None:
        from titanrl.data.media import load_image

        images = [m for m in record.media if m.kind == "image"]
        if not images:
            raise ValueError(f"sample {record.id!r} has no image to zoom into")
        self.image = load_image(images[0].path)
        self.zooms = 0

    def step(self, response: str) -> dict:
        call = _CALL.search(response)
        if call is None:
            return {"observation": None, "images": [], "done": True}
        height, width = self.image.shape[:2]
        box = parse_box(call.group(1), width, height)
        if isinstance(box, str):
            return {"observation": box, "images": [], "done": False}
        self.zooms += 1
        return {"observation": f"zoom {self.zooms}: {box[0]},{box[1]},{box[2]},{box[3]}",
                "images": [crop_and_enlarge(self.image, box)], "done": False}


__all__ = ["ZoomEnv", "crop_and_enlarge", "parse_box"]
