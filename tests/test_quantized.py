"""Weight-only int8 / int4 linears: the packed CPU kernels match their own dequantized
weights, the error against float32 is what the format allows, and a quantized model decodes
like the float one."""

from __future__ import annotations

import weakref

import pytest
import torch
from helpers import random_model, tiny_config, write_gguf

from streamgrok.loading.loader import build_model, load_model
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.contiguous_cache import ContiguousKVCache
from streamgrok.model.gguf_loader import iter_state_dict, open_gguf
from streamgrok.model.quantized import (
    DEQUANTIZED_MIN_ROWS,
    EXACT_TOP,
    Int4Linear,
    Int8Linear,
    QuantizedRows,
    prefill_dtype,
    quantize_model,
    torch_packs_as_blocks,
)
from streamgrok.model.quantized_embedding import Int8Embedding


@pytest.mark.parametrize("kind, error", [(Int8Linear, 0.012), (Int4Linear, 0.1)])
@pytest.mark.parametrize("shape", [(64, 64), (192, 576), (128, 96)])
def test_kernel_matches_its_dequantized_weight(kind, error, shape):
    torch.manual_seed(1)
    linear = torch.nn.Linear(shape[1], shape[0], bias=True)
    linear.weight.data.normal_(0, 0.05)
    quantized = kind(linear.weight, linear.bias)
    x = torch.randn(5, shape[1])
    out = quantized(x)
    reference = torch.nn.functional.linear(x.bfloat16().float(), quantized.dequantized(),
                                           linear.bias)
    assert out.shape == (5, shape[0]) and out.dtype == x.dtype
    assert (out - reference).abs().max() <= 0.01 * reference.abs().max()
    exact = linear(x)
    assert (out - exact).norm() / exact.norm() < error


@pytest.mark.parametrize("kind", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("shape", [(192, 576), (128, 96), (80, 64)])
def test_prefill_rows_multiply_by_the_dequantized_weight_like_the_kernel(kind, shape):
    torch.manual_seed(3)
    weight = torch.randn(*shape) * 0.05
    bias = torch.randn(shape[0])
    quantized = kind(weight, bias)
    if kind is Int4Linear:  # whole blocks of 64 rows take the native kernels' layout
        assert quantized.unpacks == (shape[0] % 64 == 0)
        assert quantized.torch_kernel == (not quantized.unpacks or torch_packs_as_blocks())
    x = torch.randn(DEQUANTIZED_MIN_ROWS + 3, shape[1])
    prefill = quantized(x)
    kernel_rows = torch.cat([quantized(chunk) for chunk in x.split(7)])  # the packed kernel
    reference = torch.nn.functional.linear(x.bfloat16().float(), quantized.dequantized(), bias)
    if kind is Int4Linear and quantized.unpacks and quantized.torch_kernel:
        # PyTorch's kernel reads the layout (in bfloat16) where its packing is the same
        eye = torch.eye(shape[1], dtype=torch.bfloat16)
        read_back = torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, quantized.packed, 32, quantized.scales_and_zeros).t().float()
        torch.testing.assert_close(quantized.dequantized(), read_back, atol=1e-3, rtol=8e-3)
    scale = reference.abs().max()
    assert prefill.shape == (len(x), shape[0]) and prefill.dtype == x.dtype
    assert (prefill - reference).abs().max() <= 0.01 * scale
    assert (prefill - kernel_rows).abs().max() <= 0.01 * scale


def test_int4_byte_layout_dequantizes_like_the_cpu_kernel():
    torch.manual_seed(2)
    weight = torch.randn(64, 96) * 0.05
    kernel = Int4Linear(weight, None)
    nibbles = Int4Linear(weight, None, cpu_kernel=False)
    assert nibbles.packed.numel() == weight.numel() // 2
    torch.testing.assert_close(nibbles.dequantized(), kernel.dequantized(), atol=2e-3,
                               rtol=1e-2)
    x = torch.randn(3, 96)
    torch.testing.assert_close(nibbles(x), kernel(x), atol=2e-2, rtol=2e-2)


def test_q4_refuses_sizes_its_groups_do_not_divide():
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Linear(torch.randn(16, 40), None)
    with pytest.raises(ValueError, match="by 16"):
        Int4Linear(torch.randn(24, 64), None)
    model = quantize_model(torch.nn.Sequential(torch.nn.Linear(64, 24), torch.nn.Linear(24, 32)),
                           "q4")
    assert [type(m) for m in model] == [Int8Linear, Int8Linear]  # int8 where int4 cannot go
    with pytest.raises(ValueError, match="unknown weight format"):
        quantize_model(torch.nn.Linear(4, 4), "q3")


