"""The text around each frame's image tokens, as each model family's processor writes it."""

from __future__ import annotations

from dataclasses import dataclass

from streamgrok.errors import ModelLoadError

FAKE_IMAGE = "<fake_token_around_image>"
GLOBAL_IMAGE = "<global-img>"


def clock(seconds: float) -> str:
    """MM:SS as SmolVLM's video prompt writes a frame's time."""
    whole = int(max(0.0, seconds))
    return f"{whole // 60:02d}:{whole % 60:02d}"


@dataclass(frozen=True)
class FrameFraming:
    """`idefics3`: SmolVLM2's video frame, "\\nFrame from MM:SS:" then
    <fake_token_around_image><global-img>, the image tokens, <fake_token_around_image>.
    `llava`: the time line, then the image tokens and a newline (LLaVA's processor only
    expands <image>; the time line tells a stream's frames apart)."""

    family: str

    def before(self, pts: float) -> str:
        head = f"\nFrame from {clock(pts)}:"
        return head + FAKE_IMAGE + GLOBAL_IMAGE if self.family == "idefics3" else head + "\n"

    def before_image(self) -> str:
        """A still image in a chat turn (SmolVLM's single-image prompt, no time line)."""
        return FAKE_IMAGE + GLOBAL_IMAGE if self.family == "idefics3" else ""

    def after(self) -> str:
        return FAKE_IMAGE if self.family == "idefics3" else "\n"

    def check_vocabulary(self, token_to_id) -> None:
        """The special tokens the framing needs are in the tokenizer (one id each)."""
        if self.family != "idefics3":
            return
        missing = [t for t in (FAKE_IMAGE, GLOBAL_IMAGE) if token_to_id(t) is None]
        if missing:
            raise ModelLoadError(f"the tokenizer lacks the image framing tokens {missing}: "
                                 "is this the vision-language model's own tokenizer?")
