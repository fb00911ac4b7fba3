"""streamgrok: live multimodal inference with a paged streaming KV cache."""

__version__ = "0.1.0"
