"""`python -m benchmarks kv --parts moe`: a mixture-of-experts model decoding with its experts and
its KV spread over 1, 2 and 4 CPU ranks (gloo), measured, and a labelled projection for GPUs.

The model is the one given when it has experts, else a random Mixtral-layout GGUF the bench
writes (`moe_gguf`; serve it with `bench serve --model FILE --peer llama-server` for the
llama.cpp comparison on the same file). Measured per rank count: the decode step (median),
the weights and KV each rank holds, and the bytes each rank sends per decoded token (expert
all-to-alls and KV-parallel merges); with one rank also the parameters a token multiplies
by, and the bandwidth that step achieves reading them. Then PiKV's expert-sharded layout
(approximate attention, `streamgrok.cache.pikv`) against the full cache on the same stream:
top-1 agreement and KL."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.corpus import stdlib_text
from benchmarks.kv_ranks import StreamResult, StreamScenario, run_ranks
from benchmarks.moe_gguf import MoEShape, write_random_moe_gguf
from streamgrok.bench.timing import measurement_env, median
from streamgrok.cache.config import CacheConfig
from streamgrok.cache.pikv import ExpertShardedKV
from streamgrok.loading.loader import LoadedModel, load_model
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.config import ModelConfig
from streamgrok.model.contiguous_cache import ContiguousKVCache
from streamgrok.model.llama import Transformer
from streamgrok_kernels.cpu_native import CPU_ISA_ENV, isa_cap, simd_flags


@dataclass(frozen=True)
class GpuMoEShape:
    """The model and machine the projection assumes (printed with it)."""

    name: str = "Qwen3-30B-A3B (bf16) on H200s"
    total_params_b: float = 30.5
    active_params_b: float = 3.3
    expert_params_b: float = 29.0  # all experts' weights; the rest is shared by every rank
    layers: int = 48
    hidden: int = 2048
    experts_per_token: int = 8
    weight_bytes: int = 2
    kv_bytes_per_token: int = 48 * 4 * 128 * 2 * 2  # layers x kv heads x dim x K,V x bf16
    memory_gb: float = 141.0
    hbm_tbs: float = 4.8
    kernel_efficiency: float = 0.55
    link_gbs: float = 450.0
    collective_us: float = 15.0


def run_moe(loaded: LoadedModel, weights: str, ranks: tuple[int, ...], context: int,
            decode_steps: int, chunk: int, out_dir: Path) -> dict:
    """Measure the decode step over `ranks`; print the table, the projection and a plot."""
    out_dir.mkdir(parents=True, exist_ok=True)
    source = loaded.source
    if loaded.config.moe is None:
        shape = MoEShape()
        source = write_random_moe_gguf(out_dir / "moe-random.gguf", shape)
        print(f"[moe] {loaded.name} has no experts: wrote {source} (random weights, "
              f"{shape.describe()}, Q8_0)")
    config = load_model(source, weights=weights).config
    ids = loaded.tokenizer.encode(stdlib_text(context * 6))[:context]
    cores = os.cpu_count() or 1
    build = functools.partial(_load_transformer, str(source), weights)
    chunks = [[torch.tensor(ids[i:i + chunk])] for i in range(0, len(ids), chunk)]
    pages = ((context + decode_steps) // 16 + 4) * config.num_layers
    scenario = StreamScenario(chunks, decode_steps,
                              CacheConfig(policy="full", budget_tokens=None), pages)
    rows = []
    for world in tqdm(ranks, desc="moe", unit="run"):
        threads = max(1, cores // world)
        results = run_ranks(world, build, scenario, timeout_s=1800, threads=threads,
                            env=measurement_env(), expert_parallel=True)
        rows.append(_row(config, world, threads, results, decode_steps, context))
    _print_table(source, config, weights, context, rows, cores)
    fidelity = pikv_fidelity(build(), ids, tuple(r for r in ranks if r > 1), chunk)
    projection = project(GpuMoEShape(), (32_768, 262_144, 1_048_576), (1, 2, 4, 8))
    _plot(rows, out_dir / "moe_ranks.png")
    return {"model": str(source), "measured": rows, "pikv": fidelity,
            "projected": projection}


def pikv_fidelity(model: Transformer, ids: list[int], worlds: tuple[int, ...], chunk: int
                  ) -> list[dict]:
    """PiKV's layout (`streamgrok.cache.pikv`) against the full cache on the stream `ids`,
    fed in chunks: per rank count, the share of keys a query sees, top-1 agreement and the
    mean KL(full || PiKV) of the next-token distributions after the first chunk."""
    rows = []
    for world in worlds:
        full = ContiguousKVCache(model.config, 1, len(ids), model.dtype, model.device)
        layout = ExpertShardedKV(model, world)
        agree = total = 0
        kl = 0.0
        try:
            for start in tqdm(range(0, len(ids), chunk), desc=f"pikv {world} ranks",
                              unit="chunk"):
                part = torch.tensor(ids[start:start + chunk], device=model.device)
                want = _all_logits(model, part, full)
                got = _all_logits(model, part, layout)
                if start == 0:
                    continue
                agree += int((want.argmax(-1) == got.argmax(-1)).sum())
                total += part.numel()
                kl += float(torch.nn.functional.kl_div(
                    got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                    reduction="sum"))
        finally:
            layout.close()
        rows.append({"ranks": world, "keys_seen": layout.stats.visible_fraction,
                     "top1_agreement": agree / max(1, total), "kl": kl / max(1, total),
                     "positions": total})
    print(f"\n[moe] PiKV layout (approximate attention: a key on the rank of its top-1 "
          f"expert, a query over the ranks of its top-{model.config.moe.experts_per_token}) "
          f"vs the full cache, {len(ids)}-token stream in {chunk}-token chunks, every "
          "position after the first chunk")
    print(f"{'ranks':>5} {'keys seen':>9} {'top-1 agree':>11} {'KL nats':>8}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['keys_seen']:>8.1%} {r['top1_agreement']:>10.1%} "
              f"{r['kl']:>8.4f}")
    return rows


def _all_logits(model: Transformer, ids: torch.Tensor, backend) -> torch.Tensor:
    batch = BatchMetadata.build([0], [ids.numel()], model.device)
    batch.logit_rows = None
    with torch.inference_mode():
        return model(ids, batch, backend).float()


def _load_transformer(path: str, weights: str) -> Transformer:
    return load_model(path, weights=weights).model


def _row(config: ModelConfig, world: int, threads: int, results: list[StreamResult],
         steps: int, context: int) -> dict:
    first = results[0]
    step_s = median(first.decode_seconds)
    kv_bytes = context * config.kv_bytes_per_token(4)
    sent = max(r.decode_exchanged_bytes + r.decode_expert_bytes for r in results)
    row = {"ranks": world, "threads": threads, "step_ms": step_s * 1000,
           "weight_mb_per_rank": max(r.weight_bytes for r in results) / 2**20,
           "kv_mb_per_rank": kv_bytes / world / 2**20,
           "sent_kb_per_token": sent / steps / 1024}
    if world == 1:
        active = config.active_parameters()
        bytes_per_param = first.weight_bytes / _total_parameters(config)
        row["active_parameters"] = active
        row["read_gb_s"] = (active * bytes_per_param + kv_bytes) / step_s / 1e9
    return row


def _total_parameters(config: ModelConfig) -> int:
    """All parameters (every expert), the embedding counted once."""
    moe = config.moe
    everything = config.active_parameters()
    if moe is not None:
        sparse = sum(moe.is_sparse(layer) for layer in range(config.num_layers))
        everything += (sparse * 3 * config.hidden_size * moe.expert_intermediate_size
                       * (moe.num_experts - moe.experts_per_token))
    return everything


def _print_table(source: Path, config: ModelConfig, weights: str, context: int, rows: list,
                 cores: int) -> None:
    moe = config.moe
    print(f"\n[moe] {source.name}: {config.architecture}, {moe.num_experts} experts, top "
          f"{moe.experts_per_token}; weights {weights}; cpu: {simd_flags()} "
          f"({CPU_ISA_ENV}={isa_cap()}); {cores} cores split between ranks")
    print(f"[moe] one sequence prefilled to {context} tokens (full cache), then batch-1 "
          "decode steps (median); experts and KV spread over the ranks (gloo); 1 rank = one "
          "process (baseline)")
    single = next((r for r in rows if r["ranks"] == 1), None)
    if single is not None:
        print(f"[moe] active parameters per token {single['active_parameters'] / 1e6:.1f} M "
              f"of {_total_parameters(config) / 1e6:.1f} M; 1 rank reads them (and the KV) "
              f"at {single['read_gb_s']:.2f} GB/s")
    print(f"{'ranks':>5} {'thr/rank':>8} {'step ms':>9} {'vs 1 rank':>9} "
          f"{'weights MB/rank':>15} {'KV MB/rank':>10} {'sent KB/token/rank':>18}")
    base = single["step_ms"] if single else float("nan")
    for r in rows:
        print(f"{r['ranks']:>5} {r['threads']:>8} {r['step_ms']:>9.1f} "
              f"{base / r['step_ms']:>8.2f}x {r['weight_mb_per_rank']:>15.1f} "
              f"{r['kv_mb_per_rank']:>10.1f} {r['sent_kb_per_token']:>18.1f}")


def project(shape: GpuMoEShape, contexts: tuple[int, ...], ranks: tuple[int, ...]
            ) -> list[dict]:
    """Time per decoded token on `ranks` GPUs, by a bandwidth model (printed, labelled):
    each rank reads the shared weights, its share of the active experts and its share of
    the KV; per layer, two all-to-alls of the token's hidden rows to and from its experts
    and one all-gather of attention partials."""
    bandwidth = shape.hbm_tbs * 1e12 * shape.kernel_efficiency
    shared_gb = (shape.total_params_b - shape.expert_params_b) * shape.weight_bytes
    active_expert_gb = (shape.active_params_b - (shape.total_params_b - shape.expert_params_b)) \
        * shape.weight_bytes
    print(f"\n[moe] PROJECTION (a model, not a measurement): {shape.name}, HBM "
          f"{shape.hbm_tbs} TB/s x {shape.kernel_efficiency:.0%}, NVLink {shape.link_gbs:g} "
          f"GB/s, {shape.collective_us:g} us per collective; experts and KV split evenly")
    print(f"{'context':>10} " + " ".join(f"{f'{r} GPU':>12}" for r in ranks))
    out = []
    for context in contexts:
        cells = []
        for world in ranks:
            held_gb = shared_gb + shape.expert_params_b * shape.weight_bytes / world \
                + context * shape.kv_bytes_per_token / world / 1e9
            if held_gb > shape.memory_gb:
                cells.append(f"{'no fit':>12}")
                continue
            read_gb = shared_gb + active_expert_gb / world \
                + context * shape.kv_bytes_per_token / world / 1e9
            exchange = 0.0 if world == 1 else shape.layers * (
                3 * shape.collective_us * 1e-6
                + 2 * shape.experts_per_token * shape.hidden * 2 / (shape.link_gbs * 1e9))
            seconds = read_gb * 1e9 / bandwidth + exchange
            out.append({"context": context, "ranks": world, "ms": seconds * 1000})
            cells.append(f"{seconds * 1000:>9.2f} ms")
        print(f"{context:>10} " + " ".join(cells))
    return out


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, left = plt.subplots(figsize=(5.5, 3.6))
    ranks = [r["ranks"] for r in rows]
    left.bar([x - 0.2 for x in range(len(rows))], [r["step_ms"] for r in rows], 0.4,
             label="decode step (ms)")
    right = left.twinx()
    right.bar([x + 0.2 for x in range(len(rows))], [r["weight_mb_per_rank"] for r in rows],
              0.4, color="tab:orange", label="weights per rank (MB)")
    left.set_xticks(range(len(rows)), [f"{n} rank{'s' if n > 1 else ''}" for n in ranks])
    left.set_ylabel("decode step (ms)")
    right.set_ylabel("weights per rank (MB)")
    left.set_title("MoE: experts and KV over CPU ranks (gloo)")
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")
