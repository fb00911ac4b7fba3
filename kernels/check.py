"""Check the kernels on the machine at hand: correctness at production shapes against the
PyTorch references, then paged decode attention timed against PyTorch SDPA over gathered pages.

    python -m streamgrok_kernels.check            # or: streamgrok bench kernels

On CUDA the shapes are a Llama-3-8B layer (32 query heads, 8 KV heads, head_dim 128, bfloat16)
and the timing grid is batch 1/32/128 x context 4k/32k/128k; it prints achieved bandwidth as a
fraction of the device's nominal peak and of a device-to-device copy measured in the same run,
and the cost of the fused attention-mass output. Without CUDA (or with --small) it runs the
Triton interpreter on small shapes, which exercises the script, not the speed.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

# Nominal HBM bandwidth (bytes/s) by device-name fragment, most specific first.
PEAK_BANDWIDTH = [
    ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
    ("GH200", 4.0e12), ("B200", 8.0e12), ("A100-SXM4-80GB", 2.04e12), ("A100", 1.56e12),
    ("L40S", 0.864e12), ("L4", 0.3e12), ("A10", 0.6e12), ("RTX 4090", 1.0e12),
]


@dataclass(frozen=True)
class Shapes:
    """What the check runs: model shape, correctness sizes, timing grid."""

    heads: int
    kv_heads: int
    head_dim: int
    decode_lengths: int  # longest random decode context in the correctness check
    chunks: tuple[int, ...]
    pasts: tuple[int, ...]
    window: int
    append_tokens: int
    compact_tokens: int
    hidden: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]

    @staticmethod
    def production() -> Shapes:
        return Shapes(32, 8, 128, 4096, (512, 77, 300), (2048, 0, 1000), 32, 1024, 4096, 4096,
                      (1, 32, 128), (4096, 32768, 131072))

    @staticmethod
    def small() -> Shapes:
        return Shapes(4, 2, 64, 100, (20, 3, 33), (17, 0, 40), 8, 50, 90, 96, (1, 2), (64, 256))


def nominal_peak(device: torch.device) -> float | None:
    """The device's nominal memory bandwidth, when its name is in PEAK_BANDWIDTH."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for fragment, peak in PEAK_BANDWIDTH if fragment in name), None)