@pytest.mark.parametrize("weights, agreement", [("q8", 0.9), ("q4", 0.6)])
def test_a_quantized_model_decodes_like_the_float_one(tmp_path, weights, agreement):
    config = tiny_config(max_positions=256, hidden_size=128, intermediate_size=256,
                         head_dim=32)
    path = write_gguf(tmp_path / "tiny.gguf", random_model(config))
    exact, quantized = load_model(path), load_model(path, weights=weights)
    assert quantized.model.weight_bytes() < exact.model.weight_bytes() * 0.6
    assert isinstance(quantized.model.embed, Int8Embedding)
    assert quantized.model.dtype == torch.float32
    ids = torch.randint(0, config.vocab_size, (96,))
    logits = []
    for loaded in (exact, quantized):
        cache = ContiguousKVCache(config, 1, 96, torch.float32, "cpu")
        batch = BatchMetadata([0], [96], logit_rows=torch.arange(96))  # every position
        logits.append(loaded.model(ids, batch, cache))
    assert logits[1].shape == (96, config.vocab_size)
    same_top1 = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item()
    assert same_top1 >= agreement
    assert logits[1].dtype == torch.float32 and torch.isfinite(logits[1]).all()


@pytest.mark.parametrize("weights", ["q8", "q4"])
def test_quantizing_while_loading_equals_quantizing_the_loaded_model(tmp_path, weights):
    config = tiny_config(max_positions=128, hidden_size=128, intermediate_size=256,
                         head_dim=32, attention_bias=True, architecture="qwen2")
    path = write_gguf(tmp_path / "tiny.gguf", random_model(config))
    streamed = load_model(path, weights=weights)  # per tensor while reading, then fused
    afterwards = quantize_model(load_model(path, fuse=False).model, weights)
    assert streamed.model.layers[0].attn.wqkv.bias is not None
    ids = torch.randint(0, config.vocab_size, (40,))
    outs = []
    for model in (streamed.model, afterwards):
        cache = ContiguousKVCache(config, 1, 40, torch.float32, "cpu")
        outs.append(model(ids, BatchMetadata.build([0], [40], "cpu"), cache))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("weights", ["q8", "q4"])
def test_a_tied_table_is_quantized_as_it_is_read_not_kept_under_the_load(tmp_path, weights):
    """The float embedding table of a tied model (the largest tensor of a small model) becomes
    the int8 table and the quantized head when it is read: no float copy stays while the
    other tensors load, and the model equals quantizing the float one afterwards."""
    config = tiny_config(max_positions=128, hidden_size=128, intermediate_size=256,
                         head_dim=32, tie_embeddings=True)
    path = write_gguf(tmp_path / "tiny.gguf", random_model(config))
    contents = open_gguf(path)
    table: weakref.ref | None = None
    kept: list[bool] = []  # whether the float table was alive as each later tensor came

    def tensors():
        nonlocal table
        for name, tensor in iter_state_dict(contents, torch.float32):
            if table is not None:
                kept.append(table() is not None)
            if name == "embed.weight":
                table = weakref.ref(tensor)
            yield name, tensor

    streamed = build_model(contents.config, tensors(), "cpu", weights)
    # while the next tensor is read, the loader's loop (enumerate) still holds the last one
    assert len(kept) > 4 and not any(kept[1:])
    assert isinstance(streamed.embed, Int8Embedding)
    afterwards = quantize_model(load_model(path, fuse=False).model, weights)
    torch.testing.assert_close(streamed.embed.values, afterwards.embed.values)
    ids = torch.randint(0, config.vocab_size, (40,))
    outs = []
    for model in (streamed, afterwards):
        cache = ContiguousKVCache(config, 1, 40, torch.float32, "cpu")
        outs.append(model(ids, BatchMetadata.build([0], [40], "cpu"), cache))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)


def test_int8_embedding_rows_are_within_half_a_step_of_the_table():
    torch.manual_seed(3)
    table = torch.randn(300, 96) * torch.logspace(-3, 0, 300)[:, None]  # rows of any scale
    embed = Int8Embedding.of(table)
    assert embed.values.dtype == torch.int8 and embed.values.shape == (300, 96)
    ids = torch.tensor([[0, 299], [17, 17]])
    rows = embed(ids)
    assert rows.shape == (2, 2, 96) and rows.dtype == table.dtype
    step = table.view(300, 3, 32).abs().amax(-1).repeat_interleave(32, dim=1) / 127
    assert ((embed.dequantized() - table).abs() <= step / 2 + 1e-7).all()
    torch.testing.assert_close(rows[1, 0], embed.dequantized()[17])
    with pytest.raises(ValueError, match="divisible by 32"):
        Int8Embedding.of(torch.randn(4, 40))


def test_a_table_already_in_groups_of_int8_comes_back_exactly():
    """GGUF's Q8_0 rows (int8 times a scale per 32) requantize to the same values."""
    torch.manual_seed(4)
    levels = torch.randint(-127, 128, (64, 64)).float()
    levels[:, 0], levels[:, 32] = 127, -127  # each group reaches the full range, as Q8_0 does
    scales = torch.rand(64, 2) * 0.01 + 1e-4
    table = (levels.view(64, 2, 32) * scales[..., None]).view(64, 64)
    torch.testing.assert_close(Int8Embedding.of(table).dequantized(), table, rtol=1e-6,
                               atol=0)


