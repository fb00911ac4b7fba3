"""SmoothQuant for w8a8: move the activations' outlier channels into the weights before
both are quantized to int8.

Quantizing each row of activations to int8 with one scale loses the small channels next to
a few large ones: SmolLM2-135M teacher-forced on prose agreed with float32 on 88% of next
tokens with per-row int8 activations, against 95.5% with int8 weights alone. SmoothQuant
(Xiao et al., 2023) scales each input channel j of a linear layer by
s_j = max|x_j|^a / max|w_j|^(1-a): x_j / s_j and w_j * s_j give the same product, and
both are then even enough for int8 (a = 0.5, the output head left at bfloat16
activations: 96% agreement, KL 0.013 nats). The division folds exactly into what
produces x, so nothing is added to a step:

- the inputs of q/k/v and of gate/up are RMSNorm outputs: the norm's weight is divided;
- the input of the down projection is silu(gate) * up: up's output rows are divided;
- the input of the output projection is attention over V: V's rows are divided (one scale
  per KV-head channel, shared by the query heads of its group).

The output head keeps bfloat16 activations (int8 weights, as q8): per-row int8 activations
there cost the most agreement (SmolLM2 on prose: KL 0.023 with them, 0.013 without), and it
runs on one row per sequence.

The channel maxima come from a calibration pass of a fixed text (`calibration_ids`) through
the model quantized to int8 weights; `rescaled` then applies the scales to each checkpoint
tensor by name as the model is built again, so the fold is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from streamgrok.model.batch import BatchMetadata
from streamgrok.model.config import ModelConfig

SMOOTHING_ALPHA = 0.5  # the SmoothQuant paper's; 0.45-0.5 measured best for SmolLM2
CALIBRATION_TOKENS = 512
_MIN = 1e-5
# Not the text `python -m benchmarks decode` measures agreement on (the same documentation, 200k
# characters on), with chat-like lines so both kinds of text set the ranges.
_CALIBRATION_SKIP_CHARS = 200_000
_CHAT_LINES = (
    "User: What is happening in the video right now?\n"
    "Assistant: A person walks into the kitchen, opens the fridge and takes out a bottle.\n"
    "User: Did anyone speak in the last minute?\n"
    "Assistant: Yes. At 00:41 someone said \"the delivery is late again\".\n"
)


def calibration_ids(encode: Callable[[str], list[int]],
                    tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """`tokens` ids of fixed calibration text: chat-like lines and English prose (the
    Python documentation's topics, a part `python -m benchmarks decode` does not measure on)."""
    try:  # (bench.corpus reads the same text; the model layer may not import bench)
        from pydoc_data.topics import topics
        prose = "\n\n".join(topics[k] for k in sorted(topics))[_CALIBRATION_SKIP_CHARS:]
        prose = prose[:50_000]
    except ImportError:  # a Python without its documentation data
        prose = ""
    ids = encode(_CHAT_LINES + prose)
    return (ids * (tokens // len(ids) + 1))[:tokens]


@dataclass
class Smoothing:
    """Per-layer input-channel scales s (activations divided by s, weights multiplied)."""

    config: ModelConfig
    attention: list[torch.Tensor] = field(default_factory=list)  # q/k/v input [hidden]
    feed_forward: list[torch.Tensor] = field(default_factory=list)  # gate/up input [hidden]
    down: list[torch.Tensor] = field(default_factory=list)  # down input [intermediate]
    values: list[torch.Tensor] = field(default_factory=list)  # V channels [kv_heads * D]

    def rescaled(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Checkpoint tensor `name` with the smoothing folded in (others unchanged)."""
        parts = name.split(".")
        if parts[0] != "layers" or len(parts) < 4:
            return tensor
        layer, module = int(parts[1]), ".".join(parts[2:-1])
        columns, rows = self._scales(layer, module)
        if parts[-1] == "bias":  # an output row's bias scales with the row
            return tensor if rows is None else tensor / rows.to(tensor.dtype)
        if rows is not None:  # a weight: norms have no row scales
            tensor = tensor / rows.to(tensor.dtype)[:, None]
        if columns is not None and tensor.dim() == 2:
            tensor = tensor * columns.to(tensor.dtype)
        elif columns is not None:  # a norm weight: what produces the smoothed input
            tensor = tensor / columns.to(tensor.dtype)
        return tensor

    def _scales(self, layer: int, module: str
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(scales multiplying the columns, scales dividing the rows) of a layer's module;
        for a norm, the first divides its weight."""
        if module in ("attn_norm", "attn.wq", "attn.wk"):
            return self.attention[layer], None
        if module == "attn.wv":
            return self.attention[layer], self.values[layer]
        if module == "attn.wo":
            return self._value_channels_per_head(layer), None
        if module in ("ffn_norm", "ffn.w_gate"):
            return self.feed_forward[layer], None
        if module == "ffn.w_up":
            return self.feed_forward[layer], self.down[layer]
        if module == "ffn.w_down":
            return self.down[layer], None
        return None, None

    def _value_channels_per_head(self, layer: int) -> torch.Tensor:
        config = self.config
        group = config.num_heads // config.num_kv_heads
        per_kv = self.values[layer].view(config.num_kv_heads, 1, config.head_dim)
        return per_kv.expand(-1, group, -1).reshape(-1)


def smoothing_for(model: nn.Module, ids: list[int], alpha: float = SMOOTHING_ALPHA
                  ) -> Smoothing:
    """The scales for `model` (a `Transformer`, any weights) from one prefill of `ids`."""
    from streamgrok.model.contiguous_cache import ContiguousKVCache

    inputs = _input_maxima(model)
    with torch.inference_mode():
        cache = ContiguousKVCache(model.config, 1, len(ids), model.dtype, model.device)
        model(torch.tensor(ids, device=model.device),
              BatchMetadata.build([0], [len(ids)], model.device), cache)
    inputs.remove_hooks()
    config = model.config
    smoothing = Smoothing(config)
    for block in model.layers:
        attn, ffn = block.attn, block.ffn
        qkv = [attn.wqkv] if attn.wqkv is not None else [attn.wq, attn.wk, attn.wv]
        gate_up = [ffn.w_gate_up] if ffn.w_gate_up is not None else [ffn.w_gate, ffn.w_up]
        smoothing.attention.append(_scale(inputs.of(qkv[0]), _column_maxima(qkv), alpha))
        smoothing.feed_forward.append(_scale(inputs.of(gate_up[0]), _column_maxima(gate_up),
                                             alpha))
        smoothing.down.append(_scale(inputs.of(ffn.w_down), _column_maxima([ffn.w_down]),
                                     alpha))
        per_head = _scale(inputs.of(attn.wo), _column_maxima([attn.wo]), alpha)
        group = config.num_heads // config.num_kv_heads
        smoothing.values.append(per_head.view(config.num_kv_heads, group, config.head_dim)
                                .amax(1).reshape(-1))  # the largest of a KV group
    return smoothing


class _InputMaxima:
    """Per-channel max |input| of every linear module of a model, by forward pre-hooks."""

    def __init__(self) -> None:
        self.maxima: dict[int, torch.Tensor] = {}
        self.handles: list = []

    def watch(self, module: nn.Module) -> None:
        def hook(mod: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float().cpu()
            seen = self.maxima.get(id(mod))
            self.maxima[id(mod)] = x if seen is None else torch.maximum(seen, x)
        self.handles.append(module.register_forward_pre_hook(hook))

    def of(self, module: nn.Module) -> torch.Tensor:
        return self.maxima[id(module)]

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()


def _input_maxima(model: nn.Module) -> _InputMaxima:
    inputs = _InputMaxima()
    for module in model.modules():
        if hasattr(module, "in_features") and hasattr(module, "out_features"):
            inputs.watch(module)
    return inputs


def _column_maxima(layers: list[nn.Module]) -> torch.Tensor:
    """max |w| per input channel over the rows of `layers` (sharing one input)."""
    maxima = []
    for layer in layers:
        weight = layer.dequantized(torch.float32) if hasattr(layer, "dequantized") \
            else layer.weight.detach().float()
        maxima.append(weight.abs().amax(0).cpu())
    return torch.stack(maxima).amax(0)


def _scale(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    return (x_max.clamp(min=_MIN) ** alpha / w_max.clamp(min=_MIN) ** (1 - alpha)) \
        .clamp(min=_MIN)
