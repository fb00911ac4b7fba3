"""The native CPU kernels (`kernels/cpu/*.cpp`): one extension, built on first use.

The extension holds the attention kernels (`kernels.cpu_attention`), the float sides of
w8a8's integer matmuls and the weight-only int8 matmul of a few rows (`kernels.cpu_int8`),
the int4 matmul of a few rows (`kernels.cpu_int4`), and a whole int4 decode step through them
(`streamgrok.model.native_decode`). It is built with PyTorch's C++ extension
builder (the C++ compiler inductor needs anyway), for this machine's instruction set (the
build's name carries a hash of the sources and of the CPU's flags, so a cache shared between
machines never runs code built for another), and its kernels are dispatcher ops under
`torch.ops.streamgrok_cpu` (registered in C++, so a compiled graph calls them without Python
in between; each has a fake here for tracing).

`NativeBuild` is how a caller uses them without ever waiting for the compiler: the first call
that could use them starts the build on a background thread and gets False, as do calls
until the ops are loaded (the PyTorch path serves meanwhile); a failed build turns them off
with one warning. `STREAMGROK_NATIVE_ATTENTION=0` keeps every caller on its PyTorch path;
`STREAMGROK_CPU_ISA=avx2|portable` builds them for less than the whole instruction set (the
int4 matmul then runs its AVX2 or its portable loop).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import threading
from pathlib import Path

import torch

from streamgrok_kernels.background_compile import BackgroundCompiles, import_compiler_quietly

SOURCE_DIR = Path(__file__).with_name("cpu")
SOURCES = tuple(SOURCE_DIR / name for name in (
    "decode_attention.cpp", "paged_attention.cpp", "int8_rows.cpp", "int4_linear.cpp",
    "int8_linear.cpp", "decode_step.cpp", "paged_decode_step.cpp"))
HEADERS = (SOURCE_DIR / "attention_math.h", SOURCE_DIR / "native_ops.h",
           SOURCE_DIR / "activation_levels.h", SOURCE_DIR / "step_parts.h",
           SOURCE_DIR / "moe_ffn.h")
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
_BUILD_LOCK = threading.Lock()  # one build and registration, whichever thread asks first
# "0": the PyTorch paths instead of the native kernels (the name predates the int8 kernels)
NATIVE_ATTENTION_ENV = "STREAMGROK_NATIVE_ATTENTION"
# The most of this CPU's instruction set the kernels are built for: "native" (all of it, the
# default), "avx2" (no AVX-512: what an AVX2-only CPU runs) or "portable" (no AVX: the plain
# loops). Lets a machine with AVX-512 build and test the paths of the others.
CPU_ISA_ENV = "STREAMGROK_CPU_ISA"
ISA_CAP_FLAGS = {"native": [], "avx2": ["-mno-avx512f"], "portable": ["-mno-avx"]}


def isa_cap() -> str:
    """The instruction-set cap STREAMGROK_CPU_ISA asks for ("native" where unset); raises
    ValueError for a value that is not one of ISA_CAP_FLAGS."""
    cap = os.environ.get(CPU_ISA_ENV, "native").strip().lower() or "native"
    if cap not in ISA_CAP_FLAGS:
        raise ValueError(f"{CPU_ISA_ENV}={cap!r}: expected one of {', '.join(ISA_CAP_FLAGS)}")
    return cap


def build_flags() -> list[str]:
    """The C++ flags the native kernels are built with here (the ISA cap's included)."""
    return [*_CFLAGS, *ISA_CAP_FLAGS[isa_cap()]]


def native_kernels_by_default() -> bool:
    """Whether the CPU paths use the native kernels where they build (off where
    STREAMGROK_NATIVE_ATTENTION=0)."""
    return os.environ.get(NATIVE_ATTENTION_ENV, "1") != "0"


class NativeKernelUnavailable(RuntimeError):
    """The native kernels could not be built here (no C++ compiler, or the build failed)."""


def load_native_kernels() -> None:
    """Build (or find built) and load the native kernels, once per process, whichever thread
    asks first; raises NativeKernelUnavailable. Tens of seconds the first time on a machine,
    then a load from PyTorch's build cache."""
    with _BUILD_LOCK:
        _build_and_register()


@functools.cache
def _build_and_register() -> None:
    import_compiler_quietly()
    from torch.utils import cpp_extension

    flags = build_flags()
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    machine = f"{platform.machine()} {_cpu_flags()} {' '.join(flags)} {torch.__version__}"
    digest = hashlib.sha256(source + machine.encode()).hexdigest()[:12]
    try:
        cpp_extension.load(f"streamgrok_cpu_kernels_{digest}", [str(p) for p in SOURCES],
                           extra_cflags=flags, is_python_module=False, verbose=False)
    except Exception as error:  # no compiler, a failed build, a failed load
        raise NativeKernelUnavailable(
            f"the native CPU kernels ({', '.join(p.name for p in SOURCES)}) were not built "
            f"({type(error).__name__}: {error})") from error
    torch.library.register_fake("streamgrok_cpu::decode_attention", _fake_decode_attention)
    torch.library.register_fake("streamgrok_cpu::paged_attention", _fake_paged_attention)
    torch.library.register_fake("streamgrok_cpu::quantize_rows", _fake_quantize_rows)
    torch.library.register_fake("streamgrok_cpu::scale_products", _fake_scale_products)
    torch.library.register_fake("streamgrok_cpu::swiglu_quantize_rows", _fake_swiglu)
    torch.library.register_fake("streamgrok_cpu::int4_linear", _fake_int4_linear)
    torch.library.register_fake("streamgrok_cpu::int8_linear", _fake_int8_linear)
    torch.library.register_fake("streamgrok_cpu::int8_head", _fake_int8_head)
    torch.library.register_fake("streamgrok_cpu::int4_unpack_transposed",
                                _fake_int4_unpack_transposed)


def simd_flags() -> str:
    """This CPU's vector extensions that the native kernels' loops use (AVX-512 ones, AVX2,
    FMA), as named in /proc/cpuinfo; "none known" where there are none."""
    wanted = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi", "avx512_bf16",
              "avx2", "fma")
    present = set(_cpu_flags().split())
    return " ".join(flag for flag in wanted if flag in present) or "none known"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