def measure(fn, device: torch.device, budget_s: float = 0.5, most: int = 20) -> float:
    """Median seconds per call after one warm-up call (compilation), within a time budget."""
    fn()
    times = []
    started = time.perf_counter()
    while len(times) < most and (len(times) < 3 or time.perf_counter() - started < budget_s):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            begin_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin_s)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy (read + write), the in-run baseline for bandwidth."""
    size = 2**31 if device.type == "cuda" else 2**24
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = measure(lambda: dst.copy_(src), device)
    return 2 * size / seconds


class Checker:
    """Runs each kernel against its reference on random data and prints one line per check."""

    def __init__(self, shapes: Shapes, device: torch.device) -> None:
        self.shapes = shapes
        self.device = device
        self.gen = torch.Generator().manual_seed(0)
        self.failures = 0

    def randn(self, *shape: int, dtype=torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.device, dtype)

    def report(self, name: str, got: torch.Tensor, want: torch.Tensor, tol: float,
               relative: bool = True) -> None:
        """One line: the largest difference, relative to the largest reference value unless
        `relative` is False (int8 steps, exact copies)."""
        err = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
        if relative:
            err /= max(float(want.float().abs().max()), 1e-12)
        ok = err <= tol
        self.failures += not ok
        kind = "relative" if relative else "absolute"
        print(f"  {name:44s} {kind} error {err:9.2e}  (tolerance {tol:.0e})  "
              f"{'ok' if ok else 'FAIL'}")

    def pool(self, tokens: int, kv_dtype: torch.dtype):
        from streamgrok_kernels import kv_append
        from streamgrok_kernels.paged_kv import PagedKV

        s = self.shapes
        slots = math.ceil(tokens / 16) * 16
        kv = PagedKV.zeros(slots, s.kv_heads, s.head_dim, kv_dtype, 16, self.device)
        kv_append.reference(kv, torch.arange(slots, device=self.device),
                            self.randn(slots, s.kv_heads, s.head_dim, dtype=torch.float32),
                            self.randn(slots, s.kv_heads, s.head_dim, dtype=torch.float32))
        return kv

    def tables(self, totals: list[int]) -> tuple[torch.Tensor, int]:
        pages = max(math.ceil(n / 16) for n in totals)
        order = torch.randperm(len(totals) * pages, generator=self.gen)
        return order.view(len(totals), pages).int().to(self.device), len(totals) * pages * 16

    def trig(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        dim = self.shapes.head_dim  # plain rotary frequencies at Llama 3's theta
        inv = (500000.0 ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float()
        angles = torch.outer(torch.arange(positions).float(), inv)
        return angles.cos().to(self.device), angles.sin().to(self.device)

    def run(self) -> None:
        from streamgrok_kernels import (
            kv_append,
            kv_compact,
            paged_decode_attention,
            paged_prefill_attention,
            rmsnorm,
            rotary,
        )

        s, dev = self.shapes, self.device
        rng = random.Random(0)
        for kv_dtype in (torch.bfloat16, torch.int8):
            name = str(kv_dtype).removeprefix("torch.")
            lengths = [rng.randint(1, s.decode_lengths) for _ in range(8)]
            tables, slots = self.tables(lengths)
            kv = self.pool(slots, kv_dtype)
            q = self.randn(8, s.heads, s.head_dim)
            cos, sin = self.trig(tables.shape[1] * 16)
            lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
            want, want_mass = paged_decode_attention.reference(q, kv, tables, lens, cos, sin, True)
            got, mass = paged_decode_attention.paged_decode_attention(q, kv, tables, lens, cos,
                                                                      sin, want_mass=True)
            self.report(f"paged_decode_attention {name} (8 seqs)", got, want, 1e-2)
            self.report(f"  attention mass {name}", mass, want_mass, 1e-2)

            totals = [c + p for c, p in zip(s.chunks, s.pasts)]
            tables, slots = self.tables(totals)
            kv = self.pool(slots, kv_dtype)
            q = self.randn(sum(s.chunks), s.heads, s.head_dim)
            cos, sin = self.trig(tables.shape[1] * 16)
            cu = torch.tensor([0, *itertools.accumulate(s.chunks)], dtype=torch.int32, device=dev)
            past = torch.tensor(s.pasts, dtype=torch.int32, device=dev)
            want, want_mass = paged_prefill_attention.reference(
                q, kv, tables, cu, past, cos, sin, max(s.chunks), s.window)
            got, mass = paged_prefill_attention.paged_prefill_attention(
                q, kv, tables, cu, past, cos, sin, max(s.chunks), s.window)
            self.report(f"paged_prefill_attention {name} {s.chunks}", got, want, 1e-2)
            self.report(f"  window mass {name} (last {s.window})", mass, want_mass, 1e-2)

            want_kv = self.pool(2 * s.append_tokens, kv_dtype)
            got_kv = want_kv.clone()
            slots = torch.randperm(2 * s.append_tokens, generator=self.gen)[: s.append_tokens]
            slots[::7] = -1
            slots = slots.to(dev)
            k = self.randn(s.append_tokens, s.kv_heads, s.head_dim)
            v = self.randn(s.append_tokens, s.kv_heads, s.head_dim)
            kv_append.reference(want_kv, slots, k, v)
            kv_append.kv_append(got_kv, slots, k, v)
            step = 1.0 if kv_dtype == torch.int8 else 0.0
            for label, after, expected in zip("kv", got_kv.tensors(), want_kv.tensors()):
                self.report(f"kv_append {name} ({s.append_tokens} tokens, {label})", after,
                            expected, step, relative=False)

            kv = self.pool(s.compact_tokens, kv_dtype)
            keep = torch.sort(torch.randperm(s.compact_tokens, generator=self.gen)
                              [: s.compact_tokens // 2]).values.to(dev)
            dst = torch.arange(keep.numel(), device=dev)
            want = [t[keep].clone() for t in kv.tensors()]
            kv_compact.kv_compact(kv, keep, dst)
            for label, after, expected in zip("kv", kv.tensors(), want):
                self.report(f"kv_compact {name} in place ({label})", after[: keep.numel()],
                            expected, 0.0, relative=False)

        x, r = self.randn(512, s.hidden), self.randn(512, s.hidden)
        w = self.randn(s.hidden)
        want, want_sum = rmsnorm.reference(x, w, 1e-5, r)
        got, got_sum = rmsnorm.rms_norm(x, w, 1e-5, r)
        # three bfloat16 roundings (sum, normalised, scaled) on each side
        self.report(f"rms_norm + residual bf16 (512 x {s.hidden})", got, want, 2e-2)
        self.report("  residual sum", got_sum, want_sum, 1e-2)
        q = self.randn(512, s.heads, s.head_dim)
        positions = torch.randint(0, 8192, (512,), generator=self.gen).to(dev)
        cos, sin = self.trig(8192)
        self.report(f"rotary bf16 (512 x {s.heads} x {s.head_dim})",
                    rotary.rotate(q, positions, cos, sin),
                    rotary.reference(q, positions, cos, sin), 1e-2)


def time_decode(shapes: Shapes, device: torch.device, peak: float | None, copy_bw: float) -> None:
    """The timing table: paged decode attention vs SDPA over gathered pages."""
    s = shapes
    print(f"\npaged decode attention, bf16 K/V, {s.heads} query heads / {s.kv_heads} KV heads, "
          f"head_dim {s.head_dim}; bandwidth = K+V bytes / time")
    print(f"{'batch':>5} {'context':>8} {'KV GiB':>7} {'kernel ms':>10} {'GB/s':>7} "
          f"{'% peak':>7} {'% copy':>7} {'+mass ms':>9} {'mass +%':>8} {'SDPA ms':>9} "
          f"{'speedup':>8}")
    gen = torch.Generator(device=device).manual_seed(0)
    for batch in s.batches:
        for context in s.contexts:
            print(time_decode_cell(s, device, batch, context, gen, peak, copy_bw), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()


def time_decode_cell(s: Shapes, device: torch.device, batch: int, context: int, gen,
                     peak: float | None, copy_bw: float) -> str:
    """One row of the timing table (its tensors are freed when it returns)."""
    from streamgrok_kernels import paged_decode_attention
    from streamgrok_kernels.paged_kv import PagedKV

    kv_bytes = 2 * batch * context * s.kv_heads * s.head_dim * 2
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 8 * kv_bytes
    if kv_bytes + batch * s.heads * context * 4 > 0.85 * free:  # pool + mass scores
        return f"{batch:>5} {context:>8} {kv_bytes / 2**30:>7.1f}  skipped: does not fit"
    pages = batch * context // 16
    shape = (pages * 16, s.kv_heads, s.head_dim)
    kv = PagedKV(torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(generator=gen),
                 torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(generator=gen),
                 16)
    tables = torch.randperm(pages, device=device, generator=gen).view(batch, -1).int()
    q = torch.randn(batch, s.heads, s.head_dim, device=device, generator=gen).bfloat16()
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    angles = torch.outer(torch.arange(context, device=device).float(),
                         torch.rand(s.head_dim // 2, device=device, generator=gen))
    cos, sin = angles.cos(), angles.sin()
    args = (q, kv, tables, lengths, cos, sin)
    plain = measure(lambda: paged_decode_attention.paged_decode_attention(*args), device)
    with_mass = measure(lambda: paged_decode_attention.paged_decode_attention(
        *args, want_mass=True), device)
    gathered, speedup = "skipped", ""
    if 5 * kv_bytes < 0.85 * free:  # the gathered copy and its rotation temporaries
        sdpa = measure(lambda: paged_decode_attention.reference(*args), device)
        gathered, speedup = f"{sdpa * 1e3:.2f}", f"{sdpa / plain:.1f}x"
    bandwidth = kv_bytes / plain
    share = f"{100 * bandwidth / peak:.0f}%" if peak else "n/a"
    return (f"{batch:>5} {context:>8} {kv_bytes / 2**30:>7.2f} {plain * 1e3:>10.3f} "
            f"{bandwidth / 1e9:>7.0f} {share:>7} {100 * bandwidth / copy_bw:>6.0f}% "
            f"{with_mass * 1e3:>9.3f} {100 * (with_mass / plain - 1):>7.1f}% "
            f"{gathered:>9} {speedup:>8}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streamgrok_kernels.check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true",
                        help="small shapes (the default without CUDA, under the interpreter)")
    parser.add_argument("--no-timing", action="store_true", help="correctness only")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        if any(name.startswith("streamgrok_kernels.") and name not in ("streamgrok_kernels.check",)
               for name in sys.modules) and os.environ.get("TRITON_INTERPRET") != "1":
            print("kernels were imported before TRITON_INTERPRET=1 could be set; run "
                  "`python -m streamgrok_kernels.check` in a fresh process", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
    device = torch.device("cuda" if cuda else "cpu")
    shapes = Shapes.small() if args.small or not cuda else Shapes.production()
    peak = nominal_peak(device)
    name = torch.cuda.get_device_name(device) if cuda else "CPU (Triton interpreter)"
    started = time.perf_counter()
    copy_bw = copy_bandwidth(device)
    print(f"device {name}; nominal peak "
          f"{f'{peak / 1e12:.2f} TB/s' if peak else 'unknown'}; measured copy "
          f"{copy_bw / 1e12:.3f} TB/s")
    print("correctness against the PyTorch references:")
    checker = Checker(shapes, device)
    checker.run()
    if not args.no_timing:
        time_decode(shapes, device, peak, copy_bw)
    print(f"\n{checker.failures} failed checks; {time.perf_counter() - started:.0f} s")
    return 1 if checker.failures else 0


if __name__ == "__main__":
    sys.exit(main())
