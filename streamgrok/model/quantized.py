"""Quantized linear layers: weight-only int8 per output channel (`q8`) or int4 in groups of
32 input channels with a scale and zero each (`q4`), run by PyTorch's own packed CPU kernels
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) on bfloat16 activations; or int8
weights times int8 activations (`w8a8`: each row of activations quantized on the fly with
its own scale, multiplied by `torch._int_mm`, oneDNN's VNNI int8 GEMM, 4-7x the int8
weight-only kernel from 32 rows on). w8a8 needs its model smoothed first
(`streamgrok.model.smoothing`: SmoothQuant), or per-row int8 activations lose too much.

A decode step reads every weight once, so its time follows the weight bytes: int8 is a quarter
of float32, int4 an eighth. On other devices the weights are dequantized per call (correct,
not fast). `load_model(weights="q8")` quantizes each projection as it is read
(`QuantizedRows`), so the float weights are never all in memory; `quantize_model` does the same
to a model already built."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from streamgrok.model.quantized_embedding import Int8Embedding
from streamgrok.model.quantized_embedding import fits as embedding_fits
from streamgrok_kernels.cpu_int4 import BLOCK as Q4_CPU_BLOCK
from streamgrok_kernels.cpu_int4 import Int4Matmul
from streamgrok_kernels.cpu_int8 import Int8Rows

WEIGHT_FORMATS = ("f32", "bf16", "q8", "q4", "w8a8")
Q4_GROUP = 32
Q4_INNER_K_TILES = 2
QUANTIZE_BLOCK_ELEMENTS = 1 << 21  # weights quantized per block of rows (8 MB of float32)
# From this many rows (a prefill chunk) a layer multiplies by its weight dequantized to
# bfloat16 (oneDNN's AMX/AVX-512 bfloat16 matmul; float32 where the CPU has no bfloat16)
# instead of the packed kernels, which are built for a few rows: 3072x576 at 512 rows,
# 2 threads, int4 kernel 12.0 ms, dequantize + bfloat16 matmul 4.7 ms; they cross near 150.
DEQUANTIZED_MIN_ROWS = 160
# The same crossing for int4 layers with the native kernels (`kernels.cpu_int4`), whose
# matmul of a few rows is faster than PyTorch's and whose unpacking to bfloat16 is ~14x
# faster than PyTorch's elementwise ops: SmolLM2's 121 matmuls, 2 threads, native matmul vs
# native unpacking + bfloat16 matmul, 32 rows 19-21 vs 46-51 ms, 64 rows 44-49 vs 54-59, 96
# rows 69-73 vs 60-67, 128 rows 82-111 vs 69-75, 256 rows 176-187 vs 89-95.
NATIVE_INT4_DEQUANTIZED_MIN_ROWS = 96
# A layer that keeps a bfloat16 copy (`Int8Linear.keep_wide`: the output head) multiplies by
# it from this many rows: the weight-only int8 kernel dequantizes the whole weight for every
# few rows (SmolLM2's 49152x576 head, 2 threads, AMX: 1 row 1.0 ms vs bfloat16 2.1 ms,
# reading twice the bytes; 8 rows 3.8 vs 2.0 ms; 32 rows 19.0 vs 3.3 ms). Two, not the
# crossing near 4 rows: a compiled decode step's graph for several sequences is traced at a
# batch of a few, and must take the path it will run at 8 or 32.
WIDE_MIN_ROWS = 2
# rows a weight-only int8 layer multiplies by the native int8 kernel (decode steps) before
# the bfloat16 copy or the dequantized weight take over
NATIVE_INT8_MAX_ROWS = 16
# logits per row an output head recomputes in float32 after a bfloat16 product
# (`Int8Linear._exact_top`) or the native int8 head's coarse one (`int8_head`, whose decode
# steps use kernels/cpu/native_ops.h's kHeadExactTop, the same number): every candidate a
# greedy or nucleus choice could plausibly take
EXACT_TOP = 32


@dataclass
class QuantizedRows:
    """A weight [out, in] quantized row by row, not yet packed for a kernel. Rows are
    independent, so the rows of several weights concatenate (fused q/k/v, gate/up) exactly
    as if the concatenation had been quantized."""

    kind: str  # "q8" or "q4"
    values: torch.Tensor  # int8 [out, in] (q8) or uint8 levels 0..15 [out, in] (q4)
    scales: torch.Tensor  # [out] (q8) or [out, in / 32] (q4), float32
    zeros: torch.Tensor | None = None  # [out, in / 32] (q4)

    @staticmethod
    def of(weight: torch.Tensor, kind: str) -> QuantizedRows:
        """`weight` quantized as `kind`, a block of rows at a time (so the float
        temporaries stay small next to a large weight such as a tied output head)."""
        out_features, in_features = weight.shape
        device = weight.device
        values = torch.empty(out_features, in_features, device=device,
                             dtype=torch.int8 if kind == "q8" else torch.uint8)
        groups = 1 if kind == "q8" else in_features // Q4_GROUP
        scales = torch.empty(out_features, groups, device=device)
        zeros = None if kind == "q8" else torch.empty(out_features, groups, device=device)
        step = max(1, QUANTIZE_BLOCK_ELEMENTS // in_features)
        for first in range(0, out_features, step):
            rows = slice(first, first + step)
            _quantize_block(weight[rows].detach().float(), kind, values[rows], scales[rows],
                            None if zeros is None else zeros[rows])
        return QuantizedRows(kind, values, scales[:, 0] if kind == "q8" else scales, zeros)

    @staticmethod
    def concat(parts: list[QuantizedRows]) -> QuantizedRows:
        zeros = None if parts[0].zeros is None else torch.cat([p.zeros for p in parts])
        return QuantizedRows(parts[0].kind, torch.cat([p.values for p in parts]),
                             torch.cat([p.scales for p in parts]), zeros)

    def linear(self, bias: torch.Tensor | None = None, int8_activations: bool = False,
               int8_rows: Int8Rows | None = None, int4_matmul: Int4Matmul | None = None,
               head: bool = False) -> nn.Module:
        """The packed linear layer of these rows (q8 rows with `int8_activations`: w8a8,
        quantizing activations with `int8_rows`; q4 rows multiplying by `int4_matmul`, and
        a weight-only int8 output `head` too: the native int8 kernel beats PyTorch's on its
        many rows, not on the projections' few)."""
        if self.kind == "q8":
            return Int8Linear.from_rows(self, bias, int8_activations, int8_rows,
                                        int4_matmul if head else None, head=head)
        return Int4Linear.from_rows(self, bias, int4_matmul)


def _quantize_block(w: torch.Tensor, kind: str, values: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor | None) -> None:
    """Quantize float32 rows `w` into the given output views."""
    if kind == "q8":
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
        values.copy_(torch.round(w / scale).clamp(-127, 127))
        scales.copy_(scale)
        return
    rows, in_features = w.shape
    groups = w.view(rows, in_features // Q4_GROUP, Q4_GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15.0).clamp(min=1e-8)
    values.copy_(torch.round((groups - low) / scale).clamp(0, 15).view(rows, in_features))
    scales.copy_(scale[..., 0])
    assert zeros is not None
    zeros.copy_((low + scale * 8.0)[..., 0])


def quantized_rows(weight: torch.Tensor, weights: str, head: bool = False) -> QuantizedRows:
    """`weight` as `weights` rows (q4 falls back to int8 where the int4 kernel cannot go;
    w8a8 weights are q8 rows). The output `head` of q4 is int8, as a Q4 GGUF's is: in int4
    it cost most of q4's agreement with float32 (measured in docs/cpu-performance.md)."""
    four = weights == "q4" and not head and fits_q4(*weight.shape)
    return QuantizedRows.of(weight, "q4" if four else "q8")


class Int8Linear(nn.Module):
    """y = x W^T + b with W stored as int8 [out, in] and one bfloat16 scale per output row
    (symmetric, scale = max |w| / 127). With `int8_activations` (w8a8) each row of x is
    quantized the same way, to int8 with its own scale, and multiplied in integers."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 int8_activations: bool = False, int8_rows: Int8Rows | None = None) -> None:
        super().__init__()
        self._set(QuantizedRows.of(weight, "q8"), bias, int8_activations, int8_rows)

    @classmethod
    def from_rows(cls, rows: QuantizedRows, bias: torch.Tensor | None,
                  int8_activations: bool = False, int8_rows: Int8Rows | None = None,
                  native_matmul: Int4Matmul | None = None, head: bool = False) -> Int8Linear:
        """The layer of `rows`; w8a8 layers of one model share `int8_rows` (the native
        activation quantization; None: PyTorch's ops); weight-only layers multiply a few
        rows by the native int8 kernel where `native_matmul` (the model's native matmul
        switch) serves. A `head` (the output layer) recomputes the largest logits of each
        row in float32 wherever it multiplies in bfloat16 (`_exact_top`), and multiplies
        natively by the int8 head kernel (`int8_head`: coarse activation levels, the largest
        logits recomputed in float32)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._set(rows, bias, int8_activations, int8_rows, native_matmul)
        layer.head = head
        return layer

    def _set(self, rows: QuantizedRows, bias: torch.Tensor | None,
             int8_activations: bool, int8_rows: Int8Rows | None,
             native_matmul: Int4Matmul | None = None) -> None:
        self.int8_activations = int8_activations
        self.int8_rows = int8_rows or Int8Rows(enabled=False)
        self.native_matmul = native_matmul or Int4Matmul(enabled=False)
        # the native kernel's float32 scales (the weight-only kernel's are bfloat16)
        self.register_buffer("row_scales", None if int8_activations else
                             rows.scales.to(torch.bfloat16).float().contiguous())
        self.register_buffer("qweight", rows.values.contiguous())
        # bfloat16 as the weight-only kernel takes them; float32 for the integer product
        self.register_buffer("scales", rows.scales.to(
            torch.float32 if int8_activations else torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.out_features, self.in_features = rows.values.shape
        self.register_buffer("wide", None)  # the bfloat16 copy, where kept
        self.head = False  # whether this is a model's output head (`_exact_top`)

    def keep_wide(self) -> None:
        """Also keep the weight dequantized to bfloat16 (twice the int8 bytes) and multiply by
        it from WIDE_MIN_ROWS rows: for a large layer with float activations (the output
        head) where the CPU multiplies bfloat16 natively; elsewhere nothing changes."""
        if self.qweight.device.type == "cpu" and not self.int8_activations and \
                prefill_dtype() == torch.bfloat16:
            self.register_buffer("wide", self.dequantized(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features)
        if self.int8_activations:
            out = self._integer_matmul(flat).to(x.dtype)
        elif flat.shape[0] < NATIVE_INT8_MAX_ROWS and self.native_matmul.serves(flat):
            out = (torch.ops.streamgrok_cpu.int8_head(flat.float(), self.qweight,
                                                      self.row_scales, EXACT_TOP)
                   if self.head else
                   torch.ops.streamgrok_cpu.int8_linear(flat.float(), self.qweight,
                                                        self.row_scales)).to(x.dtype)
        elif self.wide is not None and flat.shape[0] >= WIDE_MIN_ROWS:
            out = self._exact_top(flat, F.linear(flat.to(self.wide.dtype), self.wide), x.dtype)
        elif flat.device.type == "cpu" and flat.shape[0] >= DEQUANTIZED_MIN_ROWS:
            dtype = prefill_dtype()
            out = self._exact_top(flat, F.linear(flat.to(dtype), self.dequantized(dtype)),
                                  x.dtype)
        elif flat.device.type == "cpu":
            out = self._exact_top(flat, torch.ops.aten._weight_int8pack_mm(
                flat.to(torch.bfloat16), self.qweight, self.scales), x.dtype)
        else:
            out = F.linear(flat, self.dequantized(x.dtype))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def _exact_top(self, x: torch.Tensor, out: torch.Tensor, dtype: torch.dtype
                   ) -> torch.Tensor:
        """`out` (x W^T) in `dtype`; where this is a head and `out` came out in bfloat16, its
        EXACT_TOP largest entries per row recomputed from x in float32 (as the native int8
        kernel computes them). bfloat16 keeps 8 bits: logits near 25 round to steps of
        0.125, so two candidate tokens tie and greedy decoding picks the lower id, not the
        likelier one; the tail keeps its rounding, which moves sampling probabilities by a
        few percent at most."""
        if not self.head or out.dtype != torch.bfloat16 or dtype == torch.bfloat16:
            return out.to(dtype)
        out = out.to(dtype)
        top = out.topk(min(EXACT_TOP, self.out_features), dim=-1).indices  # [rows, k]
        rows = self.qweight[top].to(dtype)  # [rows, k, in]
        exact = torch.bmm(rows, x.to(dtype).unsqueeze(-1)).squeeze(-1)
        return out.scatter(-1, top, exact * self.scales[top].to(dtype))

    def _integer_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T in float32 from int8 x (a scale per row) times int8 W."""
        return self.levels_times_weight(*self.int8_rows.quantize(x))

    def levels_times_weight(self, levels: torch.Tensor, row_scales: torch.Tensor
                            ) -> torch.Tensor:
        """The float32 product of int8 activations [rows, in] (with a scale per row) and
        the weight: oneDNN's int8 GEMM on the CPU (W [out, in] read as the transpose it
        is); elsewhere the same integers multiplied in float32 (exact below 2^24 per sum)."""
        return self.int8_rows.scale(self.integer_products(levels), row_scales, self.scales)

    def integer_products(self, levels: torch.Tensor) -> torch.Tensor:
        """levels [rows, in] int8 times the int8 weight: int32 [rows, out] on the CPU, the
        same integers as float32 elsewhere."""
        if levels.device.type == "cpu":
            return torch._int_mm(levels, self.qweight.t())
        return levels.float() @ self.qweight.float().t()

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as the kernel sees it, [out, in]."""
        if dtype == torch.bfloat16:  # (w8a8 keeps float32 scales); one temporary, not two
            return self.qweight.to(dtype).mul_(self.scales.to(dtype)[:, None])
        return (self.qweight.to(torch.float32) * self.scales.float()[:, None]).to(dtype)


class Int4Linear(nn.Module):
    """y = x W^T + b with W in int4, groups of 32 input channels, asymmetric (a scale and a
    zero per group: w = (q - 8) * scale + zero), packed for PyTorch's CPU int4 kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 cpu_kernel: bool | None = None, int4_matmul: Int4Matmul | None = None
                 ) -> None:
        """`cpu_kernel`: pack for PyTorch's CPU kernel (default: when the weight is on the
        CPU), else keep two values a byte and dequantize per call; `int4_matmul`: the
        native kernel's switch, shared by a model's int4 layers (default: PyTorch's
        kernel)."""
        super().__init__()
        out_features, in_features = weight.shape
        if not fits_q4(out_features, in_features):
            raise ValueError(f"q4 needs input sizes divisible by {Q4_GROUP} and output sizes "
                             f"by 16, got {out_features}x{in_features}")
        self._set(QuantizedRows.of(weight, "q4"), bias,
                  weight.device.type == "cpu" if cpu_kernel is None else cpu_kernel,
                  int4_matmul)

    @classmethod
    def from_rows(cls, rows: QuantizedRows, bias: torch.Tensor | None,
                  int4_matmul: Int4Matmul | None = None) -> Int4Linear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._set(rows, bias, rows.values.device.type == "cpu", int4_matmul)
        return layer

    def _set(self, rows: QuantizedRows, bias: torch.Tensor | None, cpu_kernel: bool,
             int4_matmul: Int4Matmul | None) -> None:
        q = rows.values
        out_features, in_features = q.shape
        self.on_cpu = cpu_kernel
        self.int4_matmul = int4_matmul or Int4Matmul(enabled=False)
        self.unpacks = False  # whether the layout is the native kernels' (`_transposed`)
        # whether PyTorch's CPU int4 kernel reads the packed layout (its layout depends on
        # the CPU: with AVX-512 it is the native kernels' own, with AVX2 another)
        self.torch_kernel = self.on_cpu
        if self.on_cpu and out_features % Q4_CPU_BLOCK == 0:  # the native kernels' layout
            packed = pack_blocks(q)
            self.unpacks = True
            self.torch_kernel = torch_packs_as_blocks()
        elif self.on_cpu:  # the layout PyTorch's CPU kernel reads
            packed = _pack_for_cpu(q)
        else:  # two values a byte, dequantized per call
            packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
        self.register_buffer("packed", packed)
        # [in / group, out, (scale, zero)], as the kernel takes them
        self.register_buffer("scales_and_zeros", torch.stack(
            [rows.scales.t(), rows.zeros.t()], dim=-1).to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.out_features, self.in_features = out_features, in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features)
        native = self.unpacks and self.int4_matmul.serves(flat)
        dequantized_from = NATIVE_INT4_DEQUANTIZED_MIN_ROWS if native else DEQUANTIZED_MIN_ROWS
        # a compiled decode step keeps the native kernel at every batch it serves (a branch
        # on the rows would guard its dynamic batch size, and larger batches would run eager)
        # the native kernels' layout, which PyTorch's kernel does not read, and the native
        # kernel not (yet) in use: every chunk multiplies by the dequantized weight
        no_kernel = self.unpacks and not native and not self.torch_kernel
        if self.unpacks and (flat.shape[0] >= dequantized_from or no_kernel) and not (
                native and torch.compiler.is_compiling()):
            dtype = prefill_dtype()
            out = torch.matmul(flat.to(dtype), self._transposed(dtype)).to(x.dtype)
        elif native:  # the native kernels' layout (`unpacks`): the native kernel reads it
            out = self.int4_matmul.multiply(flat, self.packed, self.scales_and_zeros)
            out = out.to(x.dtype)
        elif self.torch_kernel:
            out = self._kernel(flat).to(x.dtype)
        else:
            out = F.linear(flat, self.dequantized(x.dtype))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T by PyTorch's int4 kernel (bfloat16 activations)."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, Q4_GROUP, self.scales_and_zeros)

    def _transposed(self, dtype: torch.dtype) -> torch.Tensor:
        """W^T [in, out] in `dtype`, unpacked from PyTorch's CPU layout
        (`kernels.cpu_int4.unpacked_transposed`), a temporary for one prefill matmul."""
        return self.int4_matmul.unpacked_transposed(self.packed, self.scales_and_zeros, dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as the kernels see it, [out, in] (on CPU unpacked where the layout is
        as `_transposed` reads it, else read back through PyTorch's kernel)."""
        if self.unpacks:
            return self._transposed(torch.float32).t().to(dtype)
        if self.on_cpu:
            eye = torch.eye(self.in_features, dtype=torch.bfloat16)
            return self._kernel(eye).t().to(dtype)
        q = torch.stack([self.packed & 15, self.packed >> 4], dim=-1).view(
            self.out_features, self.in_features).float()
        scales = self.scales_and_zeros[..., 0].t().float().repeat_interleave(Q4_GROUP, dim=1)
        zeros = self.scales_and_zeros[..., 1].t().float().repeat_interleave(Q4_GROUP, dim=1)
        return ((q - 8.0) * scales + zeros).to(dtype)


def pack_blocks(levels: torch.Tensor) -> torch.Tensor:
    """uint8 levels [out, in] (out a multiple of 64) in the native kernels' layout
    (`kernels.cpu_int4`): block j of rows 64j..64j+63 is [in][32] bytes whose byte c holds
    row c in its low nibble and row c + 32 in its high one; [out, in / 2] uint8."""
    out_features, in_features = levels.shape
    blocks = levels.to(torch.uint8).view(out_features // Q4_CPU_BLOCK, Q4_CPU_BLOCK, in_features)
    half = Q4_CPU_BLOCK // 2
    packed = blocks[:, :half] | (blocks[:, half:] << 4)  # [blocks, 32, in]
    return packed.transpose(1, 2).contiguous().view(out_features, in_features // 2)


@functools.cache
def torch_packs_as_blocks() -> bool:
    """Whether PyTorch's CPU int4 kernel, on this CPU, reads the native kernels' layout
    (`pack_blocks`), so that it can multiply a layer packed that way: true where it runs its
    AVX-512 code, not with AVX2, whose layout differs. Checked once, on one block."""
    levels = torch.arange(Q4_CPU_BLOCK * 2 * Q4_GROUP).remainder(16).view(Q4_CPU_BLOCK, -1)
    return _unpacks_exactly(_pack_for_cpu(levels), levels)


def _pack_for_cpu(levels: torch.Tensor) -> torch.Tensor:
    """uint8 levels [out, in] in the layout of PyTorch's CPU int4 kernel, packed a block of
    rows at a time (its int32 input is 4 bytes a weight). The kernel packs rows in blocks
    of 64, so blocks of a multiple of 64 rows give exactly the whole weight's packing."""
    out_features, in_features = levels.shape
    step = max(64, QUANTIZE_BLOCK_ELEMENTS // in_features // 64 * 64)
    return torch.cat([
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            levels[first:first + step].to(torch.int32), Q4_INNER_K_TILES)
        for first in range(0, out_features, step)])


def prefill_dtype() -> torch.dtype:
    """The dtype prefill rows multiply in: bfloat16 where oneDNN runs it natively
    (AVX-512 / AMX), else float32 (emulated bfloat16 would be slower than float32)."""
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def swiglu_w8a8(gate_up: nn.Module, down: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """down(silu(gate) * up) for a fused gate/up projection and a down projection that are
    both w8a8, with the float activations between them never written out
    (`Int8Rows.swiglu`: from gate/up's int32 products to down's int8 input in one pass);
    None where that does not serve (other layers, biases, a compiled graph, kernels not
    built): the caller then runs the layers as they are."""
    if not (isinstance(gate_up, Int8Linear) and isinstance(down, Int8Linear)
            and gate_up.int8_activations and down.int8_activations
            and gate_up.bias is None and down.bias is None):
        return None
    flat = x.reshape(-1, gate_up.in_features)
    rows = gate_up.int8_rows
    if not rows.serves(flat):
        return None
    levels, row_scales = rows.quantize(flat)
    levels, row_scales = rows.swiglu(gate_up.integer_products(levels), row_scales,
                                     gate_up.scales)
    out = down.levels_times_weight(levels, row_scales)
    return out.to(x.dtype).reshape(*x.shape[:-1], down.out_features)


def quantized_on_cpu(model: nn.Module) -> bool:
    """Whether `model` has int8 or int4 layers and lives on the CPU."""
    quantized = any(isinstance(m, (Int8Linear, Int4Linear)) for m in model.modules())
    return quantized and next(model.buffers(), torch.empty(0)).device.type == "cpu"


def prefill_attention_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype a quantized model's prefill attends in on the CPU: `prefill_dtype()`, as
    its projections multiply there (PyTorch's CPU flash attention in bfloat16 took a third of
    float32's time for 512 causal tokens with AMX); None (the cache's own dtype) for float
    models and off the CPU."""
    return prefill_dtype() if quantized_on_cpu(model) else None


def cache_dtype(model: nn.Module) -> torch.dtype:
    """The contiguous cache's K/V dtype for `model` (plain generation, the decode harness's
    auto): a quantized model's prefill dtype on the CPU (bfloat16 where native: a decode step
    reads every cached key and value, and on these CPUs attention is bound by those bytes;
    llama.cpp keeps float16 K/V by default), else the model's compute dtype."""
    return prefill_attention_dtype(model) or model.dtype


def paged_cache_dtype(model: nn.Module) -> torch.dtype:
    """The engine's paged cache K/V dtype for `model` where the cache says "auto": bfloat16
    for a quantized model on the CPU (the native paged kernels widen bfloat16 rows with a
    shift on any x86 CPU, and a long session's decode step is bound by the K/V bytes it
    reads; stored bfloat16, keys and values cost almost nothing in accuracy beside int4 or
    int8 weights, see docs/cpu-performance.md), else the model's compute dtype."""
    return torch.bfloat16 if quantized_on_cpu(model) else model.dtype


def wait_native_int8(model: nn.Module, timeout: float | None = None) -> bool:
    """Build the w8a8 layers' native activation kernels now if need be and wait (benchmarks,
    before they time); whether they are in use (False for other formats)."""
    for module in model.modules():
        if isinstance(module, Int8Linear) and module.int8_activations:
            return module.int8_rows.native.wait_ready(timeout)
    return False


def wait_native_int4(model: nn.Module, timeout: float | None = None) -> bool:
    """Build the int4 layers' native kernel now if need be and wait (benchmarks, and compiled
    decode before it traces); whether it is in use (False for other formats)."""
    for module in model.modules():
        if isinstance(module, Int4Linear) and module.unpacks:
            return module.int4_matmul.wait_ready(timeout)
    return False


def _unpacks_exactly(packed: torch.Tensor, levels: torch.Tensor) -> bool:
    """Whether `packed` (PyTorch's CPU int4 layout of `levels` [out, in]) is laid out as
    `Int4Linear._transposed` reads it: checked on the first block of rows, since the
    layout is PyTorch's own and may change; output sizes that are not whole blocks are
    laid out otherwise and keep the kernel."""
    rows, in_features = levels.shape
    if rows % Q4_CPU_BLOCK:
        return False
    block = packed[:Q4_CPU_BLOCK].reshape(in_features, Q4_CPU_BLOCK // 2)
    unpacked = torch.cat([block & 15, block >> 4], dim=1).t()
    return torch.equal(unpacked, levels[:Q4_CPU_BLOCK].to(torch.uint8))


ROUTING_GATES = ("router", "shared_gate")


def is_routing_gate(module_path: str) -> bool:
    """Whether a linear is a mixture's router or a shared expert's gate, which stay in the
    model's dtype whatever `weights` says: few weights, and a choice a rounding flips
    changes the token's whole computation."""
    return module_path.rpartition(".")[2] in ROUTING_GATES


def quantize_model(model: nn.Module, weights: str) -> nn.Module:
    """Store the projections and the output head as `weights` (q8, q4; f32 and bf16 leave
    the model as it is; routers stay: `is_routing_gate`). The embedding table becomes int8
    in groups of 32 (`Int8Embedding`, where the row size allows); a tied head gets its own
    quantized copy."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weights!r} (choose from "
                         f"{', '.join(WEIGHT_FORMATS)})")
    if weights == "w8a8":
        raise ValueError("w8a8 needs the model's activation ranges to smooth it first: "
                         "load it with load_model(path, weights='w8a8')")
    if weights in ("f32", "bf16"):
        return model
    int4_matmul = Int4Matmul()  # one native build for the model's int4 layers
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and not is_routing_gate(name):
                head = parent is model and name == "output"
                setattr(parent, name, quantized_rows(child.weight, weights, head).linear(
                    child.bias, int4_matmul=int4_matmul, head=head))
    keep_wide_head(model)
    quantize_embedding(model)
    return model


def keep_wide_head(model: nn.Module) -> None:
    """An int8 output head also keeps its bfloat16 copy (`Int8Linear.keep_wide`): a batch's
    logits by bfloat16 matmul (see WIDE_MIN_ROWS)."""
    if isinstance(getattr(model, "output", None), Int8Linear):
        model.output.keep_wide()


def quantize_embedding(model: nn.Module) -> None:
    """Replace `model.embed` (an `nn.Embedding`) by its `Int8Embedding`, where the row
    size allows."""
    embed = getattr(model, "embed", None)
    if isinstance(embed, nn.Embedding) and embedding_fits(embed.embedding_dim):
        model.embed = Int8Embedding.of(embed.weight)


def fits_q4(out_features: int, in_features: int) -> bool:
    """Whether the int4 kernel takes a [out, in] weight (groups of 32, rows in 16s)."""
    return in_features % Q4_GROUP == 0 and out_features % 16 == 0
