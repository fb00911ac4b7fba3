"""Media ingest on clips the tests generate: decode, push, sample, dedup, observe, channels."""

from __future__ import annotations

import asyncio
import shutil
import threading

import cv2
import numpy as np
import pytest
import torch

from streamgrok.channel import Channel
from streamgrok.media.colours import dominant_colours
from streamgrok.media.decode import ByteFeed, decode_container, decode_image, pcm16_chunk
from streamgrok.media.interleave import Interleaver
from streamgrok.media.items import AudioChunk, MediaError, Note, VideoFrame
from streamgrok.media.native_worker import Detections
from streamgrok.media.observers import FrameObserver
from streamgrok.media.projector import Projector
from streamgrok.media.samples import Scene, photo, write_clip
from streamgrok.media.sampling import PixelDedup, RateSampler
from streamgrok.pipeline.ingest import Ingest, IngestConfig

SHORT = [Scene("astronaut", 1.5, speech="Hello there, this is a test."),
         Scene("coffee", 1.0), Scene(None, 1.0, moving_square=True)]


@pytest.fixture(scope="module", params=[".mp4", ".webm"])
def clip(request, tmp_path_factory):
    return write_clip(tmp_path_factory.mktemp("clips") / f"clip{request.param}", SHORT)


def frames_of(items):
    return [i for i in items if isinstance(i, VideoFrame)]


def test_decode_generated_containers(clip):
    items = list(decode_container(str(clip)))
    frames = frames_of(items)
    audio = [i for i in items if isinstance(i, AudioChunk)]
    assert len(frames) == 35 and frames[0].image.shape == (240, 320, 3)
    pts = [f.pts for f in frames]
    assert pts == sorted(pts) and pts[-1] - pts[0] == pytest.approx(3.4, abs=0.05)
    assert sum(a.duration for a in audio) == pytest.approx(3.5, abs=0.1)
    assert all(a.rate == 16_000 for a in audio)
    assert not [i for i in items if isinstance(i, MediaError)]


def test_pushed_chunks_decode_like_the_file(clip):
    reference = frames_of(decode_container(str(clip), audio=False))
    data = clip.read_bytes()
    feed = ByteFeed()

    def push():
        for start in range(0, len(data), 4096):  # as a MediaRecorder would send it
            feed.feed(data[start : start + 4096])
        feed.close_feed()

    pusher = threading.Thread(target=push)
    pusher.start()
    pushed = frames_of(decode_container(feed, audio=False))
    pusher.join()
    assert len(pushed) == len(reference)
    assert all(np.array_equal(a.image, b.image) for a, b in zip(pushed, reference))
    assert [f.pts for f in pushed] == [f.pts for f in reference]


