"""Compiled decode steps (torch.compile of the whole step on the contiguous cache) give the
eager model's logits and cache contents; steps of another kind run eagerly; a failed
compilation turns it off without changing a result."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import (
    assert_a_step_falls_back_eagerly,
    eager_decode,
    eagerly_prefilled,
    random_model,
    skip_unless_int4_vectorized,
    tiny_config,
    write_gguf,
)

from streamgrok.loading.loader import load_model
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.compiled_decode import (
    COMPILED_DECODE_ENV,
    NATIVE_ATTENTION_ENV,
    CompiledDecode,
)
from streamgrok.model.contiguous_cache import ContiguousKVCache
from streamgrok.model.quantized import Int4Linear, quantize_model


@pytest.fixture(scope="module", params=["f32", "q4", "q4 native", "w8a8", "f32 loops",
                                        "q4 native kv8", "f32 loops kv8"])
def compiled_model(request, tmp_path_factory):
    """A tiny model whose decode steps are compiled (once for the module's tests) and the
    K/V dtype of the caches they serve; its attention by the native CPU kernel, or ("loops")
    by inductor's product-sum loops; q4's matmuls by PyTorch's int4 kernel, or ("native") by
    the native one; K/V float32, or ("kv8") int8 with scales."""
    weights, *flags = request.param.split(" ")
    variant = flags[0] if flags else ""
    loops = variant == "loops"
    kv_dtype = torch.int8 if "kv8" in flags else torch.float32
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(NATIVE_ATTENTION_ENV, "1" if variant == "native" else "0")
        if weights == "w8a8":  # calibrated as it loads
            path = write_gguf(tmp_path_factory.mktemp("w8a8") / "tiny.gguf",
                              random_model(tiny_config()))
            model = load_model(path, weights="w8a8").model
        else:
            model = quantize_model(random_model(tiny_config()), weights)
        if variant == "native":
            layer = next(m for m in model.modules() if isinstance(m, Int4Linear))
            skip_unless_int4_vectorized(layer.int4_matmul.wait_ready(timeout=900),
                                        layer.int4_matmul.native.error)
    model.compiled_decode = CompiledDecode(enabled=True)
    cache = ContiguousKVCache(model.config, 1, 40, kv_dtype)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(NATIVE_ATTENTION_ENV, "0" if loops else "1")
        with torch.inference_mode():
            model(torch.tensor([5, 6, 7]), BatchMetadata.build([0], [3]), cache)
            model(torch.tensor([8]), BatchMetadata.build([0], [1]), cache)  # starts compiling
        decode = model.compiled_decode
        assert decode.wait_compiled(timeout=900), decode.compile_error
    assert decode.native_attention == (not loops)
    if variant == "native":
        layer = next(m for m in model.modules() if isinstance(m, Int4Linear))
        assert layer.int4_matmul.in_use, "the native int4 kernel is off"
    return model, weights, kv_dtype


def same_cache(a: ContiguousKVCache, b: ContiguousKVCache) -> bool:
    """Same lengths and K/V (int8: within one level, a rounding tie computed apart)."""
    if a.k_scales is None:
        return a.lengths == b.lengths and all(
            torch.allclose(x, y, atol=1e-5) for x, y in zip(a.k + a.v, b.k + b.v))
    return a.lengths == b.lengths and all(
        (x.int() - y.int()).abs().max() <= 1 for x, y in zip(a.k + a.v, b.k + b.v)) and all(
        torch.allclose(x, y, rtol=5e-3) for x, y in zip(a.k_scales + a.v_scales,
                                                       b.k_scales + b.v_scales))


@pytest.mark.parametrize(("slots", "capacity"), [(1, 23), (1, 61), (3, 30), (5, 47)])
def test_compiled_steps_equal_eager_steps(compiled_model, slots, capacity):
    model, weights, kv_dtype = compiled_model
    compiled = eagerly_prefilled(model, slots, capacity, kv_dtype)
    reference = eagerly_prefilled(model, slots, capacity, kv_dtype)
    decode = model.compiled_decode
    before, fallbacks = decode.compiled_steps, decode.eager_fallbacks
    batch = BatchMetadata.build(list(range(slots)), [1] * slots)
    gen = torch.Generator().manual_seed(slots)
    # q4 runs its matmuls on bfloat16; int8 K/V computed apart may round a tie apart
    tolerance = 0.05 if weights != "f32" else 1e-4 if kv_dtype == torch.float32 else 5e-3
    with torch.inference_mode():
        for _ in range(6):  # every cache size and batch from the stand-ins' graphs
            ids = torch.randint(0, model.config.vocab_size, (slots,), generator=gen)
            got = model(ids, batch, compiled)
            with eager_decode(model):
                want = model(ids, batch, reference)
            torch.testing.assert_close(got, want, atol=tolerance, rtol=0.01)
    assert decode.compiled_steps == before + 6
    assert decode.eager_fallbacks == fallbacks  # no recompilation was needed
    if weights == "f32":
        assert same_cache(compiled, reference)


def test_other_steps_run_eagerly(compiled_model):
    model, _, kv_dtype = compiled_model
    decode = model.compiled_decode
    cache, reference = (eagerly_prefilled(model, 3, 30, kv_dtype) for _ in range(2))
    before = decode.compiled_steps
    with torch.inference_mode():
        # a prefill chunk, and a decode step of some of the cache's sequences
        for batch, ids in ((BatchMetadata.build([1], [2]), torch.tensor([3, 4])),
                           (BatchMetadata.build([0, 2], [1, 1]), torch.tensor([5, 6]))):
            got = model(ids, batch, cache)
            with eager_decode(model):
                want = model(ids, batch, reference)
            torch.testing.assert_close(got, want)
    assert decode.compiled_steps == before
    assert cache.lengths == reference.lengths == [4, 9, 12]


def test_a_cache_the_graph_does_not_fit_decodes_eagerly(compiled_model):
    model, _, _ = compiled_model
    # the stand-ins were float32 or int8
    assert_a_step_falls_back_eagerly(model, torch.bfloat16)


def test_a_failed_compilation_turns_compiled_decode_off(caplog):
    model = random_model(tiny_config())
    decode = model.compiled_decode = CompiledDecode(enabled=True)

    def broken(*args):
        raise RuntimeError("no C++ compiler")

    decode._function = broken
    cache, reference = eagerly_prefilled(model, 1, 20), eagerly_prefilled(model, 1, 20)
    batch = BatchMetadata.build([0], [1])
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        model(torch.tensor([4]), batch, cache)
        assert not decode.wait_compiled(timeout=60)
        got = model(torch.tensor([5]), batch, cache)
    with torch.inference_mode(), eager_decode(model):
        model(torch.tensor([4]), batch, reference)
        want = model(torch.tensor([5]), batch, reference)
    torch.testing.assert_close(got, want)
    assert not decode.enabled and "no C++ compiler" in decode.compile_error
    assert "compiled decode off" in caplog.text


def test_the_environment_turns_compiled_decode_off(monkeypatch):
    monkeypatch.setenv(COMPILED_DECODE_ENV, "0")
    assert not CompiledDecode().enabled
    monkeypatch.setenv(COMPILED_DECODE_ENV, "1")
    assert CompiledDecode().enabled
