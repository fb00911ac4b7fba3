"""The native decode step (an int4 model's whole decode step as one C++ call) gives the eager
model's logits and cache contents, is taken instead of compiling where the model fits it,
refuses what it cannot take (the step then runs eagerly), and a process decoding with it
never imports the compiler or Triton."""

from __future__ import annotations

import textwrap

import pytest
import torch
from helpers import (
    assert_a_step_falls_back_eagerly,
    eager_decode,
    eagerly_prefilled,
    random_model,
    run_script,
    skip_unless_int4_vectorized,
    tiny_config,
)

from streamgrok.model.batch import BatchMetadata
from streamgrok.model.compiled_decode import NATIVE_ATTENTION_ENV, CompiledDecode
from streamgrok.model.config import MoEConfig
from streamgrok.model.contiguous_cache import ContiguousKVCache
from streamgrok.model.llama import fuse_projections
from streamgrok.model.native_decode import native_step_fits
from streamgrok.model.quantized import (
    Int4Linear,
    Int8Linear,
    quantize_model,
    wait_native_int4,
)

VOCAB = 320  # whole blocks of 64 output rows: the head is a native int4 layer


def q4_model(bias: bool = False, vocab: int = VOCAB, int4_head: bool = False, config=None):
    """A tiny fused q4 model (`config`, default a Llama) on the native int4 kernel (its head
    int8, as q4's is, or int4)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(NATIVE_ATTENTION_ENV, "1")
        config = config or tiny_config(vocab_size=vocab, attention_bias=bias)
        model = quantize_model(fuse_projections(random_model(config)), "q4")
    layer = next(m for m in model.modules() if isinstance(m, Int4Linear))
    if int4_head:
        model.output = Int4Linear(model.output.dequantized(), None,
                                  int4_matmul=layer.int4_matmul)
    skip_unless_int4_vectorized(wait_native_int4(model, timeout=900),
                                layer.int4_matmul.native.error)
    return model


@pytest.fixture(scope="module", params=["kv32", "kv8", "kv8 bias", "bf16", "kv32 int4head"])
def native_model(request):
    """A q4 model whose decode steps run natively, and its caches' K/V dtype."""
    kv_name, *flags = request.param.split(" ")
    kv_dtype = {"kv32": torch.float32, "kv8": torch.int8, "bf16": torch.bfloat16}[kv_name]
    model = q4_model(bias="bias" in flags, int4_head="int4head" in flags)
    model.compiled_decode = CompiledDecode(enabled=True)
    cache = ContiguousKVCache(model.config, 1, 40, kv_dtype)
    decode = model.compiled_decode
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        patch.setenv(NATIVE_ATTENTION_ENV, "1")  # the suite's default is off
        model(torch.tensor([5, 6, 7]), BatchMetadata.build([0], [3]), cache)
        model(torch.tensor([8]), BatchMetadata.build([0], [1]), cache)  # starts choosing
        assert decode.wait_compiled(timeout=900), decode.compile_error
    assert decode.native_step is not None, "the native step was not taken"
    return model, kv_dtype


# 17 sequences: past the rows a thread takes at least, so the loops between matmuls split
@pytest.mark.parametrize(("slots", "capacity"), [(1, 23), (3, 30), (5, 47), (17, 80)])
def test_native_steps_equal_eager_steps(native_model, slots, capacity):
    model, kv_dtype = native_model
    native, reference = (eagerly_prefilled(model, slots, capacity, kv_dtype) for _ in range(2))
    decode = model.compiled_decode
    before, fallbacks = decode.compiled_steps, decode.eager_fallbacks
    batch = BatchMetadata.build(list(range(slots)), [1] * slots)
    gen = torch.Generator().manual_seed(slots)
    with torch.inference_mode():
        for _ in range(6):
            ids = torch.randint(0, VOCAB, (slots,), generator=gen)
            got = model(ids, batch, native)
            with eager_decode(model):
                want = model(ids, batch, reference)
            # the int4 kernel quantizes its activations, which a last-bit difference upstream
            # (a norm summed in another order) can move by a level
            torch.testing.assert_close(got, want, atol=0.05, rtol=0.01)
    assert decode.compiled_steps == before + 6 and decode.eager_fallbacks == fallbacks
    assert native.lengths == reference.lengths
    for got, want in zip(native.k + native.v, reference.k + reference.v, strict=True):
        if kv_dtype == torch.int8:  # within a level: a rounding tie computed apart
            assert (got.int() - want.int()).abs().max() <= 1
        else:
            torch.testing.assert_close(got.float(), want.float(), atol=0.02, rtol=0.02)
    if kv_dtype == torch.int8:
        for got, want in zip(native.k_scales + native.v_scales,
                             reference.k_scales + reference.v_scales, strict=True):
            torch.testing.assert_close(got, want, atol=0, rtol=5e-3)


