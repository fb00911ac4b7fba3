"""Model hyper-parameters shared by the GGUF and Hugging Face loaders."""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: `kind` is "none", "linear" or "llama3"."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (SmolLM2, Llama 3.x, Mistral, Qwen2.x)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_bias: bool = False
    max_positions: int = 8192

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size
