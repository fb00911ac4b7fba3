"""Builders for tiny random models and the model files the tests write themselves."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from streamgrok.model.config import ModelConfig
from streamgrok.model.gguf_loader import _GLOBAL_NAMES, _LAYER_NAMES
from streamgrok.model.hf_loader import _GLOBAL_NAMES as HF_GLOBAL
from streamgrok.model.hf_loader import _LAYER_NAMES as HF_LAYER
from streamgrok.model.llama import Transformer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def tiny_config(**overrides) -> ModelConfig:
    """A small Llama shape whose matrices fit GGUF's 32-element quantization blocks."""
    base = dict(
        architecture="llama",
        vocab_size=len(byte_vocab()),
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_embeddings=False,
        max_positions=512,
    )
    base.update(overrides)
    return ModelConfig(**base)


def random_model(config: ModelConfig, seed: int = 0) -> Transformer:
    """A Transformer with random weights (norm weights perturbed so they matter)."""
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, 0.08)
    return model.eval().requires_grad_(False)


@contextmanager
def eager_decode(model: Transformer) -> Iterator[None]:
    """`model` with its compiled (or native) decode steps swapped for eager ones, on the
    contiguous cache and the paged one."""
    from streamgrok.model.compiled_decode import CompiledDecode
    from streamgrok.model.native_decode import PagedNativeDecode

    kept = model.compiled_decode, model.paged_native
    model.compiled_decode, model.paged_native = CompiledDecode(False), PagedNativeDecode(False)
    try:
        yield
    finally:
        model.compiled_decode, model.paged_native = kept


def eagerly_prefilled(model: Transformer, slots: int, capacity: int,
                      dtype: torch.dtype = torch.float32):
    """A contiguous cache of `slots` sequences (3, 7, 11, ... random tokens) prefilled by the
    eager model."""
    from streamgrok.model.batch import BatchMetadata
    from streamgrok.model.contiguous_cache import ContiguousKVCache

    cache = ContiguousKVCache(model.config, slots, capacity, dtype)
    gen = torch.Generator().manual_seed(slots * 100 + capacity)
    with torch.inference_mode(), eager_decode(model):
        for seq in range(slots):
            n = 3 + 4 * seq
            ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen)
            model(ids, BatchMetadata.build([seq], [n]), cache)
    return cache


def assert_a_step_falls_back_eagerly(model: Transformer, dtype: torch.dtype) -> None:
    """A decode step over a cache of `dtype`, which the model's compiled (or native) step
    does not take, runs eagerly, counted, with the eager model's logits."""
    from streamgrok.model.batch import BatchMetadata

    decode = model.compiled_decode
    cache, reference = (eagerly_prefilled(model, 1, 30, dtype) for _ in range(2))
    fallbacks = decode.eager_fallbacks
    with torch.inference_mode():
        got = model(torch.tensor([9]), BatchMetadata.build([0], [1]), cache)
        with eager_decode(model):
            want = model(torch.tensor([9]), BatchMetadata.build([0], [1]), reference)
    torch.testing.assert_close(got, want)
    assert decode.eager_fallbacks == fallbacks + 1 and decode.ready


def byte_vocab() -> list[str]:
    """Byte-level alphabet, a few merges' results, then the special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return alphabet + ["th", "the", "Ġthe", "in"] + SPECIALS


def byte_merges() -> list[str]:
    return ["t h", "th e", "Ġ the", "i n"]


def permute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (what convert_hf_to_gguf.py writes)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(heads, 2, rows // heads // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def write_gguf(
    path: Path,
    model: Transformer,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    architecture: str = "llama",
    extra_tensor: tuple[str, np.ndarray, gguf.GGMLQuantizationType] | None = None,
    extra_specials: tuple[str, ...] = (),
) -> Path:
    """Write `model` as a GGUF file; 2-D weights in `qtype`, norms in F32; `extra_specials`
    are special tokens after the byte vocabulary (a vision model's image tokens)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_positions)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    add_byte_tokenizer(writer, extra_specials)
    inverse = {v: k for k, v in _GLOBAL_NAMES.items()}
    inverse_layer = {v: k for k, v in _LAYER_NAMES.items()}
    for name, tensor in model.state_dict().items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            gguf_name = f"blk.{index}.{inverse_layer[rest]}"
        else:
            gguf_name = inverse[name]
        array = tensor.float().numpy()
        if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            array = permute_rotary(array, cfg.num_heads)
        elif gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            array = permute_rotary(array, cfg.num_kv_heads)
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    if extra_tensor is not None:
        name, data, raw_type = extra_tensor
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_byte_tokenizer(writer: gguf.GGUFWriter, extra_specials: tuple[str, ...] = ()) -> None:
    """The tiny byte-level BPE (`byte_vocab()`, then `extra_specials`) and the chat
    template, as GGUF metadata."""
    tokens = byte_vocab() + list(extra_specials)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    specials = {*SPECIALS, *extra_specials}
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(byte_merges())
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(CHAT_TEMPLATE)


def byte_tokenizer() -> HFTokenizer:
    """The same tiny byte-level BPE as byte_vocab(), as a tokenizers object."""
    tokens = byte_vocab()
    tok = HFTokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[tuple(m.split(" ")) for m in byte_merges()],
        )
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return tok


