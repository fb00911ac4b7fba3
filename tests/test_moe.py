"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against transformers
on tiny random models: the logits of a prompt and greedy continuations."""

from __future__ import annotations

import asyncio

import gguf
import pytest
import torch
from moe_helpers import LAYOUTS, hf_moe_model, write_hf_moe_folder, write_moe_gguf

from streamgrok.cache.config import CacheConfig
from streamgrok.engine import Engine, EngineConfig
from streamgrok.loading.loader import load_model
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.contiguous_cache import ContiguousKVCache
from streamgrok.model.generate import Generator
from streamgrok.model.moe import MoEFeedForward
from streamgrok.model.sampling import SamplingParams

pytest.importorskip("transformers")
IDS = [5, 77, 3, 120, 9, 250, 31, 64, 2, 17, 88, 140, 7, 33]


def logits_of(model, ids):
    batch = BatchMetadata.build([0], [len(ids)])
    batch.logit_rows = None
    return model(torch.tensor(ids), batch, ContiguousKVCache(model.config, 1, len(ids)))


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request, tmp_path_factory):
    reference = hf_moe_model(request.param)
    folder = write_hf_moe_folder(tmp_path_factory.mktemp(request.param), reference)
    return request.param, reference, folder


@pytest.mark.parametrize("fuse", [False, True])
def test_prompt_logits_equal_transformers(layout, fuse):
    name, reference, folder = layout
    loaded = load_model(folder, fuse=fuse)
    assert loaded.config.architecture == name and loaded.config.moe is not None
    with torch.no_grad():
        want = reference(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(logits_of(loaded.model, IDS), want, atol=1e-4, rtol=1e-4)


def test_greedy_continuations_equal_transformers(layout):
    _, reference, folder = layout
    loaded = load_model(folder)
    prompts = [IDS[:6], IDS[3:12]]
    got = Generator(loaded, max_batch=2, capacity=64).generate(
        prompts, SamplingParams(max_tokens=12, stop_token_ids=frozenset()))
    for prompt, generation in zip(prompts, got):
        with torch.no_grad():
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=12,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
        assert generation.token_ids == want[0, len(prompt):].tolist()


def test_the_router_choices_of_each_token_are_recorded(layout):
    _, reference, folder = layout
    loaded = load_model(folder)
    logits_of(loaded.model, IDS)
    moe_layers = [b.ffn for b in loaded.model.layers if isinstance(b.ffn, MoEFeedForward)]
    assert moe_layers
    for ffn in moe_layers:
        routing = ffn.last_routing
        assert routing.experts.shape == (len(IDS), ffn.top_k)
        assert len(set(routing.experts[:, 0].tolist())) > 1  # tokens go to different experts
        assert int(ffn.tokens_per_expert.sum()) == len(IDS) * ffn.top_k
        if ffn.normalize:
            torch.testing.assert_close(routing.weights.sum(-1), torch.ones(len(IDS)))


def test_gguf_logits_equal_transformers(layout, tmp_path):
    name, reference, _ = layout
    loaded = load_model(write_moe_gguf(tmp_path / f"{name}.gguf", reference, name))
    assert loaded.config.architecture == name
    with torch.no_grad():
        want = reference(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(logits_of(loaded.model, IDS), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("weights", ["auto", "q8", "q4"])
def test_a_quantized_gguf_loads_and_decodes(layout, tmp_path, weights):
    """Q8_0 experts, stored as int8 or int4 rows or dequantized: logits close to the float
    model's, and a greedy answer decodes."""
    name, reference, _ = layout
    path = write_moe_gguf(tmp_path / "q8.gguf", reference, name, gguf.GGMLQuantizationType.Q8_0)
    loaded = load_model(path, weights=weights)
    with torch.no_grad():
        want = reference(torch.tensor([IDS])).logits[0]
    cos = torch.nn.functional.cosine_similarity(logits_of(loaded.model, IDS), want, -1)
    assert cos.min() >= (0.93 if weights == "q4" else 0.999)
    answer = Generator(loaded, capacity=64).generate([IDS], SamplingParams(max_tokens=8))[0]
    assert len(answer.token_ids) >= 1


@pytest.mark.parametrize("weights", ["auto", "q4"])
async def test_engine_sessions_batched_equal_sessions_alone(tmp_path, weights):
    """Live sessions on the paged cache, decoded together (tokens of several sessions
    grouped by expert) and one at a time: the same answers."""
    reference = hf_moe_model("qwen2_moe")
    loaded = load_model(write_hf_moe_folder(tmp_path / "m", reference), weights=weights)
    cache = CacheConfig(policy="h2o", budget_tokens=96, memory_gib=0.01)
    greedy = SamplingParams(max_tokens=10)
    work = [(f"note {i} " * (i + 2), f"question {i}?") for i in range(4)]

    async def alone(note, question):
        async with Engine(loaded, cache, EngineConfig(merge_window_s=0)) as engine:
            session = engine.new_session("sys")
            await session.append_message(note)
            return await session.ask(question, greedy).text()

    expected = [await alone(note, question) for note, question in work]
    async with Engine(loaded, cache, EngineConfig(merge_window_s=0.01)) as engine:
        sessions = [engine.new_session("sys") for _ in work]
        for session, (note, _) in zip(sessions, work):
            await session.append_message(note)
        together = await asyncio.gather(*(s.ask(q, greedy).text()
                                          for s, (_, q) in zip(sessions, work)))
        assert max(r.sequences for r in engine.stats.recent) > 1  # really batched
    assert together == expected
