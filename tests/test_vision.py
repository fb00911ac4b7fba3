"""Vision-language models loaded without transformers, checked against transformers on tiny
random models: SmolVLM2 (Idefics3) and LLaVA folders, and the same weights as mmproj GGUF."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import write_gguf
from vlm_helpers import IMAGE_SPECIALS, IMAGE_TOKEN, llava_folder, smolvlm_folder, write_mmproj

from streamgrok.errors import ModelLoadError, UnsupportedArchitecture
from streamgrok.loading.loader import load_model
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.contiguous_cache import ContiguousKVCache
from streamgrok.vision.mmproj import load_mmproj

pytest.importorskip("transformers")
ATOL = 1e-4


def frames(seed: int, shapes=((48, 80), (90, 60))) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for h, w in shapes:  # smooth content plus noise, as a real frame has both
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([128 + 100 * np.sin(x / 7 + c) * np.cos(y / 5) for c in range(3)], -1)
        out.append(np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8))
    return out


def lm_logits(loaded, ids: list[int], image_rows: torch.Tensor, image_token: int):
    """Our language model over `ids`, rows holding `image_token` replaced by `image_rows`."""
    model = loaded.model
    batch = BatchMetadata.build([0], [len(ids)])
    batch.logit_rows = None
    ids_t = torch.tensor(ids)
    batch.embed_rows = torch.nonzero(ids_t == image_token).flatten()
    batch.embed_values = image_rows
    return model(ids_t, batch, ContiguousKVCache(model.config, 1, len(ids)))


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smolvlm")
    return folder, smolvlm_folder(folder)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava")
    return folder, llava_folder(folder)


def test_smolvlm_video_frames_preprocess_like_the_reference_processor(smolvlm):
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    folder, _ = smolvlm
    reference = SmolVLMVideoProcessor.from_pretrained(folder)
    vision = load_model(folder).vision
    for frame in frames(1):
        want = reference(videos=[torch.from_numpy(frame).permute(2, 0, 1)[None]],
                         return_tensors="pt", do_sample_frames=False)["pixel_values"][0]
        got = vision.pixels([frame])
        assert got.shape == want.shape == (1, 3, 64, 64)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_smolvlm_tower_connector_and_logits_match_transformers(smolvlm):
    folder, ref = smolvlm
    loaded = load_model(folder)
    vision = loaded.vision
    assert vision.family == "idefics3" and vision.tokens_per_frame == 16
    pixels = vision.pixels(frames(2))
    with torch.no_grad():
        want_features = ref.model.vision_model(pixel_values=pixels).last_hidden_state
        want_tokens = ref.model.get_image_features(pixels[:, None], return_dict=True)
        want_tokens = torch.cat(list(want_tokens.pooler_output)).view(2, 16, -1)
    torch.testing.assert_close(vision.features(pixels), want_features, atol=ATOL, rtol=0)
    tokens = vision.connector(vision.features(pixels))
    torch.testing.assert_close(tokens, want_tokens, atol=ATOL, rtol=0)

    tok = loaded.tokenizer
    prompt = ("<|im_start|>User:" + "".join(
        vision.framing.before(t) + "<image>" * 16 + vision.framing.after() for t in (0, 61))
        + "what is in them?<end_of_utterance>\nAssistant:")
    ids = tok.encode(prompt, add_bos=False)
    assert ids.count(IMAGE_TOKEN) == 32
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids]), pixel_values=pixels[None]).logits[0]
    got = lm_logits(loaded, ids, tokens.reshape(32, -1), IMAGE_TOKEN)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_smolvlm_framing_is_the_reference_video_prompt(smolvlm):
    vision = load_model(smolvlm[0]).vision
    assert vision.framing.before(75.4) == (
        "\nFrame from 01:15:<fake_token_around_image><global-img>")
    assert vision.framing.after() == "<fake_token_around_image>"


def test_frame_rows_put_framing_embeddings_around_the_image_vectors(smolvlm):
    loaded = load_model(smolvlm[0])
    vision, tok = loaded.vision, loaded.tokenizer
    vectors = vision.encode(frames(3)[:1])[0]
    rows = vision.frame_rows(vectors, 3.0, tok, loaded.model.embed)
    before = tok.encode(vision.framing.before(3.0), add_bos=False)
    after = tok.encode(vision.framing.after(), add_bos=False)
    assert rows.shape == (len(before) + 16 + len(after), 64)
    torch.testing.assert_close(rows[len(before): len(before) + 16], vectors)
    torch.testing.assert_close(rows[: len(before)], loaded.model.embed(torch.tensor(before)))
    assert tok.hf.token_to_id(IMAGE_SPECIALS[0]) in before and after == [
        tok.hf.token_to_id(IMAGE_SPECIALS[0])]


def test_llava_preprocess_tower_projector_and_logits_match_transformers(llava):
    from transformers import CLIPImageProcessor

    folder, ref = llava
    loaded = load_model(folder)
    vision = loaded.vision
    assert vision.family == "llava" and vision.tokens_per_frame == 16  # (56/14)^2, CLS dropped
    assert vision.vision.layers_run == 2  # feature layer -2 of 3
    reference = CLIPImageProcessor.from_pretrained(folder)
    images = frames(4)
    want_pixels = reference(images=[torch.from_numpy(f).permute(2, 0, 1) for f in images],
                            return_tensors="pt")["pixel_values"]
    pixels = vision.pixels(images)
    torch.testing.assert_close(pixels, want_pixels, atol=1e-5, rtol=0)
    with torch.no_grad():
        hidden = ref.model.vision_tower(pixel_values=pixels, output_hidden_states=True)
        want_tokens = torch.stack(list(ref.model.get_image_features(
            pixels, vision_feature_layer=-2, vision_feature_select_strategy="default",
            return_dict=True).pooler_output))
    torch.testing.assert_close(vision.features(pixels), hidden.hidden_states[-2][:, 1:],
                               atol=ATOL, rtol=0)
    tokens = vision.connector(vision.features(pixels))
    torch.testing.assert_close(tokens, want_tokens, atol=ATOL, rtol=0)
    ids = loaded.tokenizer.encode("<|im_start|>USER: " + "<image>" * 16 + "\n" + "<image>" * 16
                                  + " the two?<|im_end|>", add_bos=False)
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    got = lm_logits(loaded, ids, tokens.reshape(32, -1), IMAGE_TOKEN)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["idefics3", "llava"])
def test_mmproj_gguf_gives_the_same_tokens_as_the_folder(family, smolvlm, llava, tmp_path):
    folder, ref = smolvlm if family == "idefics3" else llava
    path = write_mmproj(tmp_path / "mmproj.gguf", ref, family)
    from_file = load_mmproj(path, 64, torch.float32, "cpu")
    from_folder = load_model(folder).vision
    assert from_file.family == family
    assert from_file.tokens_per_frame == from_folder.tokens_per_frame
    pixels = from_folder.pixels(frames(5))
    if family == "llava":  # an idefics3 mmproj resizes straight to the tower's size, as
        # llama.cpp does, without the processor's intermediate longest-edge step
        torch.testing.assert_close(from_file.pixels(frames(5)), pixels, atol=1e-5, rtol=0)
    assert from_file.pixels(frames(5)).shape == pixels.shape
    torch.testing.assert_close(from_file.connector(from_file.features(pixels)),
                               from_folder.connector(from_folder.features(pixels)),
                               atol=ATOL, rtol=0)


def test_text_gguf_with_mmproj_loads_as_one_vision_model(llava, tmp_path):
    folder, ref = llava
    text = load_model(folder, fuse=False).model
    gguf_path = write_gguf(tmp_path / "text.gguf", text, extra_specials=tuple(IMAGE_SPECIALS))
    mmproj = write_mmproj(tmp_path / "mmproj.gguf", ref, "llava")
    loaded = load_model(gguf_path, mmproj=mmproj)
    assert loaded.vision is not None and loaded.vision.family == "llava"
    with pytest.raises(ModelLoadError, match="has its own vision tower"):
        load_model(folder, mmproj=mmproj)


def test_mmproj_errors_name_the_problem(smolvlm, tmp_path):
    folder, ref = smolvlm
    with pytest.raises(ModelLoadError, match="mmproj file not found"):
        load_mmproj(tmp_path / "none.gguf", 64, torch.float32, "cpu")
    path = write_mmproj(tmp_path / "mmproj.gguf", ref, "idefics3")
    with pytest.raises(ModelLoadError, match="projects to 64-dim tokens but the language "
                                             "model needs 96"):
        load_mmproj(path, 96, torch.float32, "cpu")
    text = write_gguf(tmp_path / "text.gguf", load_model(folder, fuse=False).model,
                      extra_specials=tuple(IMAGE_SPECIALS))
    with pytest.raises(ModelLoadError, match="not an mmproj file"):
        load_mmproj(text, 64, torch.float32, "cpu")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_mmproj(tmp_path / "bad.gguf", 64, torch.float32, "cpu")


def test_unsupported_vision_configs_are_named(smolvlm, tmp_path):
    import json
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(smolvlm[0], folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["architectures"] = ["Qwen2VLForConditionalGeneration"]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedArchitecture, match="Qwen2VLForConditionalGeneration"):
        load_model(folder)
    raw["architectures"] = ["SmolVLMForConditionalGeneration"]
    raw["vision_config"]["hidden_act"] = "relu"
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="vision activation 'relu'"):
        load_model(folder)


SMOLVLM_TEMPLATE = (  # the shape of SmolVLM2's own template: content is a list of typed parts
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}"
    "{% endif %}")


def test_a_processor_chat_template_with_typed_parts_renders_plain_text_turns(smolvlm, tmp_path):
    import json
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(smolvlm[0], folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": SMOLVLM_TEMPLATE}))
    tok = load_model(folder).tokenizer
    text = tok.render_chat([{"role": "user", "content": "what is on screen?"}])
    assert text == "<|im_start|>User: what is on screen?<end_of_utterance>\nAssistant:"


def test_the_vision_benchmark_measures_real_shapes_and_plots(tmp_path):
    from dataclasses import replace

    from benchmarks.vision import (
        CLIP_B32,
        SMOLVLM2_256M,
        plot,
        random_encoder,
        time_batches,
        tower_flops,
    )
    from streamgrok.vision.config import ConnectorConfig, VisionConfig

    assert SMOLVLM2_256M.connector.tokens_per_image(SMOLVLM2_256M.vision) == 64
    assert CLIP_B32.connector.tokens_per_image(CLIP_B32.vision) == 49
    # SigLIP-B/16 at 512 px: ~87 M multiply-adds per patch row block; about 0.2 TFLOP a frame
    assert 1.5e11 < tower_flops(SMOLVLM2_256M) < 3e11
    small = replace(SMOLVLM2_256M, vision=VisionConfig(32, 64, 1, 4, 32, 8),
                    connector=ConnectorConfig("pixel_shuffle", 16, 2, bias=False),
                    preprocess=replace(SMOLVLM2_256M.preprocess, image_size=32,
                                       longest_edge=48))
    encoder = random_encoder(small)
    assert encoder.random_weights and encoder.encode(frames(6)).shape == (2, 4, 16)
    assert time_batches(encoder.encode, frames(6), 2, 4) > 0
    path = plot([("a", 1, 2.0), ("a", 16, 3.0), ("b", 1, 1.0)], tmp_path / "p.png")
    assert path.stat().st_size > 1000
