"""`streamgrok info`: the model, its kernels and (with --memory) what a server holds."""

from __future__ import annotations

import argparse

from streamgrok.cli.options import (
    DEFAULTS,
    add_cache_options,
    add_model_options,
    cache_config,
    load_from_args,
)


def add_info_command(commands) -> None:
    """The `info` command's arguments."""
    info = commands.add_parser("info", formatter_class=DEFAULTS,
                               help="print model, parameters, dtype, device, threads")
    info.add_argument("--memory", action="store_true",
                      help="also load what a server loads (KV page pool, speech models) and "
                           "report the resident memory each takes")
    add_cache_options(info)
    add_model_options(info)


def cmd_info(args: argparse.Namespace) -> int:
    import psutil
    import torch

    baseline = psutil.Process().memory_info().rss
    loaded = load_from_args(args)
    model_growth = psutil.Process().memory_info().rss - baseline
    cfg, model = loaded.config, loaded.model
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    rows = [
        ("model", loaded.name if loaded.name != loaded.source.name
         else str(loaded.source)),
        ("architecture", cfg.architecture),
        ("parameters", f"{params / 1e6:.1f} M"),
        ("layers / hidden / ffn",
         f"{cfg.num_layers} / {cfg.hidden_size} / {cfg.intermediate_size}"),
        ("heads / kv heads / head dim", f"{cfg.num_heads} / {cfg.num_kv_heads} / {cfg.head_dim}"),
        ("rope theta / scaling", f"{cfg.rope_theta:g} / {cfg.rope_scaling.kind}"),
        ("context", str(cfg.max_positions)),
        ("vocab", str(cfg.vocab_size)),
        ("tied embeddings", str(cfg.tie_embeddings)),
        ("dtype", str(model.dtype).removeprefix("torch.")),
        ("weights in memory", f"{model.weight_bytes() / 2**20:.0f} MiB"),
        ("device", str(model.device)),
        ("threads", str(torch.get_num_threads())),
    ]
    rows += _kernel_rows(model)
    if loaded.vision is not None:
        v = loaded.vision
        rows += [("vision", f"{v.family}: {v.vision.layers_run} of {v.vision.num_layers} "
                            f"layers, {v.vision.hidden_size} wide, {v.preprocess.image_size}px, "
                            f"{v.tokens_per_frame} tokens a frame"),
                 ("vision weights", f"{sum(p.numel() for p in v.tower.parameters()) / 1e6:.1f}"
                                    f" M tower + "
                                    f"{sum(p.numel() for p in v.connector.parameters()) / 1e6:.1f}"
                                    f" M connector, from {v.source}")]
    if args.memory:
        from streamgrok.cli.memory import memory_rows

        rows += memory_rows(baseline, model_growth, loaded, cache_config(args))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _kernel_rows(model) -> list[tuple[str, str]]:
    """The CPU's vector extensions and the native kernels' choice for this model (the build
    is waited for: the first time on a machine it compiles)."""
    from streamgrok.model.quantized import Int4Linear, wait_native_int4
    from streamgrok_kernels.cpu_native import CPU_ISA_ENV, isa_cap, simd_flags

    rows = [("cpu vector extensions", simd_flags()),
            ("native kernels built for", f"{isa_cap()} ({CPU_ISA_ENV})")]
    if model.device.type != "cpu" or not any(isinstance(m, Int4Linear)
                                              for m in model.modules()):
        return rows
    layer = next(m for m in model.modules() if isinstance(m, Int4Linear))
    if wait_native_int4(model):
        from streamgrok_kernels.cpu_int4 import int4_kernel
        choice = f"native, {int4_kernel()} loop"
    elif layer.int4_matmul.native.error:
        choice = f"PyTorch's kernel (native build failed: {layer.int4_matmul.native.error})"
    else:
        choice = "PyTorch's kernel (native kernels off or not vectorized here)"
    return rows + [("int4 matmul", choice)]