def mixture_config():
    """A tiny Mixtral-like model's config: 6 experts, 2 per token."""
    moe = MoEConfig(num_experts=6, experts_per_token=2, expert_intermediate_size=32,
                    normalize_weights=True)
    return tiny_config(vocab_size=VOCAB, architecture="mixtral", num_layers=2, moe=moe)


def test_a_mixture_decodes_natively_on_the_contiguous_cache():
    """`chat`'s cache: a q4 mixture's steps run as the native step (experts grouped inside
    it), with the eager model's logits."""
    model = q4_model(config=mixture_config())
    model.compiled_decode = decode = CompiledDecode(enabled=True)
    native, reference = (eagerly_prefilled(model, 3, 30) for _ in range(2))
    batch = BatchMetadata.build([0, 1, 2], [1] * 3)
    gen = torch.Generator().manual_seed(5)
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        patch.setenv(NATIVE_ATTENTION_ENV, "1")
        model(torch.tensor([1, 2, 3]), batch, native)  # starts choosing
        assert decode.wait_compiled(timeout=900), decode.compile_error
        with eager_decode(model):
            model(torch.tensor([1, 2, 3]), batch, reference)
        for _ in range(4):
            ids = torch.randint(0, VOCAB, (3,), generator=gen)
            got = model(ids, batch, native)
            with eager_decode(model):
                want = model(ids, batch, reference)
            torch.testing.assert_close(got, want, atol=0.05, rtol=0.01)
    assert decode.native_step is not None and decode.compiled_steps == 4


def test_a_mixture_the_native_step_does_not_fit_decodes_layer_by_layer():
    """A float mixture is never traced (the grouping by expert depends on the values):
    its steps stay eager, and `wait_compiled` says none are compiled."""
    model = fuse_projections(random_model(mixture_config()))
    model.compiled_decode = decode = CompiledDecode(enabled=True)
    cache = eagerly_prefilled(model, 1, 12)
    with torch.inference_mode():
        first = model(torch.tensor([4]), BatchMetadata.build([0], [1]), cache)
        assert not decode.wait_compiled(timeout=900) and decode.compile_error is None
        second = model(torch.tensor([5]), BatchMetadata.build([0], [1]), cache)
    assert first.shape == second.shape == (1, VOCAB)
    assert decode.compiled_steps == 0 and decode.eager_fallbacks == 0


def test_a_cache_the_native_step_does_not_take_decodes_eagerly(native_model):
    model, _ = native_model
    assert_a_step_falls_back_eagerly(model, torch.float16)


def test_which_models_fit_the_native_step():
    model = q4_model()
    assert native_step_fits(model, torch.int8) and native_step_fits(model, torch.float32)
    assert not native_step_fits(model, torch.float16)  # no native attention for it
    assert isinstance(model.output, Int8Linear)  # q4's head is int8: any vocabulary fits
    assert native_step_fits(q4_model(vocab=VOCAB - 16), torch.int8)
    assert native_step_fits(q4_model(int4_head=True), torch.int8)
    # an int4 head fits in whole blocks of 64 rows only
    assert not native_step_fits(q4_model(vocab=VOCAB - 16, int4_head=True), torch.int8)
    float_model = fuse_projections(random_model(tiny_config(vocab_size=VOCAB)))
    assert not native_step_fits(float_model, torch.int8)
    unfused = quantize_model(random_model(tiny_config(vocab_size=VOCAB)), "q4")
    assert not native_step_fits(unfused, torch.int8)


