"""Decode steps of an int4 model on the CPU as one native call.

A model whose projections are all int4 layers on the native int4 kernel and whose head is
int4 or weight-only int8 (`--weights q4`, the CPU default) decodes through
`NativeDecodeStep`: the token embeddings are looked up here, and everything after them,
every layer's norms, matmuls, rotary, K/V writes, attention, SwiGLU and residuals, then the
final norm and the head, is one call of a C++ op that calls the native int4 matmul and
attention kernels directly, without the compiler (dynamo, inductor) in the process and
without a compiled step's guard check and Python wrapper. Two ops share the layer loop
(`kernels/cpu/step_parts.h`):

- `decode_step` over the contiguous cache (`streamgrok chat`, one-shot generation, `bench
  decode`), chosen by `compiled_decode.CompiledDecode` instead of compiling;
- `paged_decode_step` over the engine's paged streaming cache (live sessions, HTTP answers,
  triggers), chosen by `PagedNativeDecode`: new K/V go to the slots the cache reserved,
  attention reads each layer's page tables and returns the attention mass eviction scores.

The eager model is the reference of both (tests/test_native_decode.py,
tests/test_paged_native_decode.py); docs/cpu-performance.md has the measurements.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import torch

from streamgrok.model.batch import BatchMetadata, PagedDecodeView
from streamgrok.model.moe import MoEFeedForward
from streamgrok.model.quantized import NATIVE_INT8_MAX_ROWS, Int4Linear, Int8Linear
from streamgrok_kernels.cpu_attention import KV_DTYPES
from streamgrok_kernels.cpu_native import native_kernels_by_default

if TYPE_CHECKING:
    from streamgrok.model.compiled_decode import DecodeView
    from streamgrok.model.llama import Transformer

log = logging.getLogger(__name__)


def _native_int4(layer: object, bias_allowed: bool = False) -> bool:
    """Whether `layer` is an int4 layer the native kernel multiplies by."""
    return (isinstance(layer, Int4Linear) and layer.unpacks and layer.int4_matmul.in_use
            and (bias_allowed or layer.bias is None))


def _native_int8_head(layer: object) -> bool:
    """Whether `layer` is a weight-only int8 head the native int8 kernel multiplies by."""
    return (isinstance(layer, Int8Linear) and not layer.int8_activations
            and layer.native_matmul.in_use and layer.bias is None
            and layer.qweight.device.type == "cpu")


def native_step_fits(model: Transformer, kv_dtype: torch.dtype) -> bool:
    """Whether `model`'s decode steps over a cache of `kv_dtype` can run as `NativeDecodeStep`:
    float32 activations, fused q/k/v and gate/up, every projection int4 on the native kernel
    (built and vectorized: `wait_native_int4` first), the head int4 or weight-only int8 on
    the native kernels, q/k/v biases at most, no q/k norms or clipping; a mixture's experts
    (and shared expert) int4 too, its routers float32, its experts all in this process."""
    config = model.config
    if config.qk_norm != "none" or config.clip_qkv is not None:
        return False
    if kv_dtype not in KV_DTYPES or model.dtype != torch.float32 or \
            config.head_dim % 2 or not (_native_int4(model.output)
                                        or _native_int8_head(model.output)):
        return False  # model.dtype is the final norm's
    for block in model.layers:
        attn, ffn = block.attn, block.ffn
        if not (_native_int4(attn.wqkv, bias_allowed=True) and _native_int4(attn.wo)):
            return False
        if not (_native_moe(ffn) if isinstance(ffn, MoEFeedForward) else _native_mlp(ffn)):
            return False
        if any(norm.weight.dtype != torch.float32 for norm in (block.attn_norm, block.ffn_norm)):
            return False
    return True


def _native_mlp(ffn: object) -> bool:
    """Whether a SwiGLU MLP (a dense layer's, an expert's) is fused and native int4."""
    return (getattr(ffn, "w_gate_up", None) is not None and _native_int4(ffn.w_gate_up)
            and _native_int4(ffn.w_down))


def _native_moe(ffn: MoEFeedForward) -> bool:
    """Whether a mixture's layer runs in the native step (`kernels/cpu/moe_ffn.h`)."""
    return (ffn.dispatch is None and _float_gate(ffn.router)
            and all(_native_mlp(expert) for expert in ffn.experts)
            and (ffn.shared is None or _native_mlp(ffn.shared))
            and (ffn.shared_gate is None or _float_gate(ffn.shared_gate)))


