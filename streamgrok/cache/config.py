"""Cache configuration: page size, KV dtype, memory budget, eviction policy and budgets."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from streamgrok.model.config import ModelConfig

CPU_DEFAULT_GIB = 2.0  # the CPU page pool when no size is given (committed as it fills)
KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
}
POLICIES = ("full", "sink_window", "h2o", "snapkv", "redundancy", "pyramid")


@dataclass(frozen=True)
class CacheConfig:
    """How the paged streaming cache is sized and how it evicts.

    `budget_tokens` is the per-sequence, per-layer token budget (average over layers when
    `layer_budgets` is "pyramid"); None means unbounded (only with policy "full").
    `kv_dtype` "auto" stores K/V in the model's compute dtype. `memory_gib` sizes the page
    pool; None (the default) means `gpu_memory_fraction` of free memory on CUDA and
    `CPU_DEFAULT_GIB` on CPU.

    With `host_tier_gib`, eviction is a tier change: evicted pages go to host memory (see
    `host_tier`), and each answer recalls the pages its question attends to most (`recall`):
    `recall_tokens` per layer, more while the estimated KV hit rate is below
    `recall_min_hit_rate`, never past the model's trained context. With `recall_in_stream`
    every streamed chunk of two or more tokens recalls the same way into the session's own
    working set (eviction then sends back what it needs least).
    """

    page_size: int = 16
    kv_dtype: str = "auto"
    memory_gib: float | None = None
    gpu_memory_fraction: float = 0.8
    policy: str = "redundancy"  # chosen from `python -m benchmarks kv` (README, Benchmarks)
    budget_tokens: int | None = 2048
    layer_budgets: str = "uniform"  # "uniform" or "pyramid"
    pyramid_full_layers: int = 8
    pyramid_min_ratio: float = 0.2
    sink_tokens: int = 4
    window_tokens: int | None = None  # default: a quarter of the layer budget
    evict_slack_tokens: int | None = None  # evict past budget + slack (default budget/8)
    # keep or evict a frame's tokens together; None: on for models with a vision tower (the
    # engine decides), off otherwise
    frame_aware: bool | None = None
    # frame-aware eviction with the frames' CLIP embeddings: a frame this similar to a newer
    # cached one is evicted first
    frame_repeat_similarity: float = 0.9
    h2o_decay: float = 0.999
    snapkv_window: int = 32
    snapkv_pool: int = 5
    redundancy_refs: int = 256
    host_tier_gib: float | None = None  # evicted pages go to a host tier of this size
    host_tier_dtype: str = "auto"  # "auto" (as the page pool stores) or "int8"
    disk_tier_gib: float | None = None  # past the host tier: memory-mapped files this size
    disk_tier_dir: str | None = None  # where their (unlinked) files go; default: the temp dir
    recall_tokens: int | None = None  # per layer and answer; default: the layer budget
    # the question's last queries that score the host tier: a question's every token
    # (answers agreed with the full cache's more often with all of them than with the last 8)
    recall_queries: int = 32
    recall_min_hit_rate: float = 0.95  # the guard: recall more below this estimated hit rate
    # streamed chunks recall too, so the stream's own keys and values are computed over what
    # it attends to (answers then agree with the full cache far more often); costs a recall
    # per chunk of the stream
    recall_in_stream: bool = False
    # a streamed chunk's queries (spread over it) that score the host tier
    recall_stream_queries: int = 32
    # the guard's threshold for streamed chunks (None: recall_min_hit_rate)
    recall_stream_min_hit_rate: float | None = None

    def __post_init__(self) -> None:
        if self.kv_dtype != "auto" and self.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_dtype must be auto or one of {', '.join(KV_DTYPES)}, not {self.kv_dtype!r}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {self.policy!r} (choose from {POLICIES})")
        if self.layer_budgets not in ("uniform", "pyramid"):
            raise ValueError(
                f"layer_budgets must be 'uniform' or 'pyramid', not {self.layer_budgets!r}"
            )
        if self.policy != "full" and not self.budget_tokens:
            raise ValueError(f"policy {self.policy!r} needs budget_tokens")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.host_tier_dtype not in ("auto", "int8"):
            raise ValueError(
                f"host_tier_dtype must be 'auto' or 'int8', not {self.host_tier_dtype!r}")
        if self.host_tier_gib is not None:
            if self.host_tier_gib <= 0:
                raise ValueError("host_tier_gib must be positive (or None for no host tier)")
            if not self.evicts:
                raise ValueError("a host tier keeps evicted pages: policy 'full' evicts none")
        if self.disk_tier_gib is not None:
            if self.host_tier_gib is None:
                raise ValueError("a disk tier holds what leaves the host tier: set "
                                 "host_tier_gib too")
            if self.disk_tier_gib <= 0:
                raise ValueError("disk_tier_gib must be positive (or None for no disk tier)")
        if self.recall_in_stream and self.host_tier_gib is None:
            raise ValueError("recall_in_stream recalls from the host tier: set host_tier_gib")
        if not 0.0 <= self.recall_min_hit_rate <= 1.0:
            raise ValueError("recall_min_hit_rate must be within [0, 1]")
        if self.recall_stream_min_hit_rate is not None and \
                not 0.0 <= self.recall_stream_min_hit_rate <= 1.0:
            raise ValueError("recall_stream_min_hit_rate must be within [0, 1] (or None)")
        if self.recall_queries < 1 or self.recall_stream_queries < 1:
            raise ValueError("recall_queries and recall_stream_queries must be >= 1")
        if self.recall_tokens is not None and self.recall_tokens < 1:
            raise ValueError("recall_tokens must be >= 1 (or None for the layer budget)")

    @property
    def recalls(self) -> bool:
        """Whether evicted pages are kept in a host tier and recalled for questions."""
        return self.host_tier_gib is not None

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        if self.kv_dtype == "auto":
            raise ValueError("kv_dtype 'auto' is resolved against the model first (`for_model`)")
        return KV_DTYPES[self.kv_dtype]

    def for_model(self, compute_dtype: torch.dtype) -> CacheConfig:
        """This config with kv_dtype "auto" resolved to the model's compute dtype."""
        if self.kv_dtype != "auto":
            return self
        name = next(n for n, d in KV_DTYPES.items() if d == compute_dtype)
        return replace(self, kv_dtype=name)

    @property
    def evicts(self) -> bool:
        return self.policy != "full"

    @property
    def slack(self) -> int:
        """Tokens a layer may exceed its budget by before an eviction pass: an eighth of the
        budget by default, so a pass (which costs up to ~0.1 s on CPU for `redundancy`) runs
        once per budget/8 new tokens instead of once per page."""
        if self.evict_slack_tokens is not None:
            return self.evict_slack_tokens
        eighth = (self.budget_tokens or 0) // 8 // self.page_size * self.page_size
        return max(self.page_size, eighth)

    def page_bytes(self, model: ModelConfig) -> int:
        """Bytes of K+V (and int8 scales) one page holds for one layer."""
        elems = self.page_size * model.num_kv_heads * model.head_dim
        if self.kv_dtype == "int8":
            return 2 * (elems + self.page_size * model.num_kv_heads * 2)  # + float16 scales
        return 2 * elems * torch.empty(0, dtype=self.torch_kv_dtype).element_size()

    def layer_budget_list(self, num_layers: int) -> list[int | None]:
        """Token budget of each layer for one sequence."""
        if self.budget_tokens is None or self.policy == "full":
            return [None] * num_layers
        if self.layer_budgets == "uniform" and self.policy != "pyramid":
            return [self.budget_tokens] * num_layers
        return pyramid_budgets(
            self.budget_tokens, num_layers, self.pyramid_full_layers, self.pyramid_min_ratio,
            floor=self.sink_tokens + self.page_size,
        )


def pyramid_budgets(
    mean_budget: int, num_layers: int, full_layers: int, min_ratio: float, floor: int
) -> list[int]:
    """PyramidKV schedule: the lowest `full_layers` layers at ratio 1.0, then decreasing
    linearly to `min_ratio` at the top; scaled so the mean stays `mean_budget` tokens."""
    full = min(full_layers, num_layers)
    rest = num_layers - full
    ratios = [1.0] * full + [
        1.0 - (1.0 - min_ratio) * (i + 1) / rest for i in range(rest)
    ]
    scale = mean_budget * num_layers / sum(ratios)
    budgets = [max(floor, int(r * scale)) for r in ratios]
    # hand rounding leftovers to the lowest layers so the total is exact
    leftover = mean_budget * num_layers - sum(budgets)
    i = 0
    while leftover > 0:
        budgets[i % num_layers] += 1
        leftover -= 1
        i += 1
    return budgets
