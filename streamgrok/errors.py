"""Exception types that name what went wrong, for users and for the server's error events."""


class StreamgrokError(Exception):
    """Base class of every error streamgrok raises on purpose."""


class ModelLoadError(StreamgrokError):
    """A model file or folder is missing, truncated, corrupt or of an unsupported kind."""


class UnsupportedQuantization(ModelLoadError):
    """A GGUF tensor uses a quantization type streamgrok cannot dequantize."""


class UnsupportedArchitecture(ModelLoadError):
    """The model is not a Llama-family decoder streamgrok can run."""


class CacheFullError(StreamgrokError):
    """The KV cache has no room left and its policy does not allow eviction."""


class RequestTooLarge(StreamgrokError):
    """A request (question, system prompt, text) cannot fit the session's KV budget or the
    configured limits; nothing of it was accepted."""