def test_jpeg_png_frames_and_pcm():
    image = photo("astronaut", 160, 120)
    for ext in (".jpg", ".png"):
        ok, encoded = cv2.imencode(ext, cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
        frame = decode_image(encoded.tobytes(), pts=1.5, index=3)
        assert frame.image.shape == (120, 160, 3) and frame.pts == 1.5
        assert np.abs(frame.image.astype(int) - image).mean() < 6
    with pytest.raises(ValueError, match="not a decodable JPEG/PNG"):
        decode_image(b"\xff\xd8garbage", 0, 0)
    chunk = pcm16_chunk((np.array([0, 16384, -32768], dtype="<i2")).tobytes(), pts=2.0)
    assert chunk.samples.tolist() == [0.0, 0.5, -1.0]
    with pytest.raises(ValueError, match="even number"):
        pcm16_chunk(b"\x00\x01\x02", 0)
    with pytest.raises(ValueError, match="16000 Hz"):
        pcm16_chunk(b"\x00\x00", 0, rate=44_100)


def test_rate_sampler_keeps_target_rate():
    sampler = RateSampler(2.0)
    kept = [t / 30 for t in range(300) if sampler.keep(VideoFrame(np.zeros((1, 1, 3)), t / 30, t))]
    assert len(kept) == 20 and all(b - a >= 0.5 - 1e-6 for a, b in zip(kept, kept[1:]))


def test_pixel_dedup_drops_static_frames_and_keeps_cuts():
    dedup = PixelDedup()
    still = photo("coffee", 320, 240)
    noisy = [np.clip(still.astype(int) + np.random.randint(-2, 3, still.shape), 0, 255)
             .astype(np.uint8) for _ in range(20)]
    kept = [dedup.keep(VideoFrame(im, i, i)) for i, im in enumerate(noisy)]
    assert kept[0] and sum(kept) == 1  # 19 near-identical frames dropped
    cut = VideoFrame(photo("astronaut", 320, 240), 21, 21)
    assert dedup.keep(cut) and cut.scene_cut
    moved = photo("astronaut", 320, 240).copy()
    moved[100:140, 100:140] = (220, 40, 40)
    assert dedup.keep(VideoFrame(moved, 22, 22))  # a small object appearing is kept


def test_observer_finds_the_astronauts_face():
    observer = FrameObserver()
    note = observer.observe(VideoFrame(photo("astronaut", 512, 512), 12.0, 0))
    assert note is not None and "1 face appeared" in note.text and "face" in note.tags
    assert note.stamped().startswith("[00:12]")
    assert observer.observe(VideoFrame(photo("astronaut", 512, 512), 13.0, 1)) is None
    assert dominant_colours(np.full((8, 8, 3), (40, 80, 200), np.uint8), 1) == ["blue"]


@pytest.mark.skipif(shutil.which("espeak-ng") is None,
                    reason="espeak-ng is not installed (make test installs it with apt-get)")
def test_vad_finds_the_speech_segment(tmp_path):
    from streamgrok.media.audio import AudioObserver

    path = write_clip(tmp_path / "speech.mp4",
                      [Scene(None, 1.0), Scene(None, 3.0, speech="Good morning, how are you?")])
    observer = AudioObserver(transcriber=None)
    notes = []
    for item in decode_container(str(path), video=False):
        notes += observer.feed(item)
    notes += observer.flush()
    assert len(notes) == 1
    assert 1.0 <= notes[0].pts <= 1.7 and "speech" in notes[0].tags


async def test_ingest_orders_items_and_reports_errors(clip):
    ingest = Ingest(IngestConfig(fps=2, transcribe=False))
    items = [item async for item in ingest.run(str(clip))]
    pts = [i.pts for i in items if i.pts is not None]
    assert pts == sorted(pts)
    assert any(isinstance(i, Note) and "face" in i.text for i in items)
    assert ingest.stats.sampled_frames == 7 and ingest.stats.pixel_dropped >= 2


async def test_truncated_and_corrupt_media_give_errors_not_crashes(clip, tmp_path):
    data = clip.read_bytes()
    truncated = tmp_path / f"cut{clip.suffix}"
    truncated.write_bytes(data[: len(data) // 2])
    ingest = Ingest(IngestConfig(fps=2, transcribe=False, audio=False))
    items = [i async for i in ingest.run(str(truncated))]
    assert any(isinstance(i, Note) for i in items)  # what was decodable still came through
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 20)
    items = [i async for i in Ingest(IngestConfig(audio=False)).run(str(garbage))]
    assert items and all(isinstance(i, MediaError) for i in items)
    assert "cannot open media" in items[0].message or "error" in items[0].message


async def test_drop_oldest_channel_bounds_memory_under_slow_consumer():
    channel: Channel[int] = Channel(4, "drop_oldest", "frames")
    received = []

    async def slow():
        async for item in channel:
            received.append(item)
            await asyncio.sleep(0.002)

    consumer = asyncio.create_task(slow())
    for i in range(200):
        await channel.put(i)
        assert len(channel) <= 4
        await asyncio.sleep(0)
    channel.close()
    await consumer
    assert channel.stats.dropped > 100
    assert channel.stats.dropped + len(received) == 200
    assert received == sorted(received) and received[-1] == 199


async def test_block_channel_loses_nothing():
    channel: Channel[int] = Channel(2, "block")

    async def produce():
        for i in range(50):
            await channel.put(i)
        channel.close()

    producer = asyncio.create_task(produce())
    assert [i async for i in channel] == list(range(50))
    await producer
    assert channel.stats.dropped == 0 and channel.stats.high_water <= 2


def test_interleaver_waits_for_the_slowest_input():
    merger = Interleaver(["video", "audio"])
    merger.push("video", 2.0, "v2")
    merger.push("video", 3.0, "v3")
    assert merger.ready() == []  # audio may still send something earlier
    merger.push("audio", 1.0, "a1")
    merger.advance("audio", 2.5)
    assert merger.ready() == ["a1", "v2"]
    merger.close("audio")
    assert merger.ready() == ["v3"]


def test_projector_round_trip_and_mismatch(tmp_path):
    from streamgrok.errors import ModelLoadError

    projector = Projector(512, 64, tokens=3)
    path = tmp_path / "projector.safetensors"
    projector.save(path)
    loaded = Projector.load(path, hidden=64)
    x = torch.randn(2, 512)
    assert loaded(x).shape == (2, 3, 64)
    torch.testing.assert_close(loaded(x), projector(x))
    with pytest.raises(ModelLoadError, match="needs 576"):
        Projector.load(path, hidden=576)
    with pytest.raises(ModelLoadError, match="not found"):
        Projector.load(tmp_path / "missing.safetensors")


def test_interleaver_does_not_wait_forever_for_a_silent_input():
    merger = Interleaver(["video", "audio"], max_delay=2.0)
    merger.push("video", 0.5, "note")
    assert merger.ready() == []
    merger.push("video", 3.0, "later")  # audio never spoke: after 2 s of lateness, go on
    assert merger.ready() == ["note"]


def test_probe_source_names_what_is_wrong_before_any_model_loads(tmp_path, clip):
    from streamgrok.cli import main
    from streamgrok.media.decode import SourceError, probe_source

    assert "video" in probe_source(str(clip))
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    text = tmp_path / "notes.mp4"
    text.write_text("this is not a video\n" * 50)
    truncated = tmp_path / "truncated.mp4"
    truncated.write_bytes(clip.read_bytes()[:200])
    cases = [(tmp_path / "missing.mp4", "not found"), (empty, "is empty"),
             (tmp_path, "not a regular file"), (text, "cannot open"),
             (truncated, "holds no video or audio stream|cannot open")]
    for path, fragment in cases:
        with pytest.raises(SourceError, match=fragment):
            probe_source(str(path))
    # the command line fails fast with a clear message and a non-zero exit
    assert main(["run", "pipelines/live_qa.py", "--source", str(empty), "--ask", "hi"]) == 2


def test_costly_detectors_run_on_cuts_motion_and_refresh_only():
    from streamgrok.media.observers import DetectionSchedule

    schedule = DetectionSchedule(min_interval_s=2.0, max_interval_s=10.0, motion=0.05)
    assert schedule.due(0.0, None, 0.0, False)  # never ran
    assert not schedule.due(1.0, 0.0, 0.5, False)  # motion, but within the minimum interval
    assert schedule.due(2.5, 0.0, 0.5, False)  # motion after it
    assert not schedule.due(9.0, 0.0, 0.01, False)  # still picture
    assert schedule.due(10.0, 0.0, 0.01, False)  # refresh
    assert schedule.due(0.5, 0.0, 0.0, True)  # a scene cut always
    schedule.stretch = 4.0  # the server under load
    assert not schedule.due(5.0, 0.0, 0.5, False) and schedule.due(8.0, 0.0, 0.5, False)
    assert not schedule.due(39.0, 0.0, 0.0, False) and schedule.due(40.0, 0.0, 0.0, False)


class CountingDetectors:
    def __init__(self) -> None:
        self.calls = 0

    def detect(self, image, faces, people, cats=False):
        self.calls += 1
        return Detections(faces=1)

    def read_text(self, image):
        return ""


def test_observer_reuses_the_last_counts_between_detections():
    detectors = CountingDetectors()
    observer = FrameObserver(detectors)
    still = photo("coffee", 320, 240)
    notes = [observer.observe(VideoFrame(still, float(t), t)) for t in range(12)]
    assert detectors.calls == 2  # t=0 and the 10 s refresh
    assert observer.stats.frames == 12 and observer.stats.skipped == 10
    assert "1 face appeared (1 in view)" in notes[0].text and notes[0].state_key is None
    assert all(note is None for note in notes[1:])  # nothing changed: no more notes


async def test_a_live_frame_past_its_freshness_bound_is_dropped_before_any_work():
    import time

    from streamgrok.media.items import Watermark
    from streamgrok.pipeline.ingest import IngestStats
    from streamgrok.pipeline.ingest_stages import ObserveFrames
    from streamgrok.pipeline.stage import run_chain

    detectors = CountingDetectors()
    stats = IngestStats()
    stage = ObserveFrames(FrameObserver(detectors), stats, max_age_s=1.0)
    old = VideoFrame(photo("coffee", 320, 240), 0.0, 0, arrived=time.monotonic() - 5.0)
    fresh = VideoFrame(photo("coffee", 320, 240), 1.0, 1)
    out, _ = await run_chain([stage], [old, fresh])
    assert isinstance(out[0], Watermark) and out[0].pts == 0.0
    assert stats.stale_dropped == 1 and detectors.calls == 1
    assert out[-1] is fresh


async def test_degradation_thins_live_sampling():
    from streamgrok.pipeline.degradation import Degradation
    from streamgrok.pipeline.ingest import IngestStats
    from streamgrok.pipeline.ingest_stages import SampleFrames
    from streamgrok.pipeline.stage import run_chain

    level = Degradation()
    stage = SampleFrames(2.0, IngestStats(), level)
    image = np.zeros((32, 32, 3), np.uint8)
    frames = [VideoFrame(image, t / 10, t) for t in range(100)]  # 10 s at 10 fps
    out, _ = await run_chain([stage], frames[:50])
    assert sum(isinstance(i, VideoFrame) for i in out) == 10  # 2 fps
    level.fps_scale = 0.25
    out, _ = await run_chain([stage], frames[50:])
    assert sum(isinstance(i, VideoFrame) for i in out) == 3  # 0.5 fps: every 2 s of 5 s


@pytest.mark.skipif(shutil.which("espeak-ng") is None,
                    reason="espeak-ng is not installed (make test installs it with apt-get)")
def test_vad_finds_the_same_speech_whatever_the_chunk_sizes(tmp_path):
    from streamgrok.media.audio import SpeechDetector, SpeechModel

    path = write_clip(tmp_path / "speech.mp4",
                      [Scene(None, 1.0), Scene(None, 3.0, speech="Turn left at the gate."),
                       Scene(None, 1.0)])
    samples = np.concatenate([c.samples for c in decode_container(str(path), video=False)])
    model = SpeechModel()

    def segments(chunk: int) -> list[tuple[float, float]]:
        detector = SpeechDetector(model)
        found = []
        for start in range(0, samples.shape[0], chunk):
            found += detector.feed(AudioChunk(samples[start : start + chunk], start / 16000))
        found += detector.flush()
        return [(round(s.start, 3), round(s.end, 3)) for s in found]

    whole = segments(samples.shape[0])
    assert len(whole) == 1 and 0.9 <= whole[0][0] <= 1.7
    assert segments(16000) == whole and segments(777) == whole


def test_the_voice_activity_model_leaves_torch_threads_alone(tmp_path):
    """silero-vad's package sets torch's threads to 1 when imported; the server loads the
    voice-activity model before its engine steps, which must keep every configured core."""
    from helpers import run_script

    script = tmp_path / "vad_threads.py"
    script.write_text(
        "import sys, torch\n"
        "torch.set_num_threads(3)\n"
        "from streamgrok.media.audio import SpeechModel\n"
        "SpeechModel()\n"
        "print(torch.get_num_threads(), 'silero_vad.model' in sys.modules)\n")
    assert run_script(script, {}).stdout.split() == ["3", "False"]
