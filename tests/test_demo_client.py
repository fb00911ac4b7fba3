"""demos/live_analysis.py against a real server: an ordinary MP4 (index at the end) is
remuxed and streamed; two concurrent answers print whole, never interleaved."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import av
import pytest

from streamgrok.cache.config import CacheConfig
from streamgrok.media.samples import Scene, write_clip
from streamgrok.server.app import ServerConfig, StreamgrokServer

ROOT = Path(__file__).resolve().parent.parent


def plain_mp4(source: Path, path: Path) -> Path:
    """The clip with its index (moov) at the end, as cameras and editors write MP4s."""
    with av.open(str(source)) as s, av.open(str(path), "w") as t:
        streams = {st.index: t.add_stream_from_template(st) for st in s.streams
                   if st.type in ("video", "audio")}
        for packet in s.demux(*[st for st in s.streams if st.index in streams]):
            if packet.dts is not None:
                packet.stream = streams[packet.stream.index]
                t.mux(packet)
    data = path.read_bytes()
    assert data.find(b"moov") > data.find(b"mdat")
    return path


@pytest.fixture
async def server(tiny_loaded):
    config = ServerConfig("pipelines/live_qa.py", port=0, load_tick_s=None,
                          pipeline_options={"transcribe": "false"}, max_media_per_second=50)
    srv = StreamgrokServer(tiny_loaded, config, CacheConfig(budget_tokens=512,
                                                            memory_gib=0.05))
    await srv.start()
    yield srv
    await srv.stop()


async def test_an_ordinary_mp4_streams_and_concurrent_answers_do_not_interleave(server,
                                                                                tmp_path):
    clip = write_clip(tmp_path / "clip.mp4", [Scene("astronaut", 2.0), Scene("coffee", 2.0)])
    video = plain_mp4(clip, tmp_path / "plain.mp4")
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "demos" / "live_analysis.py"), str(video),
        "--port", str(server.port), "--ask-at", "3.5", "Who is on screen?",
        "--ask-at", "3.5", "What colour is it?", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd=ROOT)
    out, err = await asyncio.wait_for(process.communicate(), 240)
    text = out.decode()
    assert process.returncode == 0, err.decode()
    answers = [line for line in text.splitlines() if line.startswith("  > ")]
    assert sorted(a.split()[1] for a in answers) == ["q1", "q2"]  # one line each, whole
    assert "(q1:" in text and "(q2:" in text


def test_the_remux_keeps_every_frame_and_puts_the_index_first(tmp_path):
    sys.path.insert(0, str(ROOT / "demos"))
    try:
        from live_analysis import fragmented_mp4
    finally:
        sys.path.remove(str(ROOT / "demos"))
    import io

    clip = write_clip(tmp_path / "clip.mp4", [Scene("astronaut", 2.0)])
    video = plain_mp4(clip, tmp_path / "plain.mp4")
    data, seconds = fragmented_mp4(str(video))
    assert data.find(b"moov") < data.find(b"moof") < data.find(b"mdat")
    assert seconds == pytest.approx(2.0, abs=0.35)  # the audio may run a frame past
    with av.open(str(video)) as original, av.open(io.BytesIO(data)) as remuxed:
        assert sum(1 for _ in remuxed.decode(video=0)) == sum(
            1 for _ in original.decode(video=0)) > 0
    with av.open(io.BytesIO(data[:4096])) as head:  # a prefix already holds the streams
        assert {s.type for s in head.streams} == {"video", "audio"}
    with pytest.raises(SystemExit, match="cannot read"):
        fragmented_mp4(str(tmp_path / "missing.mp4"))
