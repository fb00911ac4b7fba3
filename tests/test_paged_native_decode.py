"""Decode steps over the engine's paged cache as one native call (`PagedNativeDecode`) give
the layer-by-layer model's logits, page contents and attention-mass scores, on float32,
bfloat16 and int8 pools, with q/k/v biases, sequences of different lengths sharing pages,
and eviction between steps; steps it does not serve run layer by layer."""

from __future__ import annotations

import pytest
import torch
from helpers import eager_decode, random_model, skip_unless_int4_vectorized, tiny_config

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.config import MoEConfig
from streamgrok.model.llama import fuse_projections
from streamgrok.model.native_decode import PagedNativeDecode
from streamgrok.model.quantized import Int4Linear, quantize_model, wait_native_int4
from streamgrok_kernels.ops import KernelOps

VOCAB = 320


def q4_model(bias: bool, config=None):
    """A tiny fused q4 model (`config`, default a Llama) on the native int4 kernel, its paged
    steps native."""
    config = config or tiny_config(vocab_size=VOCAB, attention_bias=bias)
    model = quantize_model(fuse_projections(random_model(config)), "q4")
    layer = next(m for m in model.modules() if isinstance(m, Int4Linear))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STREAMGROK_NATIVE_ATTENTION", "1")  # the suite's default is off
        layer.int4_matmul.native.enabled = True
        skip_unless_int4_vectorized(wait_native_int4(model, timeout=900),
                                    layer.int4_matmul.native.error)
    model.paged_native = PagedNativeDecode(enabled=True)
    return model


def paged_cache(model, kv_dtype: str, policy: str, budget: int | None) -> PagedKVCache:
    config = CacheConfig(policy=policy, budget_tokens=budget, kv_dtype=kv_dtype, page_size=16,
                         window_tokens=8 if budget else None, evict_slack_tokens=0)
    # the oracle's attention: PyTorch's paged reference, not the native kernel the step calls
    return PagedKVCache(model.config, config, num_pages=96,
                        kernels=KernelOps("torch", compiled_reads=False, native_attention=False))


def prefilled(model, cache: PagedKVCache, lengths: list[int]) -> None:
    """Sequences of `lengths` random tokens, the second forked from the first (shared
    pages), prefilled layer by layer."""
    gen = torch.Generator().manual_seed(sum(lengths))
    with torch.inference_mode(), eager_decode(model):
        for seq, n in enumerate(lengths):
            if seq == 1:
                cache.fork(0, 1)
                n -= lengths[0]
            cache.add_sequence(seq) if seq != 1 else None
            ids = torch.randint(0, VOCAB, (n,), generator=gen)
            model(ids, BatchMetadata.build([seq], [n]), cache.attention)


@pytest.mark.parametrize(("kv_dtype", "bias", "policy", "budget", "sequences"), [
    ("float32", False, "full", None, 4),
    ("int8", False, "h2o", 40, 4),
    ("bfloat16", True, "h2o", 200, 4),
    ("int8", True, "redundancy", 40, 4),
    ("float32", False, "full", None, 17),  # a batch whose head the caller multiplies
])
def test_native_paged_steps_equal_layer_by_layer_steps(kv_dtype, bias, policy, budget,
                                                        sequences):
    model = q4_model(bias)
    # sequence 1 extends sequence 0's pages
    lengths = [5, 21, 36, 50, *(3 + 2 * i for i in range(sequences - 4))]
    native, reference = (paged_cache(model, kv_dtype, policy, budget) for _ in range(2))
    for cache in (native, reference):
        prefilled(model, cache, lengths)
    seqs = list(range(len(lengths)))
    gen = torch.Generator().manual_seed(7)
    evicted = 0
    with torch.inference_mode():
        for step in range(12):
            ids = torch.randint(0, VOCAB, (len(seqs),), generator=gen)
            native.reserve({s: 1 for s in seqs})
            got = model(ids, BatchMetadata.build(seqs, [1] * len(seqs)), native.attention)
            native.commit()
            reference.reserve({s: 1 for s in seqs})
            with eager_decode(model):
                want = model(ids, BatchMetadata.build(seqs, [1] * len(seqs)), reference.attention)
            reference.commit()
            # the int4 kernel quantizes its activations, which a last-bit difference upstream
            # (a norm summed in another order) can move by a level
            torch.testing.assert_close(got, want, atol=0.05, rtol=0.01)
            if budget is not None and step % 4 == 3:
                count = native.evict()
                assert reference.evict() == count
                evicted += count
    assert model.paged_native.steps == 12 and model.paged_native.fallbacks == 0
    assert evicted > 0 or budget is None or budget > max(lengths) + 12
    for seq in seqs:
        for got_rec, want_rec in zip(native.sequences[seq].layers,
                                     reference.sequences[seq].layers, strict=True):
            assert got_rec.length == want_rec.length
            torch.testing.assert_close(got_rec.score, want_rec.score, atol=0.02, rtol=0.02)
            slots = got_rec.slots(0, got_rec.length)
            assert torch.equal(slots, want_rec.slots(0, want_rec.length))
            got_k, got_v = native.pool.paged_kv().read(slots, torch.float32)
            want_k, want_v = reference.pool.paged_kv().read(slots, torch.float32)
            tolerance = 0.03 if kv_dtype != "float32" else 0.01  # a level or a rounding apart
            torch.testing.assert_close(got_k, want_k, atol=tolerance, rtol=tolerance)
            torch.testing.assert_close(got_v, want_v, atol=tolerance, rtol=tolerance)


