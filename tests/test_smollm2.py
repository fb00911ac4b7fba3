"""The real SmolLM2-135M-Instruct: answers, streaming, batching, the command line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from streamgrok.model.generate import Generator
from streamgrok.model.sampling import SamplingParams

pytestmark = pytest.mark.integration


def test_greedy_answer_names_paris(smollm2):
    gen = Generator(smollm2, capacity=256)
    prompt = gen.chat_prompt("What is the capital of France?")
    deltas = list(gen.stream(prompt, SamplingParams(max_tokens=40)))
    answer = "".join(deltas)
    assert "Paris" in answer
    assert len(deltas) > 3  # streamed, token by token


def test_an_int8_cache_answers_the_same_question(smollm2):
    gen = Generator(smollm2, capacity=256, kv_dtype=torch.int8)
    assert gen.cache.k[0].dtype == torch.int8 and gen.cache.k_scales is not None
    prompt = gen.chat_prompt("What is the capital of France?")
    assert "Paris" in "".join(gen.stream(prompt, SamplingParams(max_tokens=40)))


def test_batched_generation_equals_single(smollm2):
    gen = Generator(smollm2, max_batch=3, capacity=256)
    questions = ["What is the capital of France?", "Name a primary colour.", "What is 2+2?"]
    prompts = [gen.chat_prompt(q) for q in questions]
    params = SamplingParams(max_tokens=12)
    together = gen.generate(prompts, params)
    alone = [gen.generate([p], params)[0] for p in prompts]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]


def test_max_tokens_and_stop(smollm2):
    gen = Generator(smollm2, capacity=256)
    prompt = gen.chat_prompt("What is the capital of France?")
    short = gen.generate([prompt], SamplingParams(max_tokens=3))[0]
    assert len(short.token_ids) == 3 and short.finish_reason == "length"
    full = gen.generate([prompt], SamplingParams(max_tokens=64))[0]
    assert full.finish_reason == "stop" and full.token_ids[-1] in smollm2.tokenizer.stop_ids


def test_seeded_sampling_is_reproducible(smollm2):
    gen = Generator(smollm2, capacity=256)
    prompt = gen.chat_prompt("Tell me a word.")
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=11, max_tokens=8)
    first, second = (gen.generate([prompt], params)[0].token_ids for _ in range(2))
    assert first == second


def run_cli(*args: str, as_users_run_it: bool = False) -> subprocess.CompletedProcess:
    """The command line in a subprocess; `as_users_run_it`: without the suite's switches
    that keep the native kernels and compiled steps off (conftest.py)."""
    env = dict(os.environ)
    if as_users_run_it:
        for name in ("STREAMGROK_NATIVE_ATTENTION", "STREAMGROK_COMPILED_DECODE",
                     "STREAMGROK_COMPILED_READS"):
            env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "streamgrok", *args], capture_output=True, text=True,
        timeout=420, env=env)


def test_cli_chat_and_info():
    # the default path (the native int4 kernels, built first if need be)
    chat = run_cli("chat", "What is the capital of France?", "--max-tokens", "30",
                   as_users_run_it=True)
    assert chat.returncode == 0, chat.stderr
    assert "Paris" in chat.stdout
    # the suite's switches keep PyTorch's kernels: the path of a CPU whose native kernels are
    # still building or not vectorized, where a bfloat16 head once tied "The" with "L"
    int8 = run_cli("chat", "What is the capital of France?", "--max-tokens", "30",
                   "--kv-dtype", "int8")
    assert int8.returncode == 0, int8.stderr
    assert "Paris" in int8.stdout
    info = run_cli("info", "--memory")
    assert info.returncode == 0, info.stderr
    assert "llama" in info.stdout and "30 / 576 / 1536" in info.stdout
    assert "int4 matmul" in info.stdout  # q4, the CPU default, names the kernel it runs
    for row in ("memory: torch and libraries", "memory: model", "memory: KV page pool",
                "memory: total"):
        assert row in info.stdout
    assert "memory: transcriber (base)" in info.stdout or "memory: speech models" in info.stdout


def test_cli_bad_model_path_is_a_clear_error(tmp_path):
    result = run_cli("chat", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert result.returncode == 2
    assert "model not found" in result.stderr and "Traceback" not in result.stderr
