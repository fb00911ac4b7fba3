"""PiKV's expert-sharded KV layout (approximate attention): exact where every query selects
every rank, a share of the keys otherwise, and its fidelity against the full cache."""

from __future__ import annotations

import pytest
import torch
from helpers import random_model, tiny_config

from streamgrok.cache.pikv import ExpertShardedKV
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.config import MoEConfig
from streamgrok.model.contiguous_cache import ContiguousKVCache


def moe_model(experts_per_token: int, dense_layers: tuple[int, ...] = ()):
    moe = MoEConfig(num_experts=8, experts_per_token=experts_per_token,
                    expert_intermediate_size=32, normalize_weights=True,
                    dense_layers=dense_layers)
    return random_model(tiny_config(architecture="mixtral", num_layers=3, moe=moe), seed=2)


def stream_logits(model, backend, ids: list[int], chunk: int) -> torch.Tensor:
    """Every position's logits, the stream fed in chunks."""
    out = []
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        batch = BatchMetadata.build([0], [len(part)])
        batch.logit_rows = None
        out.append(model(torch.tensor(part), batch, backend))
    return torch.cat(out)


IDS = torch.randint(0, 250, (160,), generator=torch.Generator().manual_seed(0)).tolist()


def test_one_rank_is_the_full_cache():
    model = moe_model(2)
    full = stream_logits(model, ContiguousKVCache(model.config, 1, 256), IDS, 32)
    layout = ExpertShardedKV(model, world=1)
    torch.testing.assert_close(stream_logits(model, layout, IDS, 32), full,
                               atol=1e-4, rtol=1e-4)
    assert layout.stats.visible_fraction == 1.0
    layout.close()


def test_queries_selecting_every_rank_see_every_key():
    model = moe_model(8)  # top-8 of 8 experts: every query selects both ranks
    full = stream_logits(model, ContiguousKVCache(model.config, 1, 256), IDS, 32)
    layout = ExpertShardedKV(model, world=2)
    torch.testing.assert_close(stream_logits(model, layout, IDS, 32), full,
                               atol=1e-4, rtol=1e-4)
    layout.close()


def test_a_sharded_layout_sees_part_of_the_keys_and_changes_the_logits():
    model = moe_model(1, dense_layers=(1,))
    full = stream_logits(model, ContiguousKVCache(model.config, 1, 256), IDS, 32)
    layout = ExpertShardedKV(model, world=4)
    sharded = stream_logits(model, layout, IDS, 32)
    assert 0.0 < layout.stats.visible_fraction < 1.0
    assert not torch.allclose(sharded, full, atol=1e-3)
    layout.close()
    # the hooks are gone: the model runs on the full cache as before
    again = stream_logits(model, ContiguousKVCache(model.config, 1, 256), IDS, 32)
    torch.testing.assert_close(again, full)


def test_a_dense_model_or_too_many_ranks_is_refused():
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ExpertShardedKV(random_model(tiny_config()), world=2)
    with pytest.raises(ValueError, match="9 ranks for 8 experts"):
        ExpertShardedKV(moe_model(2), world=9)
