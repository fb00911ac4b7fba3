"""A random mixture-of-experts GGUF for the MoE benchmarks: a Mixtral-layout model (llama.cpp's
`llama` architecture with `*_exps` expert tensors) with the default model's tokenizer, so
streamgrok and llama.cpp load the same file. Its weights are random: it measures speed and
memory, not answers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from streamgrok.loading.loader import default_model_path


@dataclass(frozen=True)
class MoEShape:
    """The random model's shape (printed by the benchmark)."""

    layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    experts: int = 16
    experts_per_token: int = 2
    expert_ffn: int = 512
    context: int = 8192

    def describe(self) -> str:
        return (f"{self.layers} layers, hidden {self.hidden}, {self.heads}/{self.kv_heads} "
                f"heads, {self.experts} experts (top {self.experts_per_token}) of FFN "
                f"{self.expert_ffn}")


def write_random_moe_gguf(path: Path, shape: MoEShape = MoEShape(), seed: int = 0,
                          qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0) -> Path:
    """Write the model to `path` (projections and experts in `qtype`, norms and routers in
    F32, the embedding tied to the head) and return it."""
    rng = np.random.default_rng(seed)
    tokenizer = GGUFReader(str(default_model_path()))
    vocab = len(tokenizer.fields["tokenizer.ggml.tokens"].data)
    head_dim = shape.hidden // shape.heads
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("streamgrok random MoE")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.expert_ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.experts_per_token)
    writer.add_file_type(int(qtype))
    _copy_tokenizer(tokenizer, writer)

    def weight(*dims: int) -> np.ndarray:
        return quantize(rng.normal(0.0, 0.02, dims).astype(np.float32), qtype)

    def add(name: str, data: np.ndarray, raw: GGMLQuantizationType | None = None) -> None:
        writer.add_tensor(name, data, raw_dtype=raw)

    add("token_embd.weight", weight(vocab, shape.hidden), qtype)
    add("output_norm.weight", np.ones(shape.hidden, np.float32))
    kv = shape.kv_heads * head_dim
    for i in range(shape.layers):
        add(f"blk.{i}.attn_norm.weight", np.ones(shape.hidden, np.float32))
        add(f"blk.{i}.attn_q.weight", weight(shape.hidden, shape.hidden), qtype)
        add(f"blk.{i}.attn_k.weight", weight(kv, shape.hidden), qtype)
        add(f"blk.{i}.attn_v.weight", weight(kv, shape.hidden), qtype)
        add(f"blk.{i}.attn_output.weight", weight(shape.hidden, shape.hidden), qtype)
        add(f"blk.{i}.ffn_norm.weight", np.ones(shape.hidden, np.float32))
        add(f"blk.{i}.ffn_gate_inp.weight",
            rng.normal(0.0, 0.5, (shape.experts, shape.hidden)).astype(np.float32))
        for part in ("gate", "up"):
            add(f"blk.{i}.ffn_{part}_exps.weight",
                weight(shape.experts, shape.expert_ffn, shape.hidden), qtype)
        add(f"blk.{i}.ffn_down_exps.weight",
            weight(shape.experts, shape.hidden, shape.expert_ffn), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _copy_tokenizer(reader: GGUFReader, writer: GGUFWriter) -> None:
    """Every `tokenizer.*` field of `reader`, as it is."""
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
