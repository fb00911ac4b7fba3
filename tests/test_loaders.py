"""GGUF and Hugging Face loading on tiny files the tests write, and bad inputs."""

from __future__ import annotations

import dataclasses
import json

import gguf
import numpy as np
import pytest
import torch
from helpers import random_model, tiny_config, write_gguf, write_hf_folder

from streamgrok.errors import ModelLoadError, UnsupportedArchitecture, UnsupportedQuantization
from streamgrok.loading.loader import load_model
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.contiguous_cache import ContiguousKVCache

Q = gguf.GGMLQuantizationType


def logits_of(model, ids):
    batch = BatchMetadata.build([0], [len(ids)])
    batch.logit_rows = None
    return model(torch.tensor(ids), batch, ContiguousKVCache(model.config, 1, len(ids)))


IDS = [5, 77, 3, 120, 9, 250, 31, 64, 2, 17]


def test_f32_gguf_round_trip_is_exact(tiny, tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tiny)
    loaded = load_model(path, fuse=False)  # the checkpoint's names, to compare them
    assert loaded.config.rms_norm_eps == pytest.approx(tiny.config.rms_norm_eps)  # stored as f32
    assert dataclasses.replace(loaded.config, rms_norm_eps=tiny.config.rms_norm_eps) == tiny.config
    for (name, want), got in zip(tiny.state_dict().items(), loaded.model.state_dict().values()):
        torch.testing.assert_close(got, want, msg=name)
    torch.testing.assert_close(logits_of(loaded.model, IDS), logits_of(tiny, IDS))
    fused = load_model(path).model  # q/k/v and gate/up as one matmul each: the same logits
    assert fused.layers[0].attn.wqkv is not None and fused.layers[0].ffn.w_gate_up is not None
    torch.testing.assert_close(logits_of(fused, IDS), logits_of(tiny, IDS))


# (quant type, max abs weight error relative to the weight scale, min logit cosine)
QUANTS = [
    (Q.F16, 1e-3, 0.9999),
    (Q.BF16, 1e-2, 0.999),
    (Q.Q8_0, 1e-2, 0.999),
    (Q.Q4_0, 0.15, 0.95),
    (Q.Q4_1, 0.15, 0.95),
]


@pytest.mark.parametrize("qtype,weight_tol,min_cos", QUANTS, ids=[q[0].name for q in QUANTS])
def test_quantized_gguf_loads_within_quantization_error(tiny, tmp_path, qtype, weight_tol, min_cos):
    loaded = load_model(write_gguf(tmp_path / "q.gguf", tiny, qtype), fuse=False).model
    for name, want in tiny.state_dict().items():
        got = loaded.get_parameter(name)
        scale = want.abs().max()
        assert (got - want).abs().max() <= weight_tol * scale, name
    cos = torch.nn.functional.cosine_similarity(logits_of(loaded, IDS), logits_of(tiny, IDS), -1)
    assert cos.min() >= min_cos


def test_tied_embeddings_gguf(tmp_path):
    model = random_model(tiny_config(tie_embeddings=True))
    loaded = load_model(write_gguf(tmp_path / "tied.gguf", model)).model
    assert loaded.config.tie_embeddings
    # on CPU the head is the embedding, laid out [in, out] for the decode GEMM
    assert torch.equal(loaded.output.weight, loaded.embed.weight)
    assert loaded.output.weight.t().is_contiguous()
    torch.testing.assert_close(logits_of(loaded, IDS), logits_of(model, IDS))


def test_gguf_tokenizer_and_template(tiny, tmp_path):
    tok = load_model(write_gguf(tmp_path / "t.gguf", tiny)).tokenizer
    text = "the thin cat said: <|im_end|> 123 ünïcödé"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special=False) == text
    assert tok.eos_id in ids and tok.eos_id in tok.stop_ids


def test_hf_folder_round_trip(tiny, tmp_path):
    loaded = load_model(write_hf_folder(tmp_path / "hf", tiny))
    assert loaded.config == tiny.config
    torch.testing.assert_close(logits_of(loaded.model, IDS), logits_of(tiny, IDS))
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("the end")) == "the end"
    rendered = loaded.tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_hf_folder_qwen2_bias_tied(tmp_path):
    model = random_model(tiny_config(architecture="qwen2", attention_bias=True,
                                     tie_embeddings=True))
    loaded = load_model(write_hf_folder(tmp_path / "qwen", model)).model
    torch.testing.assert_close(logits_of(loaded, IDS), logits_of(model, IDS))


def test_bf16_load_casts_weights(tiny, tmp_path):
    loaded = load_model(write_gguf(tmp_path / "b.gguf", tiny), dtype=torch.bfloat16).model
    assert loaded.dtype == torch.bfloat16


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="model not found: .*nope.gguf"):
        load_model(tmp_path / "nope.gguf")


def test_truncated_gguf_is_named(tiny, tmp_path):
    path = write_gguf(tmp_path / "full.gguf", tiny, Q.Q8_0)
    data = path.read_bytes()
    for cut in (100, len(data) // 2, len(data) - 64):
        broken = tmp_path / f"cut{cut}.gguf"
        broken.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated or corrupt"):
            load_model(broken)


def test_garbage_file_is_named(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a model at all" * 10)
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        load_model(path)


def test_unsupported_quant_type_is_named(tiny, tmp_path):
    block_bytes = gguf.GGML_QUANT_SIZES[Q.Q2_K][1]
    extra = ("output_norm.weight", np.zeros((1, block_bytes), dtype=np.uint8), Q.Q2_K)
    model = random_model(tiny_config())
    state = model.state_dict()
    path = tmp_path / "q2k.gguf"
    # write every tensor but output_norm, then output_norm as Q2_K
    writer_model = _without(model, "norm.weight")
    write_gguf(path, writer_model, extra_tensor=extra)
    assert state  # the model itself is intact
    with pytest.raises(UnsupportedQuantization, match="Q2_K"):
        load_model(path)


def _without(model, name):
    """A view of `model` whose state_dict omits one parameter (for writing odd files)."""

    class Partial:
        config = model.config

        @staticmethod
        def state_dict():
            return {k: v for k, v in model.state_dict().items() if k != name}

    return Partial()


def test_unknown_architecture_gguf(tiny, tmp_path):
    path = write_gguf(tmp_path / "neox.gguf", tiny, architecture="gptneox")
    with pytest.raises(UnsupportedArchitecture, match="gptneox"):
        load_model(path)


def test_unknown_architecture_hf(tiny, tmp_path):
    folder = write_hf_folder(tmp_path / "hf", tiny)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitecture, match="GPTNeoXForCausalLM"):
        load_model(folder)


def test_hf_folder_without_weights(tiny, tmp_path):
    folder = write_hf_folder(tmp_path / "hf", tiny)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(folder)


def test_mismatched_weights_are_named(tiny, tmp_path):
    path = write_gguf(tmp_path / "partial.gguf", _without(tiny, "layers.1.ffn.w_up.weight"))
    with pytest.raises(ModelLoadError, match="layers.1.ffn.w_up.weight"):
        load_model(path)
