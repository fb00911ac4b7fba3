"""Frame tokens from a vision-language model's own vision tower and connector (SmolVLM2 /
Idefics3, LLaVA, llama.cpp `mmproj` files), loaded without `transformers`."""

from streamgrok.vision.config import ConnectorConfig, PreprocessConfig, VisionConfig
from streamgrok.vision.encoder import VisionEncoder

__all__ = ["ConnectorConfig", "PreprocessConfig", "VisionConfig", "VisionEncoder"]
