"""Decode steps on the CPU as one compiled graph: the whole model, embedding to logits.

A batch-1 decode step of a small model is a few hundred small PyTorch calls from Python:
SmolLM2-135M (q4, 2 threads) spent 13 of its 20 ms outside the int4 matmuls, in dispatch,
tiny norm/rotary/residual ops and the attention call's fixed cost. `CompiledDecode` traces
the step once with torch.compile (inductor's C++ backend) into one graph: the norms,
rotary, residuals and SwiGLU fuse into a few loops around the quantized matmuls, and the
attention over the contiguous cache is one call of the native CPU kernel
(`kernels.cpu_attention`, built with the graphs; where it cannot be built, or with
STREAMGROK_NATIVE_ATTENTION=0, a masked softmax between two product-sum loops in the graph).

Compilation runs on a background thread on stand-in tensors while steps run eagerly (tens
of seconds on two cores the first time; inductor's on-disk cache makes later processes
quick), and compiled steps run under `fail_on_recompile`: the model's thread never waits for
the compiler. Where a step is not of the compiled kind (prefill, frame embeddings, a batch
that is not every slot of the cache, a cache without `decode_view`, CUDA tensors) it runs
eagerly; the eager model is the oracle. STREAMGROK_COMPILED_DECODE=0 turns it off.

A model whose projections are all native int4 layers (`--weights q4`) is not compiled: its
steps run as one native call (`streamgrok.model.native_decode`), chosen in the same
background step once the native kernels are built, so such a process never imports the
compiler.

The contiguous cache (one-shot generation, `streamgrok chat`, `python -m benchmarks decode`)
gives decode views. The engine's paged streaming cache does not: there an int4 model's decode
steps run as one native call over the page tables (`native_decode.PagedNativeDecode`), and
other models' layer by layer.
"""

from __future__ import annotations

import logging
import os
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from streamgrok.model.batch import BatchMetadata
from streamgrok.model.native_decode import NativeDecodeStep, native_step_fits
from streamgrok.model.quantized import wait_native_int4
from streamgrok.runtime import release_free_memory
from streamgrok_kernels.background_compile import BackgroundCompiles, LazyCompile
from streamgrok_kernels.cpu_attention import (
    NATIVE_ATTENTION_ENV,  # noqa: F401  (the switch's name, for callers of this module)
    cpu_decode_attention,
    native_attention_by_default,
    native_kernel_available,
)
from streamgrok_kernels.quant import dequantized, quantize_int8
from streamgrok_kernels.rotary import rotated

if TYPE_CHECKING:
    from streamgrok.model.llama import Transformer

log = logging.getLogger(__name__)

COMPILED_DECODE_ENV = "STREAMGROK_COMPILED_DECODE"  # "0": decode eagerly
_EXTRA_CAPACITY = 9  # the stand-in stores hold more positions than are attended over


def compiled_decode_by_default() -> bool:
    """Whether decode steps compile unless told (off where STREAMGROK_COMPILED_DECODE=0:
    many short processes, such as the test suite, would spend more compiling than saving)."""
    return os.environ.get(COMPILED_DECODE_ENV, "1") != "0"


@dataclass
class DecodeView:
    """What a compiled decode step needs from a cache: its whole K/V stores, one per layer
    [batch, kv_heads, capacity, head_dim] (contiguous, a row per sequence of the batch,
    written in place), each sequence's new position [batch], the key positions to
    attend over, `arange(T)` with T > every new position, and the rotary cos/sin
    [batch, head_dim/2]; int8 stores come with their scales, one per row, a tensor per layer
    [batch, kv_heads, capacity] float16 (`kernels.quant.quantize_int8`). (Whole contiguous
    stores, not views of them: a view's strides would enter the compiled graph's guards; one
    tensor per layer, as inductor copies a mutated input back whole.)"""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor
    key_positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    key_scales: list[torch.Tensor] | None = None
    value_scales: list[torch.Tensor] | None = None


