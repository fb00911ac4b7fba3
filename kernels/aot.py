"""Compile every kernel specialization for a CUDA architecture without a GPU.

Triton ships ptxas, so each kernel can be compiled to a cubin on a CPU-only machine. This
catches what the interpreter cannot: GPU-only compile errors, register spills (local memory)
and shared memory beyond the architecture's limit. Run `python -m streamgrok_kernels.aot --arch 90`
(H100/H200) or `--arch 80` (A100); it prints registers, spill bytes and shared memory per
specialization and exits non-zero when one fails to compile, spills or overflows.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


@dataclass(frozen=True)
class Variant:
    """One specialization: a kernel, its pointer element types and constexpr values."""

    name: str
    kernel: str  # "module.function" under kernels/
    pointers: dict[str, str]
    constexprs: dict[str, object]
    floats: tuple[str, ...] = ("scale", "eps")
    num_warps: int = 4
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Report:
    name: str
    registers: int
    spill_bytes: int
    shared_bytes: int
    error: str | None = None


# Pointer types shared by every kernel that has the argument; variants add the rest.
COMMON_POINTERS = {"tables_ptr": "*i32", "lengths_ptr": "*i32", "cu_ptr": "*i32",
                   "past_ptr": "*i32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                   "lse_ptr": "*fp32", "score_ptr": "*fp32", "mass_ptr": "*fp32"}


def _pool_pointers(kv: str) -> dict[str, str]:
    scale = "*fp16" if kv == "i8" else f"*{kv}"
    return {"k_ptr": f"*{kv}", "v_ptr": f"*{kv}", "ks_ptr": scale, "vs_ptr": scale}


def variants() -> list[Variant]:
    """The specializations the engine launches: bf16 models on bf16/fp16/int8 K/V,
    head_dim 64 and 128, with and without attention mass, plus float32 models."""
    import triton.language as tl

    out = []
    for kv in ("bf16", "fp16", "i8"):
        for dim, group in ((128, 4), (64, 3)):
            for mass in (False, True):
                common = dict(PAGE=16, DIM=dim, HALF=dim // 2, QUANT=kv == "i8",
                              DOT=tl.bfloat16, PRECISION="tf32")
                out.append(Variant(
                    f"decode kv={kv} d={dim} g={group} mass={mass}",
                    "paged_decode_attention._partial_kernel",
                    {"q_ptr": "*bf16", **_pool_pointers(kv), "out_ptr": "*fp32"},
                    dict(GROUP=group, BLOCK_G=16, BLOCK_N=64, WANT_SCORES=mass, **common)))
                out.append(Variant(
                    f"prefill kv={kv} d={dim} g={group} lse={mass}",
                    "paged_prefill_attention._prefill_kernel",
                    {"q_ptr": "*bf16", **_pool_pointers(kv), "out_ptr": "*bf16"},
                    dict(GROUP=group, BLOCK_M=64, BLOCK_N=64, WANT_LSE=mass, **common)))
            out.append(Variant(
                f"window mass kv={kv} d={dim}", "paged_prefill_attention._window_mass_kernel",
                {"q_ptr": "*bf16", **_pool_pointers(kv)},
                dict(GROUP=4, BLOCK_M=64, BLOCK_N=64, PAGE=16, HALF=dim // 2,
                     QUANT=kv == "i8", DOT=tl.bfloat16, PRECISION="tf32")))
        out.append(Variant(
            f"kv_append kv={kv}", "kv_append._append_kernel",
            {"slots_ptr": "*i64", "k_ptr": "*bf16", "v_ptr": "*bf16", "kp_ptr": f"*{kv}",
             "vp_ptr": f"*{kv}", "ks_ptr": "*fp16" if kv == "i8" else f"*{kv}",
             "vs_ptr": "*fp16" if kv == "i8" else f"*{kv}"},
            dict(DIM=128, QUANT=kv == "i8")))
        out.append(Variant(
            f"kv_compact kv={kv}", "kv_compact._compact_kernel",
            {"src_ptr": "*i64", "dst_ptr": "*i64", "k_ptr": f"*{kv}", "v_ptr": f"*{kv}",
             "ks_ptr": "*fp16" if kv == "i8" else f"*{kv}",
             "vs_ptr": "*fp16" if kv == "i8" else f"*{kv}"},
            dict(DIM=128, BLOCK=64, QUANT=kv == "i8")))
    out.append(Variant(
        "decode float32 model (IEEE dots)", "paged_decode_attention._partial_kernel",
        {"q_ptr": "*fp32", **_pool_pointers("fp32"), "out_ptr": "*fp32"},
        dict(GROUP=3, BLOCK_G=16, BLOCK_N=64, PAGE=16, DIM=64, HALF=32, QUANT=False,
             WANT_SCORES=True, DOT=tl.float32, PRECISION="ieee")))
    out.append(Variant("decode mass merge", "paged_decode_attention._mass_kernel", {},
                       dict(BLOCK=128)))
    for residual in (True, False):
        out.append(Variant(f"rms_norm 4096 residual={residual}", "rmsnorm._rmsnorm_kernel",
                           {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16",
                            "out_ptr": "*bf16", "sum_ptr": "*bf16"},
                           dict(BLOCK=4096, HAS_RESIDUAL=residual), num_warps=16))
    out.append(Variant("rotary 32 heads d=128", "rotary._rotary_kernel",
                       {"x_ptr": "*bf16", "pos_ptr": "*i64", "out_ptr": "*bf16"},
                       dict(HALF=64, BLOCK_H=32)))
    return out


def compile_variant(variant: Variant, arch: int) -> Report:
    """Compile one specialization to a cubin and read its resource usage."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, function = variant.kernel.split(".")
    fn = getattr(importlib.import_module(f"streamgrok_kernels.{module}"), function)
    signature = {}
    for name in fn.arg_names:
        if name in variant.constexprs:
            signature[name] = "constexpr"
        elif name in variant.pointers or name in COMMON_POINTERS:
            signature[name] = variant.pointers.get(name) or COMMON_POINTERS[name]
        else:
            signature[name] = "fp32" if name in variant.floats else "i32"
    constexprs = {(fn.arg_names.index(k),): v for k, v in variant.constexprs.items()}
    try:
        compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": variant.num_warps, **variant.options})
    except Exception as exc:  # a compile error is the finding
        return Report(variant.name, 0, 0, 0, f"{type(exc).__name__}: {str(exc)[:300]}")
    registers, spills = _resource_usage(compiled.asm["cubin"])
    return Report(variant.name, registers, spills, compiled.metadata.shared)


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, local-memory bytes) from cuobjdump, shipped next to Triton's ptxas."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", handle.name],
                              capture_output=True, text=True, check=True).stdout
    registers = re.search(r"REG:(\d+)", text)
    local = re.search(r"LOCAL:(\d+)", text)
    return (int(registers.group(1)) if registers else -1,
            int(local.group(1)) if local else 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streamgrok_kernels.aot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10")
    parser.add_argument("--only", default="", help="compile variants whose name has this")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: compiling needs the real Triton compiler",
              file=sys.stderr)
        return 2
    limit = SHARED_LIMIT.get(args.arch, 99 * 1024)
    print(f"compiling for sm_{args.arch} (shared memory limit {limit // 1024} KiB)")
    print(f"{'specialization':48s} {'regs':>5} {'spill B':>8} {'shared KiB':>11}  result")
    failures = 0
    for variant in variants():
        if args.only not in variant.name:
            continue
        report = compile_variant(variant, args.arch)
        problem = report.error or ("spills to local memory" if report.spill_bytes else None) \
            or ("shared memory over the limit" if report.shared_bytes > limit else None)
        failures += problem is not None
        print(f"{report.name:48s} {report.registers:>5} {report.spill_bytes:>8} "
              f"{report.shared_bytes / 1024:>11.1f}  {problem or 'ok'}", flush=True)
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
