"""Expert parallelism under KV parallelism: a tiny mixture of experts over 2 and 4 CPU ranks
(gloo on loopback), each holding a block of the experts, gives the logits of one process."""

from __future__ import annotations

import functools
import signal
import sys

import pytest
import torch
from helpers import ask_chat, random_model, start_serve, tiny_config, torchrun_launcher

from benchmarks.kv_ranks import StreamScenario, run_ranks, run_single
from streamgrok.cache.config import CacheConfig
from streamgrok.model.config import MoEConfig
from streamgrok.model.expert_parallel import AbsentExpert, expert_owner, shard_experts

MOE = MoEConfig(num_experts=8, experts_per_token=2, expert_intermediate_size=32,
                normalize_weights=True, shared_intermediate_size=32, shared_gated=True,
                dense_layers=(1,))
CONFIG = tiny_config(architecture="qwen2_moe", num_layers=3, max_positions=4096, moe=MOE)
BUILD = functools.partial(random_model, CONFIG, 0)


def scenario(steps: list[list[int]], decode: int = 5) -> StreamScenario:
    generator = torch.Generator().manual_seed(3)
    chunks = [[torch.randint(0, CONFIG.vocab_size, (n,), generator=generator) for n in step]
              for step in steps]
    cache = CacheConfig(policy="h2o", budget_tokens=96, evict_slack_tokens=16)
    return StreamScenario(chunks, decode, cache, num_pages=512)


# two sequences, uneven chunks: token slices of the ranks split sequences anywhere; decode
# steps of two tokens leave some ranks without tokens of their own
STEPS = [[37, 20], [64, 33], [50, 64], [17, 5]]


@pytest.mark.parametrize("world", [2, 4])
def test_experts_over_ranks_give_the_logits_of_one_process(world):
    plan = scenario(STEPS)
    base = run_single(BUILD(), plan)
    assert base.evicted_tokens > 0  # the KV shards evict too
    results = run_ranks(world, BUILD, plan, timeout_s=60, expert_parallel=True)
    assert len(results) == world
    for rank, result in enumerate(results):
        assert result.evicted_tokens == base.evicted_tokens, rank
        torch.testing.assert_close(result.logits, base.logits, rtol=1e-4, atol=1e-4)
        assert result.expert_sent_bytes > 0
    whole = BUILD().weight_bytes()
    assert all(r.weight_bytes < whole for r in results)  # each holds a share of the experts


def test_each_rank_keeps_only_its_block_of_experts():
    class Ranks:
        rank, world = 1, 4

    model = BUILD()
    shards = shard_experts(model, Ranks())
    assert len(shards) == 2  # layer 1 is dense
    for layer in (0, 2):
        experts = model.layers[layer].ffn.experts
        kept = [e for e, module in enumerate(experts) if not isinstance(module, AbsentExpert)]
        assert kept == [e for e in range(8) if expert_owner(e, 8, 4) == 1] == [2, 3]
        with pytest.raises(RuntimeError, match="rank 0"):
            experts[0](torch.zeros(1, CONFIG.hidden_size))


def test_serve_expert_parallel_under_torchrun_answers_like_one_process(tmp_path):
    """`serve --kv-parallel 2 --expert-parallel` of a Qwen2-MoE folder: the HTTP answer of
    one process, each rank holding half the experts."""
    pytest.importorskip("transformers")
    from moe_helpers import hf_moe_model, write_hf_moe_folder

    model = str(write_hf_moe_folder(tmp_path / "moe", hf_moe_model("qwen2_moe")))
    spread, port = start_serve(torchrun_launcher(2), model, "--kv-parallel", "2",
                               "--expert-parallel")
    single, single_port = start_serve([sys.executable], model)
    try:
        answer = ask_chat(port, max_tokens=16, model="moe")
        assert answer == ask_chat(single_port, max_tokens=16, model="moe")
    finally:
        spread.send_signal(signal.SIGTERM)
        single.send_signal(signal.SIGTERM)
        output = spread.startup_output + spread.communicate(timeout=60)[0]
        single.wait(timeout=60)
    assert "rank 1 of 2 holds experts 2-3 of 4 in each of 2 layers" in output
    assert "rank 1 exits" in output


def test_expert_parallel_needs_kv_parallel_ranks_and_experts(capsys):
    from streamgrok.cli import main

    assert main(["serve", "--expert-parallel", "--port", "0"]) != 0
    assert "give --kv-parallel N" in capsys.readouterr().err