def test_the_op_names_what_it_refuses():
    model = q4_model()
    from streamgrok.model.native_decode import NativeDecodeStep
    step = NativeDecodeStep(model)
    config = model.config
    stores = [torch.zeros(1, config.num_kv_heads, 8, config.head_dim)
              for _ in range(config.num_layers)]
    half = config.head_dim // 2
    args = dict(embedded=torch.zeros(1, config.hidden_size), weights=step.weights,
                qkv_biases=[], keys=stores, values=[s.clone() for s in stores], key_scales=[],
                value_scales=[], positions=torch.tensor([3]), cos=torch.ones(1, half),
                sin=torch.zeros(1, half), num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads, eps=1e-5, moe_weights=[], moe_layout=[],
                expert_counts=torch.empty(0, dtype=torch.long))
    op = torch.ops.streamgrok_cpu.decode_step
    assert op(**args).shape == (1, VOCAB)
    without_head = op(**{**args, "weights": step.body})  # the normed hidden state
    assert without_head.shape == (1, config.hidden_size)
    torch.testing.assert_close(model.output(without_head), op(**args), atol=0.05, rtol=0.01)
    with pytest.raises(RuntimeError, match="outside the stores"):
        op(**{**args, "positions": torch.tensor([8])})
    with pytest.raises(RuntimeError, match="10 weights per layer"):
        op(**{**args, "weights": step.weights[:-1]})
    with pytest.raises(RuntimeError, match="int8 stores and only they"):
        op(**{**args, "key_scales": [torch.zeros(1, 2, 8, dtype=torch.float16)] * 2,
              "value_scales": [torch.zeros(1, 2, 8, dtype=torch.float16)] * 2})
    with pytest.raises(RuntimeError, match="one per layer"):
        op(**{**args, "moe_layout": [4, 2, 1, 0, 0]})
    with pytest.raises(RuntimeError, match="outside moe_weights"):
        op(**{**args, "moe_layout": [4, 2, 1, 0, 0] + [0] * config.num_layers})


def test_a_process_decoding_natively_imports_neither_the_compiler_nor_triton(tmp_path):
    """What a compiled step keeps resident (dynamo, inductor, Triton's compiler library:
    hundreds of MB) stays out of a process whose decode steps run natively."""
    script = tmp_path / "decode.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch
        from helpers import random_model, tiny_config
        from streamgrok.model.batch import BatchMetadata
        from streamgrok.model.compiled_decode import CompiledDecode
        from streamgrok.model.contiguous_cache import ContiguousKVCache
        from streamgrok.model.llama import fuse_projections
        from streamgrok.model.quantized import quantize_model

        model = quantize_model(fuse_projections(random_model(tiny_config(vocab_size=320))),
                               "q4")
        model.compiled_decode = CompiledDecode(enabled=True)
        cache = ContiguousKVCache(model.config, 1, 40, torch.int8)
        with torch.inference_mode():
            model(torch.tensor([5, 6, 7]), BatchMetadata.build([0], [3]), cache)
            model(torch.tensor([8]), BatchMetadata.build([0], [1]), cache)
            assert model.compiled_decode.wait_compiled(timeout=900)
            model(torch.tensor([9]), BatchMetadata.build([0], [1]), cache)
        decode = model.compiled_decode
        print("native", decode.native_step is not None, "steps", decode.compiled_steps)
        print("imported", sorted(m for m in ("torch._dynamo", "torch._inductor", "triton")
                                 if m in sys.modules))
    """))
    result = run_script(script, {"STREAMGROK_COMPILED_DECODE": "1", NATIVE_ATTENTION_ENV: "1"})
    assert "native True steps 1" in result.stdout
    assert "imported []" in result.stdout


def test_an_engine_whose_reads_compile_imports_the_compiler_when_it_is_made(tmp_path):
    """Not on its compile thread while it serves, where the first import (seconds, the GIL
    and the import lock held) stalled the sessions' steps."""
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent("""
        import sys
        from pathlib import Path
        from helpers import random_model, tiny_config, write_gguf
        from streamgrok.engine import Engine
        from streamgrok.loading.loader import load_model

        loaded = load_model(write_gguf(Path(sys.argv[1]) / "tiny.gguf",
                                       random_model(tiny_config())))
        before = "torch._dynamo" in sys.modules
        Engine(loaded)
        print("before", before, "after", "torch._dynamo" in sys.modules)
    """))
    result = run_script(script, {"STREAMGROK_COMPILED_READS": "1"}, str(tmp_path))
    assert "before False after True" in result.stdout
