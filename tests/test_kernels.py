"""Triton kernels against their PyTorch references, interpreted on CPU (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import torch, sys
from kernels.paged_decode_attention import paged_decode_attention, reference
from streamgrok.model.rotary import Rotary
from streamgrok.model.config import ModelConfig
torch.manual_seed(0)
cases = [  # batch, heads, kv_heads, dim, lengths, splits, kv dtype
    (1, 4, 4, 64, [5], 1, torch.float32),
    (3, 9, 3, 64, [37, 16, 70], 2, torch.float32),
    (2, 8, 1, 128, [33, 18], 3, torch.float32),
    (2, 6, 2, 64, [40, 9], 2, torch.bfloat16),
]
page = 16
for batch, heads, kvh, dim, lengths, splits, dtype in cases:
    pages = max(-(-n // page) for n in lengths)
    free = torch.randperm(batch * pages + 4)
    tables = free[: batch * pages].view(batch, pages).int()
    slots = (batch * pages + 4) * page
    k_pool = torch.randn(slots, kvh, dim).to(dtype)
    v_pool = torch.randn(slots, kvh, dim).to(dtype)
    q = torch.randn(batch, heads, dim)
    cfg = ModelConfig("llama", 10, heads * dim, 10, 1, heads, kvh, dim, rope_theta=10000.0)
    cos, sin = Rotary(cfg).cos_sin(torch.arange(pages * page))
    lens = torch.tensor(lengths, dtype=torch.int32)
    want_out, want_mass = reference(q, k_pool, v_pool, tables, lens, cos, sin, page)
    out, mass = paged_decode_attention(q, k_pool, v_pool, tables, lens, cos, sin, page,
                                       splits=splits, want_mass=True)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    torch.testing.assert_close(out, want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(mass, want_mass, atol=tol, rtol=tol)
    for b, n in enumerate(lengths):  # mass of each sequence sums to its query heads
        assert abs(float(mass[b, :n].sum()) - heads) < 1e-2 * heads
print("kernels ok", len(cases))
"""


def test_paged_decode_attention_matches_reference_interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            env=env, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
    if "No module named 'triton'" in result.stderr:
        pytest.skip("triton is not installed")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernels ok 4" in result.stdout