@pytest.mark.parametrize("weights", ["q8", "w8a8"])
def test_an_int8_output_head_multiplies_a_batch_by_its_bfloat16_copy(tmp_path, weights):
    config = tiny_config(max_positions=128, hidden_size=128, intermediate_size=256,
                         head_dim=32)
    path = write_gguf(tmp_path / "tiny.gguf", random_model(config, seed=3))
    model = load_model(path, weights=weights).model
    head = model.output
    assert all(m.wide is None for m in model.modules()
               if isinstance(m, Int8Linear) and m is not head)  # the head only
    if prefill_dtype() != torch.bfloat16:  # no native bfloat16 here: nothing kept
        assert head.wide is None
        return
    assert torch.equal(head.wide, head.dequantized(torch.bfloat16))
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(1))
    assert_bfloat16_outside_the_top(head, x, torch.nn.functional.linear(x.bfloat16(), head.wide))
    one_row = torch.ops.aten._weight_int8pack_mm(x[:1].bfloat16(), head.qweight, head.scales)
    assert_bfloat16_outside_the_top(head, x[:1], one_row)  # one row: the int8 kernel
    torch.testing.assert_close(head(x[:1]), head(x)[:1], rtol=0.02, atol=0.02)
    assert quantize_model(load_model(path).model, "q8").output.wide is not None
    contents = open_gguf(path)  # w8a8's calibration model is built without the copy
    narrow = build_model(contents.config, iter_state_dict(contents, torch.float32), "cpu", "q8",
                         wide_head=False)
    assert narrow.output.wide is None


def assert_bfloat16_outside_the_top(head: Int8Linear, x: torch.Tensor,
                                    bfloat16_product: torch.Tensor) -> None:
    """head(x) is the bfloat16 product except in each row's EXACT_TOP largest logits, which
    are the float32 product."""
    out = head(x)
    exact = x @ head.dequantized(torch.float32).t()
    top = bfloat16_product.float().topk(EXACT_TOP, dim=-1).indices
    torch.testing.assert_close(out.gather(-1, top), exact.gather(-1, top), rtol=1e-5, atol=1e-5)
    rest = torch.ones_like(out, dtype=torch.bool).scatter(-1, top, False)
    assert torch.equal(out[rest], bfloat16_product.float()[rest])


def test_an_int8_head_ranks_close_logits_as_float32_does():
    # logits near 25, where bfloat16 keeps steps of 0.125: several rows' two best tokens
    # fall into one step, and a bfloat16 head would give them the same logit
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(4096, 64, generator=generator) * 0.05
    head = QuantizedRows.of(weight, "q8").linear(head=True)
    layer = QuantizedRows.of(weight, "q8").linear()
    assert isinstance(head, Int8Linear) and head.head and not layer.head
    x = torch.randn(64, 64, generator=generator) * 12
    exact = x @ head.dequantized(torch.float32).t()
    bfloat16_product = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), head.qweight,
                                                          head.scales)
    best_two = bfloat16_product.float().topk(2, dim=-1).values
    assert (best_two[:, 0] == best_two[:, 1]).any()  # the case this is about occurs
    assert_bfloat16_outside_the_top(head, x, bfloat16_product)
    assert torch.equal(head(x).argmax(-1), exact.argmax(-1))
    assert torch.equal(layer(x), bfloat16_product.float())  # other layers: the kernel as is


async def test_the_engine_keeps_a_quantized_models_kv_in_bfloat16_on_the_cpu(tmp_path):
    """`kv_dtype` "auto": a quantized model's paged cache holds bfloat16 on the CPU (the
    bytes a long session's decode step reads), a float model's its compute dtype; a dtype
    the server sets stays; answers decode over either."""
    from streamgrok.cache.config import CacheConfig
    from streamgrok.engine import Engine
    from streamgrok.model.quantized import paged_cache_dtype
    from streamgrok.model.sampling import SamplingParams

    gguf = write_gguf(tmp_path / "tiny.gguf", random_model(tiny_config()))
    for weights, auto in (("q4", "bfloat16"), ("f32", "float32")):
        loaded = load_model(gguf, weights=weights)
        assert paged_cache_dtype(loaded.model) == getattr(torch, auto)
        for asked, kept in (("auto", auto), ("float32", "float32")):
            async with Engine(loaded, CacheConfig(kv_dtype=asked, memory_gib=0.01)) as engine:
                assert engine.cache.config.kv_dtype == kept
                assert engine.cache.pool.paged_kv().k.dtype == getattr(torch, kept)
                session = engine.new_session("sys")
                answer = session.ask("hello", SamplingParams(temperature=0.0, max_tokens=3))
                assert await answer.text() is not None
                assert answer.metrics.finish_reason in ("stop", "length")
