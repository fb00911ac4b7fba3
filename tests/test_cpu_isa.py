"""The native kernels built for less than the whole instruction set (STREAMGROK_CPU_ISA): the
int4 matmul's AVX2 loop (what an AVX2-only CPU runs) and its portable loop each give the float
product within its activation levels, and paged decode attention the reference's rows, so a
machine with AVX-512 tests the other CPUs' paths."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from helpers import run_script

from streamgrok_kernels.cpu_native import CPU_ISA_ENV, isa_cap


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


CHECK = textwrap.dedent("""
    import sys
    import torch
    from streamgrok_kernels.cpu_int4 import Int4Matmul, int4_kernel, unpacked_transposed
    from streamgrok.model.quantized import Int4Linear, Int8Linear, QuantizedRows

    matmul = Int4Matmul(enabled=True)
    matmul.wait_ready()
    assert matmul.native.error is None, matmul.native.error
    kernel = int4_kernel()
    assert kernel == sys.argv[1], kernel
    assert matmul.in_use == (kernel != "portable"), (kernel, matmul.in_use)
    gen = torch.Generator().manual_seed(0)
    for rows, out_features, in_features in [(1, 64, 32), (3, 192, 576), (17, 320, 1536)]:
        weight = torch.randn(out_features, in_features, generator=gen) * 0.05
        weight[:, :32] += 0.1
        layer = Int4Linear(weight, None)
        x = torch.randn(rows, in_features, generator=gen) * torch.logspace(-3, 2, rows)[:, None]
        x[0] = 0.0
        w = unpacked_transposed(layer.packed, layer.scales_and_zeros).double()
        exact = x.double() @ w
        peaks = x.view(rows, -1, 32).abs().amax(-1, keepdim=True)
        step = (peaks / 127 / 508).expand(-1, -1, 32).reshape(x.shape).double()
        bound = step @ w.abs() * 1.01 + (x.double().abs() @ w.abs()) * 1e-5 + 1e-6
        got = torch.ops.streamgrok_cpu.int4_linear(x, layer.packed, layer.scales_and_zeros)
        plain = torch.ops.streamgrok_cpu.int4_linear(x, layer.packed, layer.scales_and_zeros,
                                                     True)
        assert ((got.double() - exact).abs() <= bound).all(), (kernel, rows)
        assert ((plain.double() - exact).abs() <= bound).all(), ("portable", rows)
        assert torch.equal(got[0], torch.zeros(out_features))
        head = Int8Linear.from_rows(QuantizedRows.of(weight, "q8"), None)
        weight8 = head.qweight.double() * head.row_scales.double()[:, None]
        bound8 = step @ weight8.abs().t() * 1.01 + (x.double().abs() @ weight8.abs().t()) * 1e-5 \
            + 1e-6
        got8 = torch.ops.streamgrok_cpu.int8_linear(x, head.qweight, head.row_scales)
        assert ((got8.double() - x.double() @ weight8.t()).abs() <= bound8).all(), kernel
    # paged decode attention: one long row, its keys split over the threads
    from streamgrok.model.config import RopeScaling
    from streamgrok.model.rotary import inverse_frequencies
    from streamgrok_kernels import paged_decode_attention
    from streamgrok_kernels.ops import KernelOps
    from streamgrok_kernels.paged_kv import PagedKV

    kv = PagedKV.zeros(64 * 16, 3, 64, torch.float32, 16)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    tables = torch.randperm(64, generator=gen)[:48].view(1, 48).int()
    angles = torch.arange(48 * 16)[:, None] * inverse_frequencies(64, 10000.0, RopeScaling())
    cos, sin = angles.float().cos(), angles.float().sin()
    q, lengths = torch.randn(1, 9, 64, generator=gen), torch.tensor([700], dtype=torch.int32)
    ops = KernelOps("torch", compiled_reads=False, native_attention=True)
    assert ops.native.wait_ready()
    ref, ref_mass = paged_decode_attention.reference(q, kv, tables, lengths, cos, sin, True)
    out, mass = ops.decode_attention(q, kv, tables, lengths, cos, sin, True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(mass, ref_mass, atol=2e-5, rtol=1e-4)
    print(kernel)
""")


@pytest.mark.parametrize("cap", ["avx2", "portable"])
def test_a_capped_build_runs_that_loop_and_gives_the_products(tmp_path, cap):
    if cap == "avx2" and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2+FMA: the AVX2 loop cannot run here")
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    result = run_script(script, {CPU_ISA_ENV: cap, "STREAMGROK_NATIVE_ATTENTION": "1"}, cap)
    assert result.stdout.strip().endswith(cap)


def test_an_unknown_cap_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(CPU_ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="native, avx2, portable"):
        isa_cap()
    monkeypatch.setenv(CPU_ISA_ENV, "AVX2")
    assert isa_cap() == "avx2"
    monkeypatch.delenv(CPU_ISA_ENV)
    assert isa_cap() == "native"
