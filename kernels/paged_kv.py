"""The paged K/V storage the attention kernels read: pools, optional int8 scales, page size."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamgrok_kernels.quant import dequantized


@dataclass(frozen=True)
class PagedKV:
    """Views of a page pool. Slot s = page * page_size + offset holds k[s], v[s] of shape
    [kv_heads, head_dim]. With int8 storage, k_scale/v_scale [slots, kv_heads] (float16) hold
    one scale per token and head; the value is int8 * scale."""

    k: torch.Tensor
    v: torch.Tensor
    page_size: int
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def zeros(
        cls, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, page_size: int,
        device: torch.device | str = "cpu",
    ) -> PagedKV:
        """Zeroed storage for `slots` tokens; int8 storage gets float16 scales."""
        storage = cls.unwritten(slots, kv_heads, head_dim, dtype, page_size, device)
        for tensor in storage.tensors():
            tensor.zero_()
        return storage

    @classmethod
    def unwritten(
        cls, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, page_size: int,
        device: torch.device | str = "cpu",
    ) -> PagedKV:
        """Storage for `slots` tokens whose contents are undefined until written (`zero_pages`
        before use): on the CPU the operating system commits its memory as it is first
        written, so a large pool costs what its pages in use hold."""
        k = torch.empty(slots, kv_heads, head_dim, dtype=dtype, device=device)
        v = torch.empty_like(k)
        if dtype != torch.int8:
            return cls(k, v, page_size)
        scales = [torch.empty(slots, kv_heads, dtype=torch.float16, device=device)
                  for _ in "kv"]
        return cls(k, v, page_size, *scales)

    def zero_pages(self, pages: torch.Tensor) -> None:
        """Zero every slot of `pages` (page indices, int64) in every stored tensor."""
        for tensor in self.tensors():
            paged = tensor.view(-1, self.page_size, *tensor.shape[1:])
            paged.index_fill_(0, pages.to(tensor.device), 0)

    def clone(self) -> PagedKV:
        """An independent copy of every stored tensor."""
        k, v, *scales = (t.clone() for t in self.tensors())
        return PagedKV(k, v, self.page_size, *scales)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k.shape[2]

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at `slots` (any shape), dequantized to `dtype` (rows gathered with
        index_select, which also compiles to a tighter loop than advanced indexing)."""
        flat = slots.reshape(-1)
        shape = (*slots.shape, self.kv_heads, self.head_dim)

        def gather(data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
            rows = data.index_select(0, flat)
            if scale is not None:
                rows = dequantized(rows, scale.index_select(0, flat))
            return rows.to(dtype).view(shape)

        return gather(self.k, self.k_scale), gather(self.v, self.v_scale)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every stored tensor indexed by slot: k, v and, for int8, their scales."""
        return (self.k, self.v) + ((self.k_scale, self.v_scale) if self.quantized else ())


def table_slots(block_tables: torch.Tensor, width: int, page_size: int) -> torch.Tensor:
    """Slot of each position 0..width-1 of every row of `block_tables` [B, pages], [B, width]."""
    pos = torch.arange(width, device=block_tables.device)
    return block_tables[:, pos // page_size].long() * page_size + pos % page_size
