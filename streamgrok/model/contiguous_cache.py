"""A simple contiguous KV cache: one fixed-capacity slot per sequence, never evicts.

It stores rotated keys at absolute positions. It is the reference the paged streaming cache
is checked against, and the cache of plain one-shot generation. K/V may be stored as int8
with a float16 scale per token and head (`kernels.quant.quantize_int8`): half the bytes of
bfloat16 for the same sequences. Decode steps on the CPU attend by the native kernel
(`kernels.cpu_attention`), which reads the rows as stored; prefill and other devices read them
dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from streamgrok.errors import CacheFullError
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.compiled_decode import DecodeView
from streamgrok.model.config import ModelConfig
from streamgrok.model.rotary import Rotary
from streamgrok_kernels.cpu_attention import KV_DTYPES, cpu_decode_attention
from streamgrok_kernels.cpu_native import NativeBuild
from streamgrok_kernels.quant import dequantized, quantize_int8
from streamgrok_kernels.rotary import apply_rotary


class ContiguousKVCache:
    """`max_seqs` slots of `capacity` tokens per layer; sequence ids are slot indices."""

    def __init__(
        self,
        config: ModelConfig,
        max_seqs: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        prefill_dtype: torch.dtype | None = None,
        native_attention: bool | None = None,
    ) -> None:
        """`dtype`: how K/V are stored (a float dtype, or int8 with scales); `prefill_dtype`:
        what prefill attention computes in (default: `dtype`, float32 for int8; a quantized
        model's is bfloat16 where the CPU multiplies it natively, see
        `streamgrok.model.quantized.prefill_attention_dtype`); `native_attention`: whether
        eager decode steps on the CPU attend by the native kernel once it is built (None:
        `kernels.cpu_native.native_kernels_by_default`), as compiled steps do."""
        # a tensor per layer: a compiled decode step writes each as its own input
        shape = (max_seqs, config.num_kv_heads, capacity, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device)
                  for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device)
                  for _ in range(config.num_layers)]
        # int8: a scale tensor per layer [max_seqs, kv_heads, capacity], as the stores (one
        # tensor of every layer's, written through a view per layer, made the compiled step
        # copy it whole every few layers: 8 sequences 14.8 -> 17.9 ms a step against bfloat16)
        self.k_scales: list[torch.Tensor] | None = None
        self.v_scales: list[torch.Tensor] | None = None
        if dtype == torch.int8:
            self.k_scales, self.v_scales = ([torch.zeros(shape[:3], dtype=torch.float16,
                                                         device=device)
                                             for _ in range(config.num_layers)]
                                            for _ in "kv")
        self.lengths = [0] * max_seqs
        self.capacity = capacity
        self.prefill_dtype = prefill_dtype or (torch.float32 if dtype == torch.int8 else dtype)
        self.rotary = Rotary(config, device)
        served = torch.device(device).type == "cpu" and dtype in KV_DTYPES
        self.native = NativeBuild("decode attention", native_attention) if served else None

    @property
    def decode_like(self) -> torch.Tensor:
        """A tensor like the views `decode_view` gives (for a compiled step's stand-ins)."""
        return self.k[0]

    def decode_view(self, batch: BatchMetadata) -> DecodeView | None:
        """The prepared decode batch for a compiled step (`streamgrok.model.compiled_decode`):
        the whole K/V stores and the positions; None unless the batch is every slot of the
        cache in order (a compiled step writes and reads the stores' rows as its batch)."""
        step: _StepState = batch.backend_state
        if step.decode is None or batch.seq_ids != list(range(len(self.lengths))):
            return None
        return DecodeView(self.k, self.v, step.positions,
                          torch.arange(step.decode[1], device=self.k[0].device), step.cos,
                          step.sin, self.k_scales, self.v_scales)

    def reset(self, seq_id: int) -> None:
        """Forget a sequence's tokens so its slot can be reused."""
        self.lengths[seq_id] = 0

    def length(self, seq_id: int) -> int:
        """Tokens cached for a sequence."""
        return self.lengths[seq_id]

    def prepare(self, batch: BatchMetadata) -> None:
        """Check capacity and advance each sequence's length by its new tokens."""
        starts = [self.lengths[s] for s in batch.seq_ids]
        for seq, start, n in zip(batch.seq_ids, starts, batch.query_lens):
            if start + n > self.capacity:
                raise CacheFullError(
                    f"sequence {seq} needs {start + n} tokens but the contiguous cache holds "
                    f"{self.capacity}"
                )
        for seq, start, n in zip(batch.seq_ids, starts, batch.query_lens):
            self.lengths[seq] = start + n
        device = self.k[0].device
        positions = torch.cat(
            [torch.arange(st, st + n) for st, n in zip(starts, batch.query_lens)]
        ).to(device)
        # what every layer shares, built once a step: rotary angles and the decode mask
        cos, sin = self.rotary.cos_sin(positions)
        decode = None
        if batch.is_decode:
            total = max(starts) + 1
            lengths = positions + 1  # a decode step's positions are its starts
            mask = torch.arange(total, device=device)[None, :] < lengths[:, None]
            decode = (_slots(batch.seq_ids, device), total, mask[:, None, None, :], lengths)
        batch.backend_state = _StepState(starts, positions, cos, sin, decode)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: BatchMetadata,
    ) -> torch.Tensor:
        """Store this layer's new K/V for each sequence, then attend (causal within chunks)."""
        step: _StepState = batch.backend_state
        starts = step.starts
        q = apply_rotary(q, step.cos, step.sin)
        k = apply_rotary(k, step.cos, step.sin)
        spans = batch.spans()
        self._store(layer, spans, starts, k, v)
        if step.decode is not None:
            return self._decode(layer, q, *step.decode)
        out = torch.empty_like(q)
        for (seq, row, n), start in zip(spans, starts):
            out[row : row + n] = self._prefill(layer, q[row : row + n], seq, start, n)
        return out

    def _store(self, layer: int, spans: list[tuple[int, int, int]], starts: list[int],
               k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's K/V [T, kv_heads, head_dim]: each span's (seq, first row, n) rows at
        its sequence's positions start..start+n-1 (int8: the step's rows quantized at once,
        not span by span: a decode step has a span per sequence)."""
        parts = [(self.k, k, None, None), (self.v, v, None, None)]
        if self.k_scales is not None:
            parts = [(data, *quantize_int8(rows), scales) for data, rows, scales in
                     ((self.k, k, self.k_scales), (self.v, v, self.v_scales))]
        for data, rows, row_scales, scales in parts:
            for (seq, row, n), start in zip(spans, starts):
                data[layer][seq, :, start : start + n] = rows[row : row + n].transpose(0, 1)
                if scales is not None:
                    scales[layer][seq, :, start : start + n] = \
                        row_scales[row : row + n].transpose(0, 1).to(torch.float16)

    def _read(self, layer: int, rows: int | torch.Tensor | slice, total: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of cache rows `rows` at positions 0..total-1, in `dtype` (int8 dequantized)."""
        keys = self.k[layer][rows, :, :total]
        values = self.v[layer][rows, :, :total]
        if self.k_scales is not None:
            keys = dequantized(keys, self.k_scales[layer][rows, :, :total])
            values = dequantized(values, self.v_scales[layer][rows, :, :total])
        return keys.to(dtype), values.to(dtype)

    def _prefill(
        self, layer: int, q: torch.Tensor, seq: int, start: int, n: int
    ) -> torch.Tensor:
        total = start + n
        keys, values = self._read(layer, seq, total, self.prefill_dtype)
        # from position 0 the mask is plain causal: the flash kernel then skips the blocks
        # above the diagonal instead of reading a mask (512 tokens: 2.4x faster)
        mask = None if start == 0 else \
            torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=start)
        dtype = self.prefill_dtype
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).to(dtype), keys, values, attn_mask=mask,
            is_causal=start == 0, enable_gqa=True)
        return out.transpose(0, 1).to(q.dtype)

    def _decode(
        self, layer: int, q: torch.Tensor, slots: torch.Tensor | slice, total: int,
        mask: torch.Tensor, lengths: torch.Tensor,
    ) -> torch.Tensor:
        if self.native is not None and self.native.ready():
            # the stores' rows as they are (int8 with their scales): no dequantized copy
            scales = (None, None) if self.k_scales is None else \
                (self.k_scales[layer][slots], self.v_scales[layer][slots])
            out = cpu_decode_attention(q.float(), self.k[layer][slots], self.v[layer][slots],
                                       lengths, q.shape[-1] ** -0.5, *scales)
            return out.to(q.dtype)
        keys, values = self._read(layer, slots, total,
                                  torch.float32 if self.k_scales is not None else
                                  self.k[layer].dtype)
        out = F.scaled_dot_product_attention(
            q[:, :, None, :].to(keys.dtype), keys, values, attn_mask=mask, enable_gqa=True)
        return out[:, :, 0, :].to(q.dtype)


def _slots(seq_ids: list[int], device: torch.device) -> torch.Tensor | slice:
    """The cache rows of a decode batch: a slice (a view, no copy of the keys) when the
    sequences are consecutive slots in order, else an index tensor."""
    first = seq_ids[0]
    if seq_ids == list(range(first, first + len(seq_ids))):
        return slice(first, first + len(seq_ids))
    return torch.tensor(seq_ids, device=device)


@dataclass
class _StepState:
    """One step's batch, as every layer's attention uses it."""

    starts: list[int]
    positions: torch.Tensor  # of the new tokens, packed
    cos: torch.Tensor
    sin: torch.Tensor
    # slots, total keys, mask, each row's keys
    decode: tuple[torch.Tensor | slice, int, torch.Tensor, torch.Tensor] | None
