"""`python -m benchmarks media`: decode rate, CLIP rate, dedup ratios, per-frame observer cost
(each detector, and every frame vs the adaptive schedule), speech recognisers' word error
rate and real-time factor (Whisper base vs pocketsphinx), end-to-end ingest rate.

CLIP speed does not depend on the weights, so without configured weights this benchmark uses
random ones and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import cv2
import torch

from benchmarks.speech import speech_bench
from streamgrok.cli.options import DEFAULTS
from streamgrok.media.clip import ClipEncoder, ClipWeightsMissing
from streamgrok.media.decode import decode_container
from streamgrok.media.items import VideoFrame
from streamgrok.media.native_worker import Detectors
from streamgrok.media.observers import DetectionSchedule, FrameObserver
from streamgrok.media.projector import Projector
from streamgrok.media.samples import DEMO_SCENES, Scene, write_clip
from streamgrok.media.sampling import PixelDedup, RateSampler
from streamgrok.pipeline.ingest import Ingest, IngestConfig

STATIC = [Scene("coffee", 20.0)]
BUSY = [Scene(name, 2.0, moving_square=True) for name in
        ("astronaut", "coffee", "chelsea", None, "camera")] * 2


def run_media_bench(clip_weights: str | None = None, fps: float = 2.0,
                    parts: str = "all", out: str = "bench-results") -> dict:
    """`parts`: all, or vision (only the vision towers' throughput)."""
    print(f"threads {torch.get_num_threads()}")
    results = {}
    if parts == "vision":
        return run_vision_part(clip_weights, out)
    with tempfile.TemporaryDirectory() as tmp:
        demo = write_clip(Path(tmp) / "demo.mp4", DEMO_SCENES * 3, width=640, height=360,
                          fps=25)
        static = write_clip(Path(tmp) / "static.mp4", STATIC, fps=25, with_audio=False)
        busy = write_clip(Path(tmp) / "busy.mp4", BUSY, fps=25, with_audio=False)

        started = time.perf_counter()
        frames = sum(1 for i in decode_container(str(demo), audio=False)
                     if isinstance(i, VideoFrame))
        decode_s = time.perf_counter() - started
        results["decode_fps"] = frames / decode_s
        print(f"decode     640x360 H.264: {results['decode_fps']:8.0f} frames/s "
              f"({frames} frames)")

        for name, path in (("static", static), ("busy", busy)):
            sampler, dedup = RateSampler(fps), PixelDedup()
            for item in decode_container(str(path), audio=False):
                if isinstance(item, VideoFrame) and sampler.keep(item):
                    dedup.keep(item)
            ratio = dedup.stats.dropped / max(1, dedup.stats.seen)
            results[f"dedup_{name}"] = ratio
            print(f"dedup      {name:<6} clip at {fps:g} fps: {dedup.stats.seen} sampled, "
                  f"{dedup.stats.dropped} dropped ({ratio:.0%}), {dedup.stats.cuts} cuts")

        encoder, label = clip_baseline(clip_weights)
        images = [f.image for f in decode_container(str(demo), audio=False)
                  if isinstance(f, VideoFrame)][:32]
        from benchmarks.vision import time_batches, vision_bench

        rates = {batch: time_batches(encoder.encode, images, batch, 32) for batch in (1, 16)}
        for batch, rate in rates.items():
            results[f"clip_b{batch}_fps"] = rate
            print(f"CLIP       {label} batch {batch:>2}: {rate:6.1f} frames/s")
        results.update(vision_bench(images, rates, out))  # open_clip's rates: the baseline
        results.update(observer_costs(images, busy))
        results.update(speech_bench())

        projector = Projector(encoder.dim, 576, tokens=1)
        for with_clip in (False, True):
            ingest = Ingest(IngestConfig(fps=fps, transcribe=True),
                            encoder if with_clip else None, projector if with_clip else None)
            started = time.perf_counter()

            async def drain(ingest=ingest) -> int:
                return sum([1 async for _ in ingest.run(str(demo))])

            items = asyncio.run(drain())
            wall = time.perf_counter() - started
            stream_s = ingest.stats.stream_time
            realtime = stream_s / wall
            name = "observers+audio" + ("+CLIP" if with_clip else "")
            results[f"ingest_{name}"] = realtime
            print(f"ingest     {name:<20} {ingest.stats.sampled_frames / wall:6.1f} sampled "
                  f"frames/s, {items} items, {stream_s:.0f} s of stream in {wall:.1f} s = "
                  f"{realtime:.1f}x real time -> ~{int(realtime)} live {fps:g}-fps streams")
    return results


def run_vision_part(clip_weights: str | None, out: str) -> dict:
    """The vision towers alone, on decoded demo frames."""
    from benchmarks.vision import time_batches, vision_bench

    with tempfile.TemporaryDirectory() as tmp:
        demo = write_clip(Path(tmp) / "demo.mp4", DEMO_SCENES, width=640, height=360, fps=25)
        images = [f.image for f in decode_container(str(demo), audio=False)
                  if isinstance(f, VideoFrame)][:32]
    encoder = clip_baseline(clip_weights)[0]
    rates = {batch: time_batches(encoder.encode, images, batch, count)
             for batch, count in ((1, 4), (16, 16))}
    return vision_bench(images, rates, out)


def clip_baseline(clip_weights: str | None) -> tuple[ClipEncoder, str]:
    try:
        return ClipEncoder("ViT-B-32", pretrained=clip_weights), "ViT-B-32"
    except ClipWeightsMissing:
        return (ClipEncoder("ViT-B-32", allow_random=True),
                "ViT-B-32 (random weights: no CLIP weights configured)")


def observer_costs(images: list, busy_clip: Path, repeats: int = 5) -> dict:
    """Per-frame cost of each observer part on one core, and what the adaptive detection
    schedule makes of it on a busy clip (cuts and a moving square every frame)."""
    detectors = Detectors()
    image = images[0]
    results = {}

    def per_frame(fn) -> float:
        fn()
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - started) / repeats

    small = cv2.resize(image, (320, 240))
    for name, frame in (("320x240", small), ("640x360", image)):
        faces = per_frame(lambda f=frame: detectors.detect(f, True, False))
        people = per_frame(lambda f=frame: detectors.detect(f, False, True))
        results[f"haar_{name}_ms"], results[f"hog_{name}_ms"] = faces * 1e3, people * 1e3
        print(f"observer   {name} frame: Haar faces {faces * 1e3:6.1f} ms, HOG people "
              f"{people * 1e3:6.1f} ms per frame (one core)")
    for label, schedule in (("every frame", DetectionSchedule(0.0, 0.0)),
                            ("adaptive", DetectionSchedule())):
        observer = FrameObserver(detectors, schedule=schedule)
        sampler = RateSampler(1.0)
        for item in decode_container(str(busy_clip), audio=False):
            if isinstance(item, VideoFrame) and sampler.keep(item):
                observer.observe(item)
        stats = observer.stats
        cost = (stats.detect_seconds + stats.other_seconds) / max(1, stats.frames)
        results[f"observer_{label}_ms"] = cost * 1e3
        print(f"observer   {label:<11} on the busy clip at 1 fps: detectors ran on "
              f"{stats.detections}/{stats.frames} frames, {cost * 1e3:6.1f} ms per frame "
              f"({stats.other_seconds / max(1, stats.frames) * 1e3:.1f} ms of it motion, "
              "colours and resizing)")
    return results


def register(benches: argparse._SubParsersAction) -> None:
    """Add `media` and its arguments to the `python -m benchmarks` commands."""
    media = benches.add_parser("media", formatter_class=DEFAULTS,
                               help="decode, CLIP, dedup and ingest rates")
    media.add_argument("--clip-weights", default=None, help="open_clip checkpoint file")
    media.add_argument("--fps", type=float, default=2.0, help="sampling rate")
    media.add_argument("--threads", type=int, default=None, help="torch threads")
    media.add_argument("--parts", default="all", choices=("all", "vision"),
                       help="all, or only the vision towers' throughput")
    media.add_argument("--out", default="bench-results", help="folder for the plot")
    media.set_defaults(run=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the bench with the parsed command-line arguments."""
    from streamgrok.runtime import configure_threads

    configure_threads(args.threads)
    run_media_bench(args.clip_weights, args.fps, args.parts, args.out)
    return 0
