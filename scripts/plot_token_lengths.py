"""Token-length distributions of the synthetic mixtures, from sample specs (sizes only, no pixels).

    python scripts/plot_token_lengths.py [--num-samples 4000] [--out docs/token_lengths.png]

Sequence length per sample = vision tokens (titanrl.data.vision, with each scale's pixel limits and
video sampling) + text tokens, where text tokens are approximated by the prompt's word count (the
placeholders excluded); the one-word answer and the chat template are left out. Prints a Markdown
table of the distribution per scale and mixture, for docs/data.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from titanrl.data import synth, vision
from titanrl.data.media import num_frames_to_sample

SOURCE_COLOURS = {"geo3k": "#4c72b0", "nextqa": "#dd8452", "longvila": "#55a868"}


def sample_tokens(spec: synth.SampleSpec, scale: str) -> tuple[int, int]:
    """(vision tokens, approximate text tokens) of one sample under the scale's preprocessing."""
    limits = vision.PIXEL_LIMITS_BY_SCALE[scale]
    text = len(spec.prompt.replace("<image>", " ").replace("<video>", " ").split())
    if spec.kind == "image":
        tokens = vision.vision_tokens_for_image(
            spec.height, spec.width, min_pixels=limits.image_min_pixels, max_pixels=limits.image_max_pixels
        )
        return tokens, text
    sampling = synth.VIDEO_SAMPLING_BY_SCALE[scale]
    frames = num_frames_to_sample(spec.num_frames, spec.fps, fps=sampling.fps, max_frames=sampling.max_frames)
    tokens = vision.vision_tokens_for_video(
        frames, spec.height, spec.width, min_pixels=limits.video_min_pixels, max_pixels=limits.video_max_pixels
    )
    return tokens, text


def lengths_by_source(mixture: str, num_samples: int, scale: str) -> dict[str, np.ndarray]:
    totals: dict[str, list[int]] = {source: [] for source in synth.MIXTURES[mixture]}
    for spec in synth.sample_specs(mixture, num_samples, seed=0, scale=scale):
        vision_tokens, text_tokens = sample_tokens(spec, scale)
        totals[spec.source].append(vision_tokens + text_tokens)
    return {source: np.array(values, dtype=np.int64) for source, values in totals.items() if values}


def summary_row(scale: str, mixture: str, lengths: np.ndarray) -> str:
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return (
        f"| {scale} | {mixture} | {lengths.min()} | {p50:.0f} | {p90:.0f} | {p99:.0f} | {lengths.max()} "
        f"| {lengths.mean():.0f} | {lengths.max() / p50:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=4000)
    parser.add_argument("--out", type=Path, default=Path("docs/token_lengths.png"))
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    mixtures = list(synth.MIXTURES)
    figure, axes = plt.subplots(len(synth.SCALES), len(mixtures), figsize=(15, 7.5))
    print("| scale | mixture | min | p50 | p90 | p99 | max | mean | max/p50 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row, scale in enumerate(synth.SCALES):
        per_mixture = {m: lengths_by_source(m, args.num_samples, scale) for m in mixtures}
        everything = np.concatenate([v for d in per_mixture.values() for v in d.values()])
        bins = np.geomspace(max(1, everything.min() * 0.9), everything.max() * 1.1, 50)
        for column, mixture in enumerate(mixtures):
            axis = axes[row, column]
            by_source = per_mixture[mixture]
            labels = [f"{s} ({len(v)})" for s, v in by_source.items()]
            axis.hist(
                list(by_source.values()),
                bins=bins,
                stacked=True,
                label=labels,
                color=[SOURCE_COLOURS[s] for s in by_source],
            )
            axis.set_xscale("log")
            axis.set_yscale("log")
            # Plain-number ticks between the decades: the tiny panels span barely two decades.
            subs = (1.0, 2.0, 5.0) if scale == "tiny" else (1.0, 3.0)
            axis.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
            axis.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k" if x >= 1000 else f"{x:g}"))
            axis.xaxis.set_minor_formatter(NullFormatter())
            lengths = np.concatenate(list(by_source.values()))
            p50 = np.median(lengths)
            axis.axvline(p50, color="black", linestyle="--", linewidth=1)
            axis.set_title(f"{scale}: {mixture}  (p50 {p50:.0f}, max {lengths.max()})", fontsize=10)
            axis.set_xlabel("tokens per sample (vision + text words)")
            if column == 0:
                axis.set_ylabel("samples (log)")
            axis.legend(fontsize=8)
            print(summary_row(scale, mixture, lengths))
    figure.suptitle(
        f"Synthetic mixtures: sequence length per sample ({args.num_samples} samples per mixture, seed 0)"
    )
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