class DecodeViewSource(Protocol):
    """An attention backend that can hand a prepared decode batch to a compiled step."""

    decode_like: torch.Tensor  # a tensor of its K/V's dtype, device and inference mode

    def decode_view(self, batch: BatchMetadata) -> DecodeView | None:
        """The batch's view after `prepare`, or None where it cannot be given (then the step
        runs eagerly)."""
        ...


class _ViewAttention:
    """The attention backend inside the compiled graph: stores each layer's new K/V at its
    position in the stores, then attends over their first T positions with a causal length
    mask, by the native CPU kernel (`native`) or as product-sum loops inductor fuses."""

    def __init__(self, view: DecodeView, native: bool) -> None:
        self.view = view
        self.native = native
        self.mask = (view.key_positions[None, :] <= view.positions[:, None])[:, None, None, :]
        self.lengths = view.positions + 1
        self.rows = torch.arange(view.positions.shape[0], device=view.positions.device)
        self.cos, self.sin = view.cos[:, None, :], view.sin[:, None, :]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               batch: BatchMetadata | None) -> torch.Tensor:
        view = self.view
        q, k = self._rotated(q), self._rotated(k)
        store_k, store_v = view.keys[layer], view.values[layer]  # [B, kv_heads, capacity, D]
        k_scales = v_scales = None
        if view.key_scales is not None:
            k_scales, v_scales = view.key_scales[layer], view.value_scales[layer]
            k, k_scale = quantize_int8(k)
            v, v_scale = quantize_int8(v)
            k_scales[self.rows, :, view.positions] = k_scale.to(k_scales.dtype)
            v_scales[self.rows, :, view.positions] = v_scale.to(v_scales.dtype)
        store_k[self.rows, :, view.positions] = k.to(store_k.dtype)
        store_v[self.rows, :, view.positions] = v.to(store_v.dtype)
        rows, heads, dim = q.shape
        if self.native:
            out = cpu_decode_attention(q.float(), store_k, store_v, self.lengths, dim ** -0.5,
                                       k_scales, v_scales)
            return out.to(q.dtype)
        used = view.key_positions.shape[0]
        keys, values = store_k[:, :, :used], store_v[:, :, :used]
        if k_scales is not None:
            keys = dequantized(keys, k_scales[:, :, :used])
            values = dequantized(values, v_scales[:, :, :used])
        kv_heads = keys.shape[1]
        grouped = q.to(keys.dtype).view(rows, kv_heads, heads // kv_heads, 1, dim)
        # products summed, not matmuls: inductor makes each one loop that reads the keys
        # (values) once; the batched matmuls of a few query rows each ran at a third of
        # the memory bandwidth (w8a8, 2 threads: 32 sequences at 512 tokens 63.5 -> 56.0
        # ms a step, 8: 35.1 -> 24.5, batch 1 at 64: 10.5 -> 6.7)
        scores = (grouped * keys[:, :, None]).float().sum(-1) * dim ** -0.5
        weights = scores.masked_fill(~self.mask, float("-inf")).softmax(-1)
        out = (weights[..., None] * values[:, :, None].float()).sum(-2)
        return out.reshape(rows, heads, dim).to(q.dtype)

    def _rotated(self, x: torch.Tensor) -> torch.Tensor:
        return rotated(x, self.cos.to(x.dtype), self.sin.to(x.dtype))


def decode_graph(model: nn.Module, input_ids: torch.Tensor, view: DecodeView,
                 native: bool = False) -> torch.Tensor:
    """One decode step of `model` (a `Transformer`) for the batch in `view`: logits
    [batch, vocab] for each sequence's new token, attention by the native CPU kernel where
    `native`; written to be traced whole."""
    backend = _ViewAttention(view, native)
    x = model.embed(input_ids)
    for layer in model.layers:
        x = layer(x, None, backend, model.kernels)
    return model.output(model.norm(x, model.kernels)).float()


class CompiledDecode:
    """The compiled decode step of one model, compiled in the background on first use.

    Two kinds are compiled, one sequence and several (dynamic shapes specialise a size of
    one), both on one thread, and used once both are ready. A step the compiled graphs do
    not fit (their guards fail: another cache dtype, say) runs eagerly, counted
    (`eager_fallbacks`), with one warning; a failed compilation turns compiled decode off
    for good (`compile_error`). Each instance compiles its own copy of `decode_graph`'s
    code: dynamo keeps a code object's graphs within a limit (8), and past it runs the
    function uncompiled without a word, so models sharing one code object (five in the test
    suite) would run their steps uncompiled, counted as compiled."""

    def __init__(self, enabled: bool | None = None) -> None:
        """`enabled`: None follows `compiled_decode_by_default()`."""
        if enabled is None:
            enabled = compiled_decode_by_default()
        # made on first use: a model whose steps run natively never imports the compiler
        self._function = LazyCompile(_own_copy(decode_graph)) \
            if enabled and hasattr(torch, "compile") else None
        self._compiles = BackgroundCompiles("decode")
        self.native_attention = False  # whether the compiled steps attend by the native kernel
        # the whole step as one native call (int4 models), chosen instead of compiling
        self.native_step: NativeDecodeStep | None = None
        # a mixture of experts the native step does not fit: its steps stay layer by layer
        self._declined = False
        self.compiled_steps = 0  # steps that ran compiled
        self.eager_fallbacks = 0  # compiled-kind steps the compiled graph did not fit

    @property
    def enabled(self) -> bool:
        """Whether steps may run compiled (False when off or once a compilation failed)."""
        return self._function is not None and self._compiles.error is None

    @property
    def compile_error(self) -> str | None:
        """Why compiled decode is off, if its compilation failed."""
        return self._compiles.error

    @property
    def ready(self) -> bool:
        """Whether the compiled steps are in use."""
        return (self._function is not None and not self._declined
                and self._compiles.is_ready(_STEPS))

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for a compilation under way (benchmarks, before they time); True when the
        compiled steps are in use."""
        self._compiles.wait(timeout)
        return self.ready

    def wants(self, model: Transformer, input_ids: torch.Tensor, batch: BatchMetadata,
              backend: object) -> bool:
        """Whether this step is of the compiled kind (checked before the backend prepares
        it): a CPU decode step of token ids on a backend that gives decode views, of a
        model without experts or one whose steps run natively (a traced graph would fix the
        tokens' grouping by expert to the stand-ins' routing)."""
        return (self.enabled and not self._declined and batch.is_decode
                and batch.embed_rows is None
                and input_ids.device.type == "cpu" and hasattr(backend, "decode_view")
                and model.kernels.backend != "triton")

    def run(self, model: Transformer, input_ids: torch.Tensor, batch: BatchMetadata,
            backend: DecodeViewSource) -> torch.Tensor | None:
        """Logits of a prepared decode step, compiled; None where the step must run eagerly
        (not compiled yet: the compilation starts; or no view for this batch)."""
        function = self._function
        if function is None or not self.enabled:
            return None
        if not self._compiles.is_ready(_STEPS):
            self._compiles.start(_STEPS, lambda: self._compile(function, model, backend))
            return None
        view = backend.decode_view(batch)
        if view is None:
            return None
        if self.native_step is not None:
            return self._run_native(model, input_ids, batch, view)
        with torch.inference_mode():  # the stand-ins' kind, whatever the caller's tensors
            ids = input_ids.clone()
            view = DecodeView(view.keys, view.values, view.positions.clone(),
                              view.key_positions.clone(), view.cos.clone(), view.sin.clone(),
                              view.key_scales, view.value_scales)
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    logits = function(model, ids, view, self.native_attention)
            except Exception as error:  # a guard this step fails: never compile here
                self._fell_back(error)
                return None
        return self._counted(logits, batch)

    def _run_native(self, model: Transformer, input_ids: torch.Tensor, batch: BatchMetadata,
                    view: DecodeView) -> torch.Tensor | None:
        try:
            with torch.inference_mode():
                logits = self.native_step(model, input_ids, view)
        except Exception as error:  # a cache the native step does not take: eager
            self._fell_back(error)
            return None
        return self._counted(logits, batch)

    def _counted(self, logits: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
        """A step's logits, counted, of the rows the batch asks for."""
        self.compiled_steps += 1
        if batch.logit_rows is not None:
            logits = logits.index_select(0, batch.logit_rows)
        return logits

    def _fell_back(self, error: Exception) -> None:
        if not self.eager_fallbacks:
            log.warning("a decode step ran eagerly: the compiled one does not fit it (%s: %s)",
                        type(error).__name__, error)
        self.eager_fallbacks += 1


    def _compile(self, function, model: Transformer, backend: DecodeViewSource) -> None:
        """Build the native attention kernel if it serves this cache; then take the native
        step where the model fits it (`native_step_fits`), else trace both graphs on
        stand-ins of the backend's kind."""
        like = backend.decode_like
        self.native_attention = native_attention_by_default() and \
            native_kernel_available(like.dtype)
        wait_native_int4(model)  # the graphs call the kernel its int4 layers will use
        if self.native_attention and native_step_fits(model, like.dtype):
            self.native_step = NativeDecodeStep(model)
            return
        if model.config.moe is not None:
            log.info("decode steps of this mixture of experts run layer by layer: the native "
                     "step does not fit it (int4 fused experts, float32, native attention)")
            self._declined = True
            return
        tokens, several = _stand_in_sizes(model)
        for batch in (1, several):
            ids, view = _stand_ins(model, like, batch, tokens)
            with torch.inference_mode():
                function(model, ids, view, self.native_attention)
        # the compilation's freed heap (SmolLM2 q4: ~45 MB) would stay in the process
        release_free_memory()


def _own_copy(function: types.FunctionType) -> types.FunctionType:
    """`function` with a code object of its own (dynamo keeps its graphs on the code)."""
    return types.FunctionType(function.__code__.replace(), function.__globals__,
                              function.__name__, function.__defaults__, function.__closure__)


_STEPS = "decode steps"  # the one kind: both graphs, one sequence and several


def _stand_in_sizes(model: Transformer) -> tuple[int, int]:
    """Cached tokens and a batch of several for the stand-ins: values no other size of the
    graph has, and not 0 or 1 (dynamic shapes assume a coincidence of sizes holds, and
    specialise a size of one)."""
    config = model.config
    taken = {config.num_layers, config.num_kv_heads, config.head_dim, config.head_dim // 2,
             config.num_heads, config.hidden_size, config.vocab_size}
    free = [n for n in range(3, 1000) if n not in taken]
    several = free[0]
    tokens = next(n for n in free if n > 16 and n + _EXTRA_CAPACITY in free)
    return tokens, several


def _stand_ins(model: Transformer, like: torch.Tensor, batch: int, tokens: int
               ) -> tuple[torch.Tensor, DecodeView]:
    """Token ids and zero K/V stores like the cache's (`like`'s dtype, made in inference
    mode or not as `like` was: guards tell them apart) for `batch` sequences attending over
    `tokens`, the sizes that vary in use marked dynamic."""
    config = model.config
    store = (batch, config.num_kv_heads, tokens + _EXTRA_CAPACITY, config.head_dim)
    with torch.inference_mode(like.is_inference()):
        keys, values = ([torch.zeros(store, dtype=like.dtype)
                         for _ in range(config.num_layers)] for _ in range(2))
        scales = None
        if like.dtype == torch.int8:
            scales = [[torch.zeros(store[:3], dtype=torch.float16)
                       for _ in range(config.num_layers)] for _ in range(2)]
    with torch.inference_mode():
        half = config.head_dim // 2
        view = DecodeView(keys, values, (torch.arange(batch) * 5 + 7) % tokens,
                          torch.arange(tokens), torch.ones(batch, half), torch.zeros(batch, half),
                          *(scales or (None, None)))
        ids = torch.zeros(batch, dtype=torch.long)
    stores = [*keys, *values, *(scales[0] + scales[1] if scales else [])]
    for tensor in stores:
        torch._dynamo.mark_dynamic(tensor, 2)
    torch._dynamo.mark_dynamic(view.key_positions, 0)
    if batch > 1:
        for tensor in [*stores, view.positions, view.cos, view.sin, ids]:
            torch._dynamo.mark_dynamic(tensor, 0)
    return ids, view
