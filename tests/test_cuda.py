"""What only a CUDA device can show (skipped without one; `.ci/gpu-check` runs them): the
engine on the GPU through the real Triton kernels against the PyTorch references on the same
device, sampling with generators on the device, and step timing that waits for the device."""

from __future__ import annotations

import pytest
import torch
from helpers import queue_streaming_questions, random_model, tiny_config, write_gguf

from streamgrok.cache.config import CacheConfig
from streamgrok.runtime import StepTimer
from streamgrok_kernels.ops import KernelOps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


async def test_engine_on_cuda_triton_matches_the_references_and_samples_on_the_device(
        tmp_path):
    from streamgrok.engine import Engine, EngineConfig
    from streamgrok.loading.loader import load_model
    from streamgrok.model.sampling import SamplingParams

    config = tiny_config(hidden_size=192, num_heads=6, num_kv_heads=2, head_dim=32,
                         max_positions=4096)
    loaded = load_model(write_gguf(tmp_path / "tiny.gguf", random_model(config)),
                        torch.bfloat16, "cuda")
    cache = CacheConfig(policy="h2o", budget_tokens=96, evict_slack_tokens=16,
                        memory_gib=0.05)  # kv_dtype auto: the model's bfloat16
    answers = {}
    for backend in ("triton", "torch"):
        loaded.model.kernels = KernelOps(backend)
        async with Engine(loaded, cache, EngineConfig(merge_window_s=0)) as engine:
            assert engine.cache.pool.paged_kv().k.dtype == torch.bfloat16
            asks = await queue_streaming_questions(engine)
            sampled = engine.new_session("sys").ask("pick one", SamplingParams(
                temperature=0.8, top_p=0.9, seed=3, max_tokens=6))
            answers[backend] = [await a.text() for a in asks]
            assert await sampled.text()  # a CUDA generator drew on CUDA probabilities
            assert engine.cache.stats.evicted_tokens > 0
            assert engine.snapshot().step_ms_p50 > 0
    assert all(answers["torch"]) and answers["triton"] == answers["torch"]


def test_step_timer_waits_for_queued_device_work():
    a = torch.randn(4096, 4096, device="cuda")
    timer = StepTimer(a.device)
    timer.start()
    for _ in range(20):
        a = a @ a / 64
    seconds = timer.stop()  # the products were only queued when stop() was called
    assert seconds > 0 and torch.isfinite(a).all()


def test_kv_pool_defaults_to_a_share_of_free_device_memory():
    from streamgrok.cache.paged_cache import PagedKVCache

    free, _ = torch.cuda.mem_get_info()
    budget = PagedKVCache(tiny_config(), CacheConfig(), torch.bfloat16, "cuda",
                          num_pages=16).memory_budget_bytes()
    assert 0.7 * free < budget <= 0.8 * free
