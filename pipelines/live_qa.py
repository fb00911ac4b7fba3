"""Interactive questions over a live stream: the server's default pipeline.

Everything the camera shows and the microphone hears goes into the session's context as
timestamped notes, and the frames themselves as the model's own frame tokens when the model
has a vision tower (SmolVLM2, LLaVA, a GGUF with --mmproj), or CLIP + projector tokens when
those are configured;
questions come from the command line (--ask, --ask-at) or from websocket clients.

    streamgrok run pipelines/live_qa.py --source demos/media/demo.mp4 --live \
        --ask-at 5s "Who is on screen?"
"""

from streamgrok.pipeline import IngestConfig, Pipeline, frame_encoders, option


def build_pipeline(options: dict) -> Pipeline:
    clip, projector = frame_encoders(options)
    return Pipeline(
        name="live_qa",
        ingest=IngestConfig(
            fps=option(options, "fps", 1.0),  # frames sampled per second
            live=option(options, "live", False),  # real-time pacing, drop oldest frames
            transcribe=option(options, "transcribe", True),
            # server configuration: base (Whisper, offline), small, medium, a local
            # faster-whisper folder, or pocketsphinx
            speech_model=option(options, "speech_model", "base"),
        ),
        clip=clip,
        projector=projector,
        # server configuration: what questions are answered over, "notes" or "stream"
        # (default: notes for a text model, see Pipeline.answer_context)
        answer_context=option(options, "answer_context", None, str),
        # server configuration: how a question's notes are chosen, "meaning" (kinds, BM25,
        # recency; says what was not observed) or "words" (shared word stems only)
        note_selection=option(options, "note_selection", "meaning", str),
    )