def _float_gate(layer: object) -> bool:
    """Whether a router (or a shared expert's gate) is a float32 linear without bias."""
    return (isinstance(layer, torch.nn.Linear) and layer.bias is None
            and layer.weight.dtype == torch.float32)


def _moe_tensors(ffn: MoEFeedForward) -> list[torch.Tensor]:
    """A mixture's layer as the native step takes it (`kernels/cpu/moe_ffn.h`)."""
    tensors = [ffn.router.weight.contiguous()]
    for mlp in [*ffn.experts, *([ffn.shared] if ffn.shared is not None else [])]:
        tensors += [mlp.w_gate_up.packed, mlp.w_gate_up.scales_and_zeros,
                    mlp.w_down.packed, mlp.w_down.scales_and_zeros]
    if ffn.shared_gate is not None:
        tensors.append(ffn.shared_gate.weight.contiguous())
    return tensors


def _shared_expert_counts(model: Transformer) -> torch.Tensor:
    """One [layers, experts] int64 tensor the native steps count each expert's rows into;
    each mixture layer's `tokens_per_expert` becomes its row (counts so far kept), so the
    layer-by-layer calls count into the same numbers. Empty for a dense model."""
    moe = model.config.moe
    if moe is None:
        return torch.empty(0, dtype=torch.long)
    counts = torch.zeros(len(model.layers), moe.num_experts, dtype=torch.long)
    for row, block in zip(counts, model.layers):
        if isinstance(block.ffn, MoEFeedForward):
            if block.ffn.tokens_per_expert is not None:
                row.copy_(block.ffn.tokens_per_expert)
            block.ffn.tokens_per_expert = row
    return counts