def test_steps_it_does_not_serve_run_layer_by_layer():
    model = q4_model(bias=False)
    cache = paged_cache(model, "float32", "full", None)
    prefilled(model, cache, [9, 20])
    with torch.inference_mode():
        model(torch.tensor([3, 4, 5]),
            BatchMetadata.build([0, 1], [2, 1]), cache.attention)  # prefill
        batch = BatchMetadata.build([0], [1])
        batch.embed_rows = torch.tensor([0])  # a frame's embedding
        batch.embed_values = torch.zeros(1, model.config.hidden_size)
        model(torch.tensor([6]), batch, cache.attention)
        assert model.paged_native.steps == 0
        model(torch.tensor([7, 8]), BatchMetadata.build([0, 1], [1, 1]), cache.attention)
    assert model.paged_native.steps == 1


def test_a_float_model_never_takes_the_native_step():
    model = fuse_projections(random_model(tiny_config(vocab_size=VOCAB)))
    model.paged_native = PagedNativeDecode(enabled=True)
    cache = paged_cache(model, "float32", "full", None)
    prefilled(model, cache, [9, 20])
    with torch.inference_mode():
        model(torch.tensor([7, 8]), BatchMetadata.build([0, 1], [1, 1]), cache.attention)
    assert model.paged_native.steps == 0 and model.paged_native.step is None


async def test_the_engine_decodes_natively_while_other_sessions_stream(tiny_gguf):
    """Answers decode as one native call per step even in steps that also prefill another
    session's stream: the runner runs a step's decode tokens as a pass of their own."""
    import asyncio

    from streamgrok.engine import Engine, EngineConfig
    from streamgrok.loading.loader import load_model
    from streamgrok.model.sampling import SamplingParams

    loaded = load_model(tiny_gguf, weights="q4")
    layer = next(m for m in loaded.model.modules() if isinstance(m, Int4Linear))
    layer.int4_matmul.native.enabled = True
    skip_unless_int4_vectorized(wait_native_int4(loaded.model, timeout=900),
                                layer.int4_matmul.native.error)
    whole = loaded.model.paged_native = PagedNativeDecode(enabled=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    async with Engine(loaded, CacheConfig(budget_tokens=512, memory_gib=0.05),
                      EngineConfig(merge_window_s=0)) as engine:
        asking, streaming = engine.new_session("sys"), engine.new_session("sys")
        await asking.append_message("a note about the kitchen")
        await asking.ask("warm up", SamplingParams(max_tokens=2)).text()
        assert whole.step is not None  # chosen once the model was seen to fit
        before = whole.steps
        split = []
        original = engine.runner.split
        engine.runner.split = lambda spans: split.append(original(spans)) or split[-1]

        answer = asking.ask("what happened?", greedy)
        answering = asyncio.ensure_future(answer.text())
        for i in range(2000):  # notes stream in for as long as the answer decodes
            if answering.done():
                break
            await streaming.append_message(f"note {i}: " + "words " * 9)
            await asyncio.sleep(0.002)
        text = await answering
        assert answer.metrics.finish_reason in ("stop", "length") and text is not None
    assert whole.steps > before and whole.fallbacks == 0
    mixed = [groups for groups in split if len(groups) == 2]
    assert mixed, "no step mixed an answer's decode with another session's prefill"


@pytest.mark.parametrize("layout", ["mixtral", "qwen2_moe"])
def test_native_paged_steps_of_a_mixture_equal_layer_by_layer_steps(layout):
    """Experts (and a gated shared expert, a dense layer) inside the native step: the
    eager model's logits, step after step, several sequences choosing different experts."""
    moe = MoEConfig(num_experts=6, experts_per_token=2, expert_intermediate_size=32,
                    normalize_weights=layout == "mixtral",
                    shared_intermediate_size=32 if layout == "qwen2_moe" else 0,
                    shared_gated=layout == "qwen2_moe",
                    dense_layers=(1,) if layout == "qwen2_moe" else ())
    config = tiny_config(vocab_size=VOCAB, architecture=layout, num_layers=3, moe=moe,
                         attention_bias=layout == "qwen2_moe")
    model = q4_model(False, config)
    native, reference = (paged_cache(model, "float32", "full", None) for _ in range(2))
    lengths = [5, 21, 36, 50, 9, 13]
    for cache in (native, reference):
        prefilled(model, cache, lengths)
    seqs = list(range(len(lengths)))
    gen = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        for _ in range(8):
            ids = torch.randint(0, VOCAB, (len(seqs),), generator=gen)
            got = model(ids, BatchMetadata.build(seqs, [1] * len(seqs)), native.attention)
            with eager_decode(model):
                want = model(ids, BatchMetadata.build(seqs, [1] * len(seqs)), reference.attention)
            torch.testing.assert_close(got, want, atol=0.05, rtol=0.01)
    assert model.paged_native.steps == 8 and model.paged_native.fallbacks == 0
    # both caches' prefills (the second sequence forked from the first), the native steps
    # and the layer-by-layer ones all counted their tokens' two choices
    tokens = 2 * (sum(lengths) - lengths[0]) + 2 * 8 * len(seqs)
    for block in model.layers:
        if hasattr(block.ffn, "router"):
            assert int(block.ffn.tokens_per_expert.sum()) == 2 * tokens
    chosen = {int(e) for block in model.layers if hasattr(block.ffn, "router")
              for e in block.ffn.last_routing.experts.flatten()}
    assert len(chosen) > 2  # the eager steps' rows went to several experts
