"""Tiny random vision-language models built with `transformers` (test-only), saved as the
folders and mmproj GGUF files streamgrok loads."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import CHAT_TEMPLATE, byte_tokenizer, byte_vocab
from tokenizers import AddedToken

IMAGE_SPECIALS = ["<fake_token_around_image>", "<global-img>", "<image>"]
VOCAB = len(byte_vocab()) + len(IMAGE_SPECIALS)
IMAGE_TOKEN = VOCAB - 1
TEXT = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False)


def write_tokenizer(folder: Path) -> None:
    tok = byte_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True) for t in IMAGE_SPECIALS])
    assert tok.token_to_id("<image>") == IMAGE_TOKEN
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": CHAT_TEMPLATE}))


def perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights with norms away from 1 and biases away from 0, so every weight
    matters to the outputs."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, 0.05 if param.ndim > 1 else 0.02)
    return model.eval()


def smolvlm_folder(folder: Path, seed: int = 0, image_size: int = 64, patch: int = 8,
                   longest_edge: int = 96, text_layers: int = 2):
    """A tiny SmolVLM2 (SigLIP tower, pixel shuffle 2, Llama text model) and its video
    processor; returns the transformers model."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=image_size, patch_size=patch)
    config = SmolVLMConfig(text_config={**TEXT, "num_hidden_layers": text_layers},
                           vision_config=vision, scale_factor=2,
                           image_token_id=IMAGE_TOKEN, tie_word_embeddings=False)
    model = perturb(SmolVLMForConditionalGeneration(config), seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor = SmolVLMVideoProcessor(size={"longest_edge": longest_edge},
                                      max_image_size={"longest_edge": image_size})
    processor.save_pretrained(folder)
    write_tokenizer(folder)
    return model


def llava_folder(folder: Path, seed: int = 0, image_size: int = 56, patch: int = 14,
                 layers: int = 3):
    """A tiny LLaVA (CLIP tower with class token, feature layer -2, MLP projector); returns
    the transformers model."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration

    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, image_size=image_size,
                  patch_size=patch, projection_dim=16)
    config = LlavaConfig(text_config=TEXT, vision_config=vision, image_token_index=IMAGE_TOKEN,
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         tie_word_embeddings=False)
    model = perturb(LlavaForConditionalGeneration(config), seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": image_size},
                       crop_size={"height": image_size, "width": image_size}).save_pretrained(
        folder)
    write_tokenizer(folder)
    return model


def write_mmproj(path: Path, model, family: str) -> Path:
    """The vision half of a transformers model as llama.cpp's converter lays out an mmproj
    GGUF (F32): `idefics3` for SmolVLM, `mlp` for LLaVA (blocks past the feature layer
    left out, as llama.cpp's llava converter does)."""
    cfg = model.config
    vc = cfg.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("clip.projector_type", "idefics3" if family == "idefics3" else "mlp")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.use_gelu", family == "idefics3")
    writer.add_uint32("clip.vision.image_size", vc.image_size)
    writer.add_uint32("clip.vision.patch_size", vc.patch_size)
    writer.add_uint32("clip.vision.embedding_length", vc.hidden_size)
    writer.add_uint32("clip.vision.feed_forward_length", vc.intermediate_size)
    writer.add_uint32("clip.vision.projection_dim", cfg.text_config.hidden_size)
    writer.add_uint32("clip.vision.attention.head_count", vc.num_attention_heads)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vc.layer_norm_eps)
    blocks = vc.num_hidden_layers if family == "idefics3" else vc.num_hidden_layers - 1
    writer.add_uint32("clip.vision.block_count", blocks)
    if family == "idefics3":
        writer.add_uint32("clip.vision.projector.scale_factor", cfg.scale_factor)
        mean = std = [0.5, 0.5, 0.5]
    else:
        mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    writer.add_array("clip.vision.image_mean", mean)
    writer.add_array("clip.vision.image_std", std)
    state = model.state_dict()
    tower = "model.vision_model." if family == "idefics3" else "model.vision_tower."
    names = {"embeddings.patch_embedding.weight": "v.patch_embd.weight",
             "embeddings.patch_embedding.bias": "v.patch_embd.bias",
             "embeddings.position_embedding.weight": "v.position_embd.weight",
             "embeddings.class_embedding": "v.class_embd",
             "pre_layrnorm.weight": "v.pre_ln.weight", "pre_layrnorm.bias": "v.pre_ln.bias"}
    if family == "idefics3":
        names |= {"post_layernorm.weight": "v.post_ln.weight",
                  "post_layernorm.bias": "v.post_ln.bias"}
    block = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out",
             "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up",
             "mlp.fc2": "ffn_down"}
    out = {}
    for key, tensor in state.items():
        if key.startswith(tower):
            rest = key[len(tower):]
            if rest in names:
                out[names[rest]] = tensor
            elif rest.startswith("encoder.layers."):
                _, _, index, *module, part = rest.split(".")
                if int(index) < blocks:
                    out[f"v.blk.{index}.{block['.'.join(module)]}.{part}"] = tensor
        elif key == "model.connector.modality_projection.proj.weight":
            out["mm.model.fc.weight"] = tensor
        elif key.startswith("model.multi_modal_projector.linear_"):
            n = {"1": 0, "2": 2}[key.split("linear_")[1][0]]
            out[f"mm.{n}.{key.rsplit('.', 1)[1]}"] = tensor
    for name, tensor in out.items():
        writer.add_tensor(name, np.ascontiguousarray(tensor.float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