class NativeBuild:
    """Whether one caller's native kernels are in use: on unless told
    (`native_kernels_by_default`); built on a background thread on the first `ready()`."""

    def __init__(self, what: str, enabled: bool | None = None) -> None:
        self.enabled = native_kernels_by_default() if enabled is None else enabled
        self._what = what
        self._build = BackgroundCompiles(f"native CPU {what}")

    def ready(self) -> bool:
        """Whether the kernels are loaded (starting their build if need be)."""
        if not self.enabled:
            return False
        if self._build.is_ready(self._what):
            return True
        self._build.start(self._what, load_native_kernels)
        return False

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Build now if not started, wait for it; whether the kernels are in use (benchmarks
        and tests, before they measure or compare)."""
        if self.enabled:
            self._build.start(self._what, load_native_kernels)
            self._build.wait(timeout)
        return self.enabled and self._build.is_ready(self._what)

    @property
    def error(self) -> str | None:
        """Why the native kernels are off, if their build failed."""
        return self._build.error


def _fake_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           lengths: torch.Tensor, scale: float,
                           key_scales: torch.Tensor | None = None,
                           value_scales: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _fake_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale, v_scale,
                          block_tables: torch.Tensor, cu_q: torch.Tensor, past: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, page_size: int,
                          mass_rows: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    width = block_tables.shape[1] * page_size
    mass = q.new_empty((block_tables.shape[0], width) if mass_rows > 0 else (0,))
    return torch.empty_like(q, memory_format=torch.contiguous_format), mass


def _fake_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (x.new_empty(x.shape, dtype=torch.int8),
            x.new_empty((x.shape[0], 1), dtype=torch.float32))


def _fake_scale_products(products: torch.Tensor, row_scales: torch.Tensor,
                         col_scales: torch.Tensor, bias) -> torch.Tensor:
    return products.new_empty(products.shape, dtype=torch.float32)


def _fake_swiglu(products: torch.Tensor, row_scales: torch.Tensor, col_scales: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width = products.shape[0], products.shape[1] // 2
    return (products.new_empty((rows, width), dtype=torch.int8),
            products.new_empty((rows, 1), dtype=torch.float32))


def _fake_int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                      portable: bool = False) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]), dtype=torch.float32)


def _fake_int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                      portable: bool = False) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


def _fake_int8_head(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, exact: int,
                    portable: bool = False) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


def _fake_int4_unpack_transposed(packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                                 dtype: torch.dtype) -> torch.Tensor:
    return packed.new_empty((packed.shape[1] * 2, packed.shape[0]), dtype=dtype)