def write_hf_folder(folder: Path, model: Transformer) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json."""
    cfg = model.config
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": [
                    {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[cfg.architecture]
                ],
                "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden_size,
                "intermediate_size": cfg.intermediate_size,
                "num_hidden_layers": cfg.num_layers,
                "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.num_kv_heads,
                "rope_theta": cfg.rope_theta,
                "rms_norm_eps": cfg.rms_norm_eps,
                "tie_word_embeddings": cfg.tie_embeddings,
                "max_position_embeddings": cfg.max_positions,
                "attention_bias": cfg.attention_bias,
            }
        )
    )
    inverse = {v: k for k, v in HF_GLOBAL.items()}
    inverse_layer = {v: k for k, v in HF_LAYER.items()}
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            tensors[f"model.layers.{index}.{inverse_layer[rest]}"] = tensor.contiguous()
        else:
            tensors[inverse[name]] = tensor.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
                    "chat_template": CHAT_TEMPLATE})
    )
    return folder


async def queue_streaming_questions(engine) -> list:
    """Three sessions streaming notes past a small budget, each asking while more notes
    follow, all queued inside `engine.paused()` so every run schedules the same steps;
    returns the greedy answers (8 tokens each)."""
    from streamgrok.model.sampling import SamplingParams

    async with engine.paused():
        sessions = [engine.new_session("sys") for _ in range(3)]
        for i, session in enumerate(sessions):
            await session.append_message("note " * (10 + 9 * i))
        asks = [s.ask(f"question {i}?", SamplingParams(max_tokens=8))
                for i, s in enumerate(sessions)]
        for session in sessions:
            await session.append_message("later " * 12)
    return asks


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def skip_unless_int4_vectorized(built: bool, error: str | None) -> None:
    """Skip (with the reason) where the native int4 matmul is not vectorized on this CPU:
    its build failed, or the CPU (or STREAMGROK_CPU_ISA=portable) leaves only its portable
    loop, where int4 layers keep PyTorch's kernel. A build that succeeds is checked by the
    caller; this only names why the native path is not there to test."""
    if built:
        return
    if error:
        raise AssertionError(f"the native kernels did not build: {error}")
    import pytest

    from streamgrok_kernels.cpu_int4 import int4_kernel
    pytest.skip(f"the native int4 matmul runs its {int4_kernel()} loop on this CPU "
                "(no AVX2+FMA or AVX-512 VNNI): int4 layers keep PyTorch's kernel")


def run_script(script: Path, env: dict[str, str], *args: str
               ) -> subprocess.CompletedProcess[str]:
    """`script` in a fresh process as a user's would run (no TRITON_INTERPRET), with the
    tests' helpers importable and `env` set; asserts it succeeded."""
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(env, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                                 full.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, str(script), *args], env=full,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def torchrun_launcher(ranks: int) -> list[str]:
    """The command that starts `ranks` local processes of `-m ...` under torchrun."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--nproc-per-node", str(ranks), "--master-port", str(free_port())]


def start_serve(launcher: list[str], model: str, *extra: str) -> tuple[subprocess.Popen, int]:
    """`streamgrok serve` of `model` on a free port (speech off, no load ticks, a small KV
    pool), started by `launcher` ([python] or `torchrun_launcher`); the process and its
    port once it listens (what it printed until then in `process.startup_output`)."""
    process = subprocess.Popen(
        [*launcher, "-m", "streamgrok", "serve", "--port", "0", "--model", model,
         "--set", "transcribe=false", "--load-tick", "0", "--kv-memory-gib", "0.05", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    process.startup_output = ""  # what it printed until it listened
    for line in process.stdout:
        process.startup_output += line
        if match := re.search(r"on http://127\.0\.0\.1:(\d+)/", line):
            return process, int(match.group(1))
    raise AssertionError(f"server exited: {process.wait()}")


def ask_chat(port: int, content: str = "hello there, how are you doing today?",
             max_tokens: int = 12, model: str = "tiny") -> str:
    """One greedy /v1/chat/completions answer from the server on `port`."""
    body = json.dumps({"model": model, "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]})
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]
