"""Read paged keys and values for attention on the CPU: gathered, dequantized and rotated.

The PyTorch attention path (the CPU backend) reads every cached key of every layer at each
call and rotates it to its cache position. Eager PyTorch does that in several passes over
fresh tensors: at 2048 cached tokens it was half of a paged decode step on one core (gather
24 ms, rotation 29 ms of 115 ms for SmolLM2). `PagedReader` compiles the same arithmetic with
torch.compile (inductor's C++ backend), which fuses gather, dequantization and rotation into
one pass over the keys (3.3x faster at 2048 keys; a decode step at 2048 tokens 98 -> 73 ms);
where compilation is off, not yet done, or failed, it runs the eager code, which is also the
tests' oracle.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from streamgrok_kernels.background_compile import (
    BackgroundCompiles,
    CallContext,
    LazyCompile,
    call_context,
    in_autograd_mode,
    stand_in,
)
from streamgrok_kernels.paged_kv import PagedKV
from streamgrok_kernels.rotary import rotated

COMPILED_READS_ENV = "STREAMGROK_COMPILED_READS"  # "0": read eagerly (e.g. short test runs)
# Below this many tokens a read is cheap and the compiled call's fixed cost (guards, ~0.1 ms)
# would outweigh what fusion saves.
COMPILED_MIN_TOKENS = 256
ReadFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def compiled_reads_by_default() -> bool:
    """Whether readers compile unless told (off where STREAMGROK_COMPILED_READS=0: a run
    of many short processes, such as the test suite, would spend more compiling than it
    saves)."""
    return os.environ.get(COMPILED_READS_ENV, "1") != "0"


def read_rotated(
    kv: PagedKV, slots: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K rotated to `positions` and V at flat `slots` [N], both [N, kv_heads, D] in `dtype`
    (`PagedKV.read`); cos/sin tables [> positions, D/2]. The rotation is one expression
    (`kernels.rotary.rotated`), which a compiler can fuse."""
    k, v = kv.read(slots, dtype)
    c = cos.index_select(0, positions)[:, None, :].to(dtype)
    s = sin.index_select(0, positions)[:, None, :].to(dtype)
    return rotated(k, c, s), v


class PagedReader:
    """Reads K (rotated) and V of page-table rows for the PyTorch attention path.

    With `compiled`, each kind of read (pool dtype, output dtype, int8 or not, one row or
    many) is compiled once on a background thread, on stand-in tensors of the same kind,
    while reads of that kind run eagerly; once it is ready they run compiled. So the first
    long read never stalls a model step for the compilation (seconds). A failed
    compilation turns compiled reads off for good, with one warning (`compile_error`)."""

    def __init__(self, compiled: bool | None = None) -> None:
        """`compiled`: None follows `compiled_reads_by_default()`."""
        self._function: ReadFn | None = None
        if compiled is None:
            compiled = compiled_reads_by_default()
        if compiled and hasattr(torch, "compile"):
            self._function = LazyCompile(read_rotated, dynamic=True)
        self._compiles = BackgroundCompiles("paged K/V reads")

    @property
    def compiled(self) -> bool:
        """Whether reads may run compiled (False when off or once a compilation failed)."""
        return self._function is not None and self._compiles.error is None

    @property
    def compile_error(self) -> str | None:
        """Why compiled reads are off, if a compilation or a compiled read failed."""
        return self._compiles.error

    def compiled_kinds(self) -> int:
        """How many kinds of read are compiled and in use."""
        return self._compiles.ready_count()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the compilations under way (benchmarks, before they time); True when none
        is left."""
        return self._compiles.wait(timeout)

    def read(self, kv: PagedKV, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at slots [B, W] (position w of each row is cache position w), rotated K,
        both [B, W, kv_heads, D] in `dtype`."""
        batch, width = slots.shape
        flat = slots.reshape(-1)
        positions = torch.arange(width, device=slots.device).repeat(batch)
        k, v = self._read((kv, flat, positions, cos, sin, dtype), batch)
        shape = (batch, width, kv.kv_heads, kv.head_dim)
        return k.view(shape), v.view(shape)

    def _read(self, args: tuple, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        function, (kv, slots, *_, dtype) = self._function, args
        if not self.compiled or slots.device.type != "cpu" or slots.numel() < COMPILED_MIN_TOKENS:
            return read_rotated(*args)
        context = call_context((kv.k, *args[1:5]))
        kind = (kv.k.dtype, dtype, kv.quantized, batch == 1, kv.kv_heads == 1, kv.head_dim,
                context)
        if not self._compiles.is_ready(kind):
            self._compiles.start(kind, lambda: _compile_kind(function, args, batch, context))
            return read_rotated(*args)
        try:
            return function(*args)
        except Exception as error:  # a recompilation that failed
            self._compiles.turn_off(error)
            return read_rotated(*args)


def _compile_kind(function: ReadFn, args: tuple, batch: int, context: CallContext) -> None:
    """Compile one kind of read on stand-ins whose sizes share no value (dynamic shapes
    would otherwise assume a coincidence holds), in the call's autograd mode, each an
    inference tensor where the call's (`args`) is."""
    kv, slots, positions, cos, sin, dtype = args
    half, rows = kv.head_dim // 2, 2 if batch > 1 else 1
    with in_autograd_mode(context):
        function(stand_in(kv.k, lambda: PagedKV.zeros(1013, kv.kv_heads, kv.head_dim,
                                                      kv.k.dtype, kv.page_size)),
                 stand_in(slots, lambda: torch.arange(rows * 263) % 1013),
                 stand_in(positions, lambda: torch.arange(263).repeat(rows)),
                 stand_in(cos, lambda: torch.zeros(389, half)),  # distinct tables, as in use
                 stand_in(sin, lambda: torch.zeros(389, half)), dtype)
