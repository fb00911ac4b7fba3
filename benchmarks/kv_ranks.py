"""Run the same cache scenario on N local ranks (gloo over loopback) or in one process: what
the KV-parallel equality tests and `python -m benchmarks kv --parts kvp` share."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from streamgrok.bench.server_process import free_port
from streamgrok.cache.config import CacheConfig
from streamgrok.cache.kv_group import KVGroup, KVParallelError
from streamgrok.cache.kv_parallel import KVParallelCache
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.expert_parallel import ExpertShard, shard_experts
from streamgrok.model.llama import Transformer
from streamgrok.stream_tokens import Modality, TokenInfo


@dataclass
class StreamScenario:
    """Chunks of a token stream per sequence prefilled step by step (every sequence in each
    step's batch, eviction between steps), then greedy decode steps."""

    chunks: list[list[torch.Tensor]]  # [step][sequence] token ids
    decode_steps: int
    cache_config: CacheConfig
    num_pages: int = 4096
    frames: bool = False  # odd prefill steps are frames (one per step), step 0 starts protected
    frame_embeddings: bool = False  # frames carry CLIP-like embeddings, pairs of them alike


@dataclass
class StreamResult:
    """Logits after every step, [steps, sequences, vocab], and what the cache did."""

    logits: torch.Tensor
    evicted_tokens: int
    lengths: list[list[int]]  # final cached tokens per sequence and layer
    decode_seconds: list[float]
    exchanged_bytes: int  # sent by this rank in collectives, all steps
    decode_exchanged_bytes: int  # of which during the decode steps
    expert_sent_bytes: int = 0  # hidden rows sent for expert parallelism, all steps
    decode_expert_bytes: int = 0  # of which during the decode steps
    weight_bytes: int = 0  # the model's weights this rank holds


def run_stream(model: Transformer, cache: PagedKVCache | KVParallelCache,
               scenario: StreamScenario, shards: list[ExpertShard] = ()) -> StreamResult:
    """Play the scenario on `cache`; every rank of a KV-parallel cache plays it alike
    (`shards`: the model's expert-parallel layers, whose bytes sent are counted)."""
    sequences = len(scenario.chunks[0])
    for seq_id in range(sequences):
        cache.add_sequence(seq_id)
    steps, seconds = [], []

    def step(ids: list[torch.Tensor], index: int | None = None) -> torch.Tensor:
        counts = {seq_id: len(chunk) for seq_id, chunk in enumerate(ids)}
        batch = BatchMetadata.build(list(counts), list(counts.values()), model.device)
        if scenario.frames and index is not None:
            batch.token_info = TokenInfo.concat([_step_info(index, n) for n in counts.values()])
        cache.reserve(counts)
        with torch.inference_mode():
            logits = model(torch.cat(ids).to(model.device), batch, cache.attention)
        cache.commit()
        if scenario.frame_embeddings and index is not None and index % 2:
            for seq_id in counts:
                cache.index_frame(seq_id, index, _frame_embedding(index))
        cache.evict()
        steps.append(logits.cpu())
        return logits

    for index, chunk in enumerate(scenario.chunks):
        logits = step(chunk, index)
    sent_before_decode = getattr(cache, "exchanged_bytes", 0)
    experts_before_decode = sum(shard.sent_bytes for shard in shards)
    for _ in range(scenario.decode_steps):
        started = time.perf_counter()
        logits = step([token[None] for token in logits.argmax(-1)])
        seconds.append(time.perf_counter() - started)
    return StreamResult(
        logits=torch.stack(steps),
        evicted_tokens=cache.stats.evicted_tokens,
        lengths=[cache.layer_lengths(s) for s in range(sequences)],
        decode_seconds=seconds,
        exchanged_bytes=getattr(cache, "exchanged_bytes", 0),
        decode_exchanged_bytes=getattr(cache, "exchanged_bytes", 0) - sent_before_decode,
        expert_sent_bytes=sum(shard.sent_bytes for shard in shards),
        decode_expert_bytes=sum(shard.sent_bytes for shard in shards) - experts_before_decode,
        weight_bytes=model.weight_bytes(),
    )


def _frame_embedding(index: int) -> torch.Tensor:
    """Frames 1 and 3 show one scene, 5 and 7 the next, and so on."""
    gen = torch.Generator().manual_seed(index // 4)
    return torch.nn.functional.normalize(torch.randn(16, generator=gen), dim=0)


def _step_info(index: int, count: int) -> TokenInfo:
    if index % 2:
        return TokenInfo.uniform(count, Modality.FRAME, float(index), index, False)
    info = TokenInfo.text(count, timestamp=float(index))
    if index == 0:
        info.protected[:8] = True
    return info


def run_single(model: Transformer, scenario: StreamScenario) -> StreamResult:
    """The scenario on one process's `PagedKVCache` (the baseline)."""
    cache = PagedKVCache(model.config, scenario.cache_config, model.dtype, model.device,
                         num_pages=scenario.num_pages, kernels=model.kernels)
    return run_stream(model, cache, scenario)


def run_ranks(world: int, build_model: Callable[[], Transformer], scenario: StreamScenario,
              timeout_s: float = 120.0, fail_rank: int | None = None, failure: str = "exit",
              threads: int = 1, env: dict[str, str] | None = None,
              expert_parallel: bool = False) -> list[StreamResult]:
    """The scenario on `world` processes sharing one KV-parallel cache; each rank's result,
    in rank order; with `expert_parallel` each rank also holds only its block of a
    mixture's experts (`streamgrok.model.expert_parallel`). `fail_rank` makes that rank
    exit ("exit") or stop answering ("stall") before its first step, to test that the
    others report an error instead of hanging.
    With `world` 1 the one process runs a plain `PagedKVCache` (the baseline). `env` is the
    rank processes' environment (default: this one's).
    Raises KVParallelError naming the ranks that failed."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank_main, daemon=True,
                             args=(rank, world, port, build_model, scenario, results,
                                   timeout_s, failure if rank == fail_rank else None, threads,
                                   expert_parallel))
             for rank in range(world)]
    saved = dict(os.environ)
    try:
        if env is not None:  # a spawned process starts with this process's os.environ
            os.environ.clear()
            os.environ.update(env)
        for proc in procs:
            proc.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    got: dict[int, StreamResult | str] = {}
    deadline = time.monotonic() + timeout_s * 3
    try:
        while len(got) < world - (fail_rank is not None):
            try:
                rank, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty as exc:
                raise KVParallelError(
                    f"KV-parallel ranks gave no result within {timeout_s * 3:g} s") from exc
            got[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    errors = [f"rank {rank}: {value}" for rank, value in sorted(got.items())
              if isinstance(value, str)]
    if errors:
        raise KVParallelError("; ".join(errors))
    for result in got.values():
        result.logits = torch.from_numpy(result.logits)
    return [got[rank] for rank in sorted(got)]


def _rank_main(rank: int, world: int, port: int, build_model, scenario: StreamScenario,
               results, timeout_s: float, failure: str | None, threads: int,
               expert_parallel: bool) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    group = None
    try:
        group = KVGroup.from_env(timeout_s=timeout_s, backend="gloo")
        if failure == "exit":
            os._exit(3)
        if failure == "stall":
            time.sleep(timeout_s * 10)
        model = build_model()
        shards = shard_experts(model, group) if expert_parallel else []
        if world == 1:
            result = run_single(model, scenario)
        else:
            cache = KVParallelCache(model.config, group, scenario.cache_config, model.dtype,
                                    model.device, num_pages=scenario.num_pages,
                                    kernels=model.kernels)
            result = run_stream(model, cache, scenario, shards)
        # numpy pickles by value: a tensor would go as a shared-memory handle that dies
        # with this process
        result.logits = result.logits.numpy()
        results.put((rank, result))
    except Exception as exc:  # reported to the parent, which raises it
        results.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
    finally:
        if group is not None:
            group.close()
