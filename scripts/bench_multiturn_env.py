"""The environment of ``scripts/bench_multiturn.py``: a tool whose calls the benchmark scripts, since the random
policy makes none. A sample's trajectories call it 0, 1 or 2 times (by the sample's id), each call returning a crop
of the sample's picture whose size also depends on the sample (16, 36 or 64 image tokens at the tiny processor's
patch size): trajectories then differ in turns, images and length, as a policy that zooms makes them."""

from __future__ import annotations

import zlib

from titanrl.data.manifest import SampleRecord


class ToolEnv:
    def __init__(self, record: SampleRecord) -> None:
        from titanrl.data.media import load_image

        self.image = load_image(record.media[0].path)
        h = zlib.crc32(record.id.encode())
        self.calls = h % 3
        self.side = (112, 168, 224)[(h // 3) % 3]
        self.turn = 0

    def step(self, response: str) -> dict:
        self.turn += 1
        if self.turn > self.calls:
            return {"observation": None, "images": [], "done": True}
        x = (self.turn * 97) % (self.image.shape[1] - self.side)
        crop = self.image[:self.side, x:x + self.side].copy()
        return {"observation": f"crop {self.turn}", "images": [crop], "done": False}