class NativeDecodeStep:
    """One model's decode step as the native op; the model's tensors gathered once (check
    `native_step_fits` first)."""

    def __init__(self, model: Transformer) -> None:
        weights: list[torch.Tensor] = []
        biases: list[torch.Tensor] = []
        self.moe_weights: list[torch.Tensor] = []  # the mixture's layers (none if dense)
        routers: list[int] = []  # per layer: where its experts start in moe_weights, or -1
        absent = torch.empty(0)
        for block in model.layers:
            attn, ffn = block.attn, block.ffn
            weights += [block.attn_norm.weight.contiguous(),
                        attn.wqkv.packed, attn.wqkv.scales_and_zeros,
                        attn.wo.packed, attn.wo.scales_and_zeros,
                        block.ffn_norm.weight.contiguous()]
            if isinstance(ffn, MoEFeedForward):
                weights += [absent] * 4
                routers.append(len(self.moe_weights))
                self.moe_weights += _moe_tensors(ffn)
            else:
                weights += [ffn.w_gate_up.packed, ffn.w_gate_up.scales_and_zeros,
                            ffn.w_down.packed, ffn.w_down.scales_and_zeros]
                routers.append(-1)
            if attn.wqkv.bias is not None:
                biases.append(attn.wqkv.bias.float().contiguous())
        head = model.output
        weights.append(model.norm.weight.contiguous())
        self.body = list(weights)  # without the head: the op returns the normed hidden state
        weights += ((head.qweight, head.row_scales) if isinstance(head, Int8Linear)
                    else (head.packed, head.scales_and_zeros))
        self.weights = weights
        # a batch this large multiplies by an int8 head's bfloat16 copy, where it keeps one
        # (the CPU multiplies bfloat16 natively: faster there than the int8 kernel's loop)
        self.wide_head_from = (NATIVE_INT8_MAX_ROWS if isinstance(head, Int8Linear)
                               and head.wide is not None else None)
        self.biases = biases
        moe = model.config.moe
        self.moe_layout: list[int] = [] if moe is None else [
            moe.num_experts, moe.experts_per_token, int(moe.normalize_weights),
            int(moe.shared_intermediate_size > 0), int(moe.shared_gated), *routers]
        self.expert_counts = _shared_expert_counts(model)
        self.num_heads = model.config.num_heads
        self.num_kv_heads = model.config.num_kv_heads
        self.eps = model.norm.eps

    def paged(self, model: Transformer, input_ids: torch.Tensor, view: PagedDecodeView
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [batch, vocab] float32 of one decode step over the paged cache in `view`
        (whose pool it writes at the reserved slots), and the attention mass [L, B, keys]
        where the view wants it."""
        embedded, weights, wide_head = self._inputs(model, input_ids)
        kv = view.kv
        out, mass = torch.ops.streamgrok_cpu.paged_decode_step(
            embedded, weights, self.biases, kv.k, kv.v, kv.k_scale, kv.v_scale, view.new_slots,
            view.tables, view.lengths, view.cos, view.sin, view.page_size, self.num_heads,
            self.num_kv_heads, self.eps, view.wants_mass, self.moe_weights, self.moe_layout,
            self.expert_counts)
        return self._logits(model, out, wide_head), (mass if view.wants_mass else None)

    def __call__(self, model: Transformer, input_ids: torch.Tensor, view: DecodeView
                 ) -> torch.Tensor:
        """Logits [batch, vocab] float32 of one decode step of the batch in `view` (whose
        stores it writes at the new positions, as the compiled step does)."""
        embedded, weights, wide_head = self._inputs(model, input_ids)
        out = torch.ops.streamgrok_cpu.decode_step(
            embedded, weights, self.biases, view.keys, view.values, view.key_scales or [],
            view.value_scales or [], view.positions, view.cos.float(), view.sin.float(),
            self.num_heads, self.num_kv_heads, self.eps, self.moe_weights, self.moe_layout,
            self.expert_counts)
        return self._logits(model, out, wide_head)

    def _inputs(self, model: Transformer, input_ids: torch.Tensor
                ) -> tuple[torch.Tensor, list[torch.Tensor], bool]:
        """The step's embeddings, the weights the op takes, and whether the head is left to
        the caller (a batch of `wide_head_from` rows or more: the op returns the normed
        hidden state)."""
        wide_head = self.wide_head_from is not None and len(input_ids) >= self.wide_head_from
        return (model.embed(input_ids).float(), self.body if wide_head else self.weights,
                wide_head)

    @staticmethod
    def _logits(model: Transformer, out: torch.Tensor, wide_head: bool) -> torch.Tensor:
        return model.output(out).float() if wide_head else out


class PagedNativeDecode:
    """Decode steps over a paged cache (the engine's: live sessions, HTTP answers, triggers)
    as one native call each, `NativeDecodeStep.paged`, once the model fits
    (`native_step_fits`: checked again every `RECHECK_S` seconds until it does, as the int4
    layers' kernel is built in the background on their first calls). A step it does not
    serve (prefill, frame embeddings, recall acting between layers, CUDA, a cache without
    `paged_decode_view`) runs layer by layer; so does one the op rejects (counted in
    `fallbacks`, one warning)."""

    RECHECK_S = 1.0

    def __init__(self, enabled: bool | None = None) -> None:
        """`enabled`: None follows `native_kernels_by_default()`."""
        self.enabled = native_kernels_by_default() if enabled is None else enabled
        self.step: NativeDecodeStep | None = None
        self.steps = 0  # steps that ran as one native call
        self.fallbacks = 0  # steps the op rejected, run layer by layer instead
        self._checked_at = -math.inf
        self._clock = time.monotonic

    def run(self, model: Transformer, input_ids: torch.Tensor, batch: BatchMetadata,
            backend: object) -> torch.Tensor | None:
        """Logits of a prepared decode step (rows `batch.logit_rows`), or None where it must
        run layer by layer."""
        if (not self.enabled or input_ids.device.type != "cpu" or not batch.is_decode
                or batch.embed_rows is not None or model.kernels.backend == "triton"):
            return None
        view_of = getattr(backend, "paged_decode_view", None)
        view = view_of(batch) if view_of is not None else None
        if view is None or self._step_for(model, view.kv.k.dtype) is None:
            return None
        try:
            with torch.inference_mode():
                logits, mass = self.step.paged(model, input_ids, view)
        except RuntimeError as error:  # a check of the op: the layers rewrite the same slots
            if not self.fallbacks:
                log.warning("a paged decode step ran layer by layer: %s", error)
            self.fallbacks += 1
            return None
        if mass is not None:
            backend.observe_step_mass(batch, mass)
        self.steps += 1
        if batch.logit_rows is not None and batch.logit_rows.numel() != logits.shape[0]:
            logits = logits.index_select(0, batch.logit_rows)
        return logits

    def _step_for(self, model: Transformer, kv_dtype: torch.dtype) -> NativeDecodeStep | None:
        if self.step is None and self._clock() - self._checked_at >= self.RECHECK_S:
            self._checked_at = self._clock()
            if native_step_fits(model, kv_dtype):
                self.step = NativeDecodeStep(model)
                log.info("paged decode steps run as one native call")
        return self.step
