"""w8a8: int8 activations times int8 weights. The integer product is the product of the
quantized operands; SmoothQuant's scales fold into the model exactly (a smoothed float model
gives the float model's logits); a w8a8 model decodes like the float one, eagerly and as the
compiled step."""

from __future__ import annotations

import pytest
import torch
from helpers import random_model, tiny_config, write_gguf

from streamgrok.loading.loader import build_model, load_model
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.contiguous_cache import ContiguousKVCache
from streamgrok.model.gguf_loader import iter_state_dict, open_gguf
from streamgrok.model.quantized import Int8Linear, quantize_model
from streamgrok.model.smoothing import calibration_ids, smoothing_for


def all_logits(model, ids: torch.Tensor) -> torch.Tensor:
    cache = ContiguousKVCache(model.config, 1, len(ids), torch.float32, "cpu")
    batch = BatchMetadata([0], [len(ids)], logit_rows=torch.arange(len(ids)))
    with torch.inference_mode():
        return model(ids, batch, cache)


@pytest.fixture()
def outlier_gguf(tmp_path):
    """A tiny Qwen2-shaped model (q/k/v biases, a tied head) whose norms make a few
    activation channels 30x the rest, as trained models have."""
    config = tiny_config(max_positions=256, hidden_size=128, intermediate_size=256,
                         head_dim=32, attention_bias=True, architecture="qwen2",
                         tie_embeddings=True)
    model = random_model(config, seed=4)
    with torch.no_grad():
        for norm in [*(b.attn_norm for b in model.layers), *(b.ffn_norm for b in model.layers),
                     model.norm]:
            norm.weight[::37] *= 30.0
    return write_gguf(tmp_path / "outliers.gguf", model), config


@pytest.mark.parametrize("rows", [1, 7, 200])
def test_integer_product_is_the_product_of_the_quantized_operands(rows):
    torch.manual_seed(2)
    weight, bias = torch.randn(96, 160) * 0.05, torch.randn(96)
    linear = Int8Linear(weight, bias, int8_activations=True)
    x = torch.randn(rows, 160) * torch.linspace(0.1, 3, rows)[:, None]
    scale = x.abs().amax(-1, keepdim=True) / 127
    levels = torch.round(x / scale).clamp(-127, 127)
    expected = (levels.double() @ linear.qweight.double().t()) * scale.double() \
        * linear.scales.double() + bias.double()
    torch.testing.assert_close(linear(x).double(), expected, rtol=1e-5, atol=1e-5)
    # and within int8's error of the float product
    torch.testing.assert_close(linear(x), x @ weight.t() + bias, rtol=0.05, atol=0.05)


def test_smoothing_folds_into_the_model_exactly(outlier_gguf):
    path, config = outlier_gguf
    loaded = load_model(path)
    contents = open_gguf(path)
    smoothing = smoothing_for(loaded.model, calibration_ids(loaded.tokenizer.encode, 64))
    assert max(s.max().item() / s.min().item() for s in smoothing.feed_forward) > 3
    smoothed = build_model(config, iter_state_dict(contents, torch.float32), "cpu", "f32",
                           smoothing=smoothing)
    ids = torch.randint(0, config.vocab_size, (48,), generator=torch.Generator().manual_seed(5))
    assert not torch.equal(smoothed.layers[0].attn_norm.weight,
                           loaded.model.layers[0].attn_norm.weight)
    torch.testing.assert_close(all_logits(smoothed, ids), all_logits(loaded.model, ids),
                               rtol=1e-3, atol=2e-3)  # float32 rounding


def test_a_w8a8_model_decodes_like_the_float_one_and_better_smoothed(outlier_gguf):
    path, config = outlier_gguf
    exact, w8a8 = load_model(path), load_model(path, weights="w8a8")
    layer = w8a8.model.layers[0].attn.wqkv
    assert isinstance(layer, Int8Linear) and layer.int8_activations
    assert w8a8.model.weight_bytes() < exact.model.weight_bytes() * 0.6
    ids = torch.randint(0, config.vocab_size, (96,), generator=torch.Generator().manual_seed(5))
    reference = all_logits(exact.model, ids).log_softmax(-1)

    def kl(model) -> float:
        logprobs = all_logits(model, ids).log_softmax(-1)
        return (reference.exp() * (reference - logprobs)).sum(-1).mean().item()

    unsmoothed = build_model(config, iter_state_dict(open_gguf(path), torch.float32), "cpu",
                             "w8a8")
    assert kl(w8a8.model) < 0.8 * kl(unsmoothed)
    same_top1 = (all_logits(w8a8.model, ids).argmax(-1) == reference.argmax(-1)).float()
    assert same_top1.mean().item() >= 0.85


def test_w8a8_cannot_be_made_without_calibration():
    with pytest.raises(ValueError, match="load_model"):
        quantize_model(random_model(tiny_config()), "w8a8")
