"""Shared fixtures: the real SmolLM2 (loaded once) and tiny random models."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Compiled paged reads cost seconds of compiling in every test process (servers, workers);
# tests/test_paged_read.py turns them on explicitly and checks them against eager reads.
os.environ.setdefault("STREAMGROK_COMPILED_READS", "0")
# Likewise compiled decode steps; tests/test_compiled_decode.py turns them on.
os.environ.setdefault("STREAMGROK_COMPILED_DECODE", "0")
# Likewise the native CPU attention kernels: built in the background, they would take over a
# test's attention mid-way; tests/test_cpu_attention.py, test_cpu_paged_attention.py and
# test_compiled_decode.py turn them on and check them against the PyTorch references.
os.environ.setdefault("STREAMGROK_NATIVE_ATTENTION", "0")
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
import torch  # noqa: E402

from streamgrok.inductor_cache import separate_inductor_cache  # noqa: E402
from streamgrok.runtime import steady_host_allocator  # noqa: E402

steady_host_allocator()
# a run under ATEN_CPU_CAPABILITY (testing an AVX2-only CPU's path) keeps its compiled graphs apart
separate_inductor_cache()

if not torch.cuda.is_available():
    # Triton kernels run interpreted on CPU tensors; must be set before kernels are imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def native_int4():
    """The native int4 matmul switch, built (its int8 head kernel is in the same build)."""
    from streamgrok_kernels.cpu_int4 import Int4Matmul

    matmul = Int4Matmul(enabled=True)
    matmul.wait_ready()
    assert matmul.native.error is None, f"the native kernels did not build: {matmul.native.error}"
    return matmul


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct GGUF, float32, loaded once per test run."""
    from streamgrok.loading.loader import load_model

    return load_model(dtype=torch.float32)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny random Llama (4096 positions) written as a GGUF file, once per test module."""
    from helpers import random_model, tiny_config, write_gguf

    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    return write_gguf(path, random_model(tiny_config(max_positions=4096)))


@pytest.fixture(scope="module")
def tiny_loaded(tiny_gguf):
    """`tiny_gguf` loaded like a real model, once per test module."""
    from streamgrok.loading.loader import load_model

    return load_model(tiny_gguf)


@pytest.fixture
def tiny():
    """A tiny random Llama (2 layers, GQA 4:2, head dim 16)."""
    from helpers import random_model, tiny_config

    return random_model(tiny_config())
