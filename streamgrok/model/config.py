"""Model hyper-parameters shared by the GGUF and Hugging Face loaders."""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
QK_NORMS = ("none", "head", "projection")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward: each token goes to `experts_per_token` of
    `num_experts` SwiGLU experts, chosen by a softmax router; the chosen probabilities are
    renormalised to sum to one where `normalize_weights` (Mixtral, Qwen3-MoE), kept as they
    are otherwise (Qwen2-MoE, OLMoE). A shared expert (Qwen2-MoE) sees every token, scaled by
    a sigmoid gate where `shared_gated`. `dense_layers` keep a dense SwiGLU MLP of the
    model's `intermediate_size` instead."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    normalize_weights: bool
    shared_intermediate_size: int = 0
    shared_gated: bool = False
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) must be in "
                             f"1..num_experts ({self.num_experts})")

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer` routes its tokens to experts (else it has a dense MLP)."""
        return layer not in self.dense_layers


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
    moe: MoEConfig | None = None  # a mixture-of-experts model's feed-forward layers
    qk_norm: str = "none"  # RMSNorm of q and k: per head (Qwen3), of the projection (OLMoE)
    clip_qkv: float | None = None  # q, k and v clamped to +-clip_qkv (some OLMo models)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def is_dense_llama(self) -> bool:
        """Whether this is the plain Llama block (no experts, q/k norms or clipping): the
        shape the fused native and compiled decode steps are written for."""
        return self.moe is None and self.qk_norm == "none" and self.clip_qkv is None

    def active_parameters(self) -> int:
        """Parameters one token's forward pass multiplies by (a mixture's unchosen experts
        left out; embedding lookups excluded, the output head included)."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        total = self.vocab_size * self.hidden_size
        for layer in range(self.num_layers):
            total += attn
            moe = self.moe
            if moe is None or not moe.is_sparse(layer):
                total += dense_mlp
                continue
            total += self.hidden_size * moe.num_experts  # the router
            total += 3 * self.hidden_size * moe.expert_intermediate_size * moe.experts_per_token
            total += 3 * self.hidden_size * moe.shared_intermediate_size
            total += self.hidden_size if moe.shared_gated else 0
        return total

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size
