"""Generate test and demo clips with PyAV: scenes from real photos shipped in scikit-image,
moving shapes, and spoken audio from espeak-ng when it is installed (a tone otherwise).

`python -m streamgrok.media.samples OUT.mp4` writes the demo clip.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import cv2
import numpy as np

FORMATS = {  # suffix -> (video codec, audio codec)
    ".mp4": ("libx264", "aac"),
    ".webm": ("libvpx-vp9", "libopus"),
    ".mkv": ("libx264", "aac"),
}


@dataclass
class Scene:
    """`seconds` of one photo (or a plain background). Optional events: a square of
    `mover_colour` crossing in `mover_direction`, a spoken sentence starting at
    `speech_at`, a caption in large letters, and a person (the astronaut's head and
    shoulders) in view from `person_from` to `person_until` seconds into the scene."""

    photo: str | None
    seconds: float
    moving_square: bool = False
    speech: str | None = None
    speech_at: float = 0.3
    mover_colour: tuple[int, int, int] = (220, 40, 40)
    mover_direction: str = "left to right"
    caption: str | None = None
    person_from: float | None = None
    person_until: float | None = None
    voice: str = "en"
    speed: int = 150


DEMO_SCENES = [
    Scene("astronaut", 4.0, speech="Hello. This is a live video test."),
    Scene("coffee", 3.0),
    Scene(None, 3.0, moving_square=True),
    Scene("chelsea", 4.0, speech="A cat is resting on the table."),
]


def photo(name: str | None, width: int, height: int) -> np.ndarray:
    """A scikit-image sample photo fitted into the frame without distortion, centred on a
    dark grey background (the background alone for None)."""
    canvas = np.full((height, width, 3), 90, dtype=np.uint8)
    if name is None:
        return canvas
    import skimage.data

    image = getattr(skimage.data, name)()
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    h, w = image.shape[:2]
    scale = min(width / w, height / h)
    fitted = cv2.resize(image[..., :3], (round(w * scale), round(h * scale)),
                        interpolation=cv2.INTER_AREA)
    top, left = (height - fitted.shape[0]) // 2, (width - fitted.shape[1]) // 2
    canvas[top : top + fitted.shape[0], left : left + fitted.shape[1]] = fitted
    return canvas


def speak(text: str, rate: int = 16_000, voice: str = "en",
          speed: int = 150) -> np.ndarray | None:
    """Mono float32 speech from espeak-ng (`voice` as espeak-ng names them, e.g. en-us,
    en+f3; `speed` in words a minute), or None when espeak-ng is not installed."""
    binary = shutil.which("espeak-ng")
    if binary is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run([binary, "-v", voice, "-s", str(speed), "-w", str(path), text],
                       check=True, capture_output=True)
        with wave.open(str(path)) as wav:
            pcm = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
            source_rate = wav.getframerate()
    samples = pcm.astype(np.float32) / 32768.0
    positions = np.arange(0, len(samples), source_rate / rate)
    return np.interp(positions, np.arange(len(samples)), samples).astype(np.float32)


def scene_audio(scene: Scene, rate: int) -> np.ndarray:
    total = int(scene.seconds * rate)
    audio = np.zeros(total, dtype=np.float32)
    if scene.speech:
        voice = speak(scene.speech, rate, scene.voice, scene.speed)
        if voice is None:  # a 440 Hz tone stands in for speech
            t = np.arange(int(1.5 * rate)) / rate
            voice = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
        start = int(scene.speech_at * rate)
        voice = voice[: total - start]
        audio[start : start + len(voice)] = voice
    return audio


def write_clip(
    path: str | Path,
    scenes: list[Scene] | None = None,
    width: int = 320,
    height: int = 240,
    fps: int = 10,
    audio_rate: int = 16_000,
    with_audio: bool = True,
) -> Path:
    """Write an H.264/AAC .mp4, VP9/Opus .webm or H.264/AAC .mkv clip; returns its path."""
    path = Path(path)
    scenes = scenes or DEMO_SCENES
    video_codec, audio_codec = FORMATS[path.suffix]
    options = {"movflags": "frag_keyframe+empty_moov"} if path.suffix == ".mp4" else {}
    with av.open(str(path), "w", options=options) as container:
        vstream = container.add_stream(video_codec, rate=fps)
        vstream.width, vstream.height, vstream.pix_fmt = width, height, "yuv420p"
        vstream.options = {"crf": "32"} if video_codec == "libx264" else {"crf": "40", "b": "0"}
        astream = None
        if with_audio:
            out_rate = 48_000 if audio_codec == "libopus" else audio_rate
            astream = container.add_stream(audio_codec, rate=out_rate, layout="mono")
        index = 0
        audio = []
        for scene in scenes:
            base = photo(scene.photo, width, height)
            if scene.caption:
                draw_caption(base, scene.caption)
            person = person_image(height) if scene.person_from is not None else None
            for i in range(int(scene.seconds * fps)):
                frame = draw_events(base.copy(), scene, i, fps, person)
                video_frame = av.VideoFrame.from_ndarray(frame, format="rgb24")
                video_frame.pts = index
                video_frame.time_base = Fraction(1, fps)
                for packet in vstream.encode(video_frame):
                    container.mux(packet)
                index += 1
            if astream is not None:
                audio.append(scene_audio(scene, audio_rate))
        for packet in vstream.encode(None):
            container.mux(packet)
        if astream is not None:
            _encode_audio(container, astream, np.concatenate(audio), audio_rate)
    return path


def draw_events(frame: np.ndarray, scene: Scene, i: int, fps: int,
                person: np.ndarray | None = None) -> np.ndarray:
    """Frame `i` of the scene with its moving square and person drawn in (`person`: the
    scene's `person_image`, made here when not given)."""
    height, width = frame.shape[:2]
    t = i / fps
    if scene.person_from is not None and \
            scene.person_from <= t < (scene.person_until or scene.seconds):
        if person is None:
            person = person_image(height)
        ph, pw = person.shape[:2]
        left = width - pw - width // 16
        frame[height - ph :, left : left + pw] = person
    if scene.moving_square:
        side = max(16, height // 6)
        progress = i / max(1, scene.seconds * fps - 1)
        x = int((width - side) * progress)
        y = height // 2 - side // 2
        if scene.mover_direction == "right to left":
            x = width - side - x
        elif scene.mover_direction in ("downwards", "upwards"):
            x, y = width // 2 - side // 2, int((height - side) * progress)
            if scene.mover_direction == "upwards":
                y = height - side - y
        frame[y : y + side, x : x + side] = scene.mover_colour
    return frame


def person_image(frame_height: int) -> np.ndarray:
    """The astronaut's head and shoulders from scikit-image, 2/3 of the frame tall."""
    import skimage.data

    height = frame_height * 2 // 3
    crop = skimage.data.astronaut()[0:300, 90:330]
    width = round(crop.shape[1] * height / crop.shape[0])
    return cv2.resize(crop, (width, height), interpolation=cv2.INTER_AREA)


def draw_caption(frame: np.ndarray, text: str) -> None:
    """Large white letters on a dark band across the top of the frame."""
    height, width = frame.shape[:2]
    scale = width / 320 * 0.9
    (w, h), _ = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, scale, 2)
    scale *= min(1.0, (width - 20) / w)
    (w, h), _ = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, scale, 2)
    frame[: h + 24] = (30, 30, 30)
    cv2.putText(frame, text, ((width - w) // 2, h + 12), cv2.FONT_HERSHEY_SIMPLEX, scale,
                (255, 255, 255), 2, cv2.LINE_AA)


def _encode_audio(container, stream, samples: np.ndarray, rate: int) -> None:
    resampler = av.AudioResampler(format=stream.format.name, layout="mono", rate=stream.rate)
    chunk = 1024
    for start in range(0, len(samples), chunk):
        block = samples[start : start + chunk].reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(block, format="flt", layout="mono")
        frame.sample_rate = rate
        frame.pts = start
        frame.time_base = Fraction(1, rate)
        for out in resampler.resample(frame):
            for packet in stream.encode(out):
                container.mux(packet)
    for out in resampler.resample(None):
        for packet in stream.encode(out):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", help="output .mp4, .webm or .mkv")
    parser.add_argument("--width", type=int, default=320)
    parser.add_argument("--height", type=int, default=240)
    parser.add_argument("--fps", type=int, default=10)
    args = parser.parse_args()
    path = write_clip(args.out, width=args.width, height=args.height, fps=args.fps)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
