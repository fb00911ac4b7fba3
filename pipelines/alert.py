"""Watches for a condition and asks the model to describe it, emitting an alert event.

Conditions come from the offline observers' note tags: "person" (HOG people detector),
"face" (Haar face detector), "speech" (voice activity), "cut" (scene cut), "motion".
A custom stage shows how to add your own logic between ingest and the session.

    streamgrok run pipelines/alert.py --source demos/media/demo.mp4 --set watch=face,speech
"""

from streamgrok.media.items import Note
from streamgrok.model.sampling import SamplingParams
from streamgrok.pipeline import ClientOption, Edge, IngestConfig, OnNote, Pipeline, Stage, option


class LoudCuts(Stage):
    """Example stage: marks scene cuts so the alert can say so. Items it does not return
    pass through unchanged (returning None), so forgetting a return never drops data."""

    name = "loud-cuts"
    edge = Edge(capacity=32, policy="block")

    async def process(self, item):
        if isinstance(item, Note) and "cut" in item.tags:
            item.text = item.text.replace("scene cut", "SCENE CUT")
        return None


def build_pipeline(options: dict) -> Pipeline:
    watch = set(option(options, "watch", "person,face,speech,cut").split(","))
    return Pipeline(
        name="alert",
        ingest=IngestConfig(fps=option(options, "fps", 2.0), live=option(options, "live", False)),
        stages=[LoudCuts()],
        triggers=[OnNote(
            "At {time} the camera noted: {note}. In one short sentence, what just happened?",
            tags=watch, cooldown=option(options, "cooldown", 5.0),
        )],
        sampling=SamplingParams(max_tokens=option(options, "max_tokens", 32),
                                repetition_penalty=1.3),
        client_options={  # what a websocket client may set in session.start
            "fps": ClientOption(float, 0, 30, exclusive_minimum=True),
            "watch": ClientOption(str, max_length=64),
            "cooldown": ClientOption(float, 0, 3600),
        },
    )
