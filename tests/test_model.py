"""The PyTorch model on the contiguous cache against naive references."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import random_model, tiny_config

from streamgrok.model.batch import BatchMetadata
from streamgrok.model.contiguous_cache import ContiguousKVCache
from streamgrok.model.rotary import Rotary


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits at every position from one forward pass over the whole sequence."""
    cache = ContiguousKVCache(model.config, 1, len(ids))
    batch = BatchMetadata.build([0], [len(ids)])
    batch.logit_rows = None
    return model(torch.tensor(ids), batch, cache)


def test_incremental_decoding_matches_full_forward(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (40,)).tolist()
    reference = full_logits(tiny, ids)
    cache = ContiguousKVCache(tiny.config, 1, 64)
    # a 13-token chunk, then a 7-token chunk, then token by token
    chunks = [ids[:13], ids[13:20]] + [[t] for t in ids[20:]]
    got, done = [], 0
    for chunk in chunks:
        batch = BatchMetadata.build([0], [len(chunk)])
        batch.logit_rows = None
        got.append(tiny(torch.tensor(chunk), batch, cache))
        done += len(chunk)
    torch.testing.assert_close(torch.cat(got), reference, atol=1e-5, rtol=1e-5)


def naive_attention(q, k, v, positions_q, positions_k):
    """Dense causal GQA attention written out by hand (no SDPA)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    causal = positions_k[None, :] <= positions_q[:, None]
    scores = scores.masked_fill(~causal[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_gqa_attention_equals_naive_reference(heads, kv_heads):
    config = tiny_config(num_heads=heads, num_kv_heads=kv_heads, hidden_size=heads * 16)
    cache = ContiguousKVCache(config, 1, 64)
    rotary = Rotary(config)
    torch.manual_seed(1)
    q1, k1, v1 = (torch.randn(10, h, 16) for h in (heads, kv_heads, kv_heads))
    q2, k2, v2 = (torch.randn(5, h, 16) for h in (heads, kv_heads, kv_heads))
    for q, k, v in ((q1, k1, v1), (q2, k2, v2)):
        batch = BatchMetadata.build([0], [q.shape[0]])
        cache.prepare(batch)
        out = cache.attend(0, q, k, v, batch)
    pos = torch.arange(15)
    qr = rotary.rotate(torch.cat([q1, q2]), pos)
    kr = rotary.rotate(torch.cat([k1, k2]), pos)
    expected = naive_attention(qr, kr, torch.cat([v1, v2]), pos, pos)[10:]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slots", [[0, 1, 2, 3], [3, 1, 0, 2], [1, 2, 3, 4]])
def test_batch_of_four_equals_four_singles(tiny, slots):
    """Consecutive slots decode over a view of the cache, any others over an index."""
    torch.manual_seed(2)
    prompts = [torch.randint(0, tiny.config.vocab_size, (n,)).tolist() for n in (5, 17, 9, 12)]
    batched = ContiguousKVCache(tiny.config, 5, 64)
    singles = [ContiguousKVCache(tiny.config, 1, 64) for _ in prompts]
    feeds = prompts
    for _ in range(6):
        batch = BatchMetadata.build(slots, [len(f) for f in feeds])
        logits = tiny(torch.tensor(sum(feeds, [])), batch, batched)
        expected = torch.cat([
            tiny(torch.tensor(f), BatchMetadata.build([0], [len(f)]), cache)
            for f, cache in zip(feeds, singles)
        ])
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        feeds = [[t] for t in logits.argmax(-1).tolist()]


def test_embedding_rows_replace_token_embeddings(tiny):
    ids = torch.tensor([3, 50, 7, 9])
    reference = tiny(ids, BatchMetadata.build([0], [4]), ContiguousKVCache(tiny.config, 1, 8))
    batch = BatchMetadata.build([0], [4])
    batch.embed_rows = torch.tensor([1, 2])
    batch.embed_values = tiny.embed.weight[torch.tensor([50, 7])].clone()
    got = tiny(torch.tensor([3, 0, 0, 9]), batch, ContiguousKVCache(tiny.config, 1, 8))
    torch.testing.assert_close(got, reference)


def test_qwen2_style_bias_and_tied_head_run():
    config = tiny_config(architecture="qwen2", attention_bias=True, tie_embeddings=True)
    model = random_model(config)
    assert model.output.weight is model.embed.weight
    assert model.layers[0].attn.wq.bias is not None
    logits = model(torch.tensor([1, 2, 3]), BatchMetadata.build([0], [3]),
                   ContiguousKVCache(config, 1, 8))
    assert logits.shape == (1, config.vocab_size) and torch.isfinite(logits).all()


def test_bfloat16_model_tracks_float32(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (20,)).tolist()
    reference = full_logits(tiny, ids)
    bf16 = random_model(tiny.config).to(torch.bfloat16)
    cache = ContiguousKVCache(tiny.config, 1, 32, dtype=torch.bfloat16)
    batch = BatchMetadata.build([0], [20])
    batch.logit_rows = None
    got = bf16(torch.tensor(ids), batch, cache)
    cos = torch.nn.functional.cosine_similarity(got, reference, dim=-1)
    assert cos.min() > 0.99


def test_an_int8_cache_stores_each_row_with_its_scale_and_tracks_float32(tiny):
    from streamgrok_kernels.quant import quantize_int8

    ids = torch.randint(0, tiny.config.vocab_size, (30,)).tolist()
    exact, int8 = (ContiguousKVCache(tiny.config, 2, 40, dtype=dtype)
                   for dtype in (torch.float32, torch.int8))
    got, want = [], []
    for cache, out in ((exact, want), (int8, got)):
        # seq 1: a 17-token chunk, a 9-token chunk, then token by token
        for chunk in (ids[:17], ids[17:26], *([t] for t in ids[26:])):
            batch = BatchMetadata.build([1], [len(chunk)])
            batch.logit_rows = None
            out.append(tiny(torch.tensor(chunk), batch, cache))
    assert int8.k[0].dtype == torch.int8 and int8.lengths == [0, 30]
    # the first layer's keys are the float cache's, rounded to int8 levels of their row
    levels, scales = quantize_int8(exact.k[0][1, :, :30])
    assert torch.equal(int8.k[0][1, :, :30], levels)
    assert torch.equal(int8.k_scales[0][1, :, :30], scales.half())
    cos = torch.nn.functional.cosine_similarity(torch.cat(got), torch.cat(want), dim=-1)
    assert cos.min() > 0.999


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_eager_decode_steps_attend_by_the_native_kernel(tiny, dtype, monkeypatch):
    import streamgrok.model.contiguous_cache as contiguous

    calls = []
    kernel = contiguous.cpu_decode_attention
    monkeypatch.setattr(contiguous, "cpu_decode_attention",
                        lambda *args: calls.append(args[1].dtype) or kernel(*args))
    native, plain = (ContiguousKVCache(tiny.config, 3, 40, dtype, native_attention=on)
                     for on in (True, False))
    assert native.native.wait_ready(timeout=600), native.native.error
    gen = torch.Generator().manual_seed(3)
    got, want = [], []
    for seq, n in enumerate((5, 11, 2)):
        ids = torch.randint(0, tiny.config.vocab_size, (n,), generator=gen)
        for cache in (native, plain):
            tiny(ids, BatchMetadata.build([seq], [n]), cache)
    # steps of every sequence (a view of the stores), then of two apart (a gathered copy)
    for seqs in ([0, 1, 2], [0, 1, 2], [0, 2], [1]):
        ids = torch.randint(0, tiny.config.vocab_size, (len(seqs),), generator=gen)
        batch = BatchMetadata.build(seqs, [1] * len(seqs))
        got.append(tiny(ids, batch, native))
        want.append(tiny(ids, BatchMetadata.build(seqs, [1] * len(seqs)), plain))
    # bfloat16: the plain path multiplies in bfloat16, the kernel in float32
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(torch.cat(got), torch.cat(want), atol=tolerance, rtol=0.01)
    assert calls and set(calls) == {dtype} and native.lengths == plain.lengths == [8, 14, 5]
    assert len(calls) == 4 * tiny.config.num_layers


def test_an_unknown_kv_cache_dtype_is_a_clear_error():
    from streamgrok.cli.options import CHAT_KV_DTYPES
    from streamgrok.model.generate import KV_CACHE_DTYPES, kv_cache_dtype

    assert kv_cache_dtype("int8") == torch.int8
    # the command line names them without importing torch: the same names
    assert CHAT_KV_DTYPES == ("auto", *KV_CACHE_DTYPES)
    with pytest.raises(ValueError, match="unknown K/V cache dtype 'float16'"):
        kv_cache_dtype("float16")


def test_cache_full_raises_clear_error(tiny):
    from streamgrok.errors import CacheFullError

    cache = ContiguousKVCache(tiny.config, 1, 4)
    with pytest.raises(CacheFullError, match="needs 5 tokens"):
        tiny(torch.arange(5), BatchMetadata.build([0], [5]), cache)
