"""Narrates the stream: every N seconds the model describes what changed.

    streamgrok run pipelines/commentary.py --source demos/media/demo.mp4 --set every=5
"""

from streamgrok.model.sampling import SamplingParams
from streamgrok.pipeline import Every, IngestConfig, Pipeline, frame_encoders, option


def build_pipeline(options: dict) -> Pipeline:
    every = option(options, "every", 10.0)
    clip, projector = frame_encoders(options)
    return Pipeline(
        name="commentary",
        ingest=IngestConfig(fps=option(options, "fps", 1.0), live=option(options, "live", False)),
        triggers=[Every(f"Describe in one sentence what changed in the last {every:g} seconds.",
                        seconds=every, kind="commentary")],
        sampling=SamplingParams(max_tokens=option(options, "max_tokens", 40),
                                repetition_penalty=1.3),
        clip=clip,
        projector=projector,
    )
