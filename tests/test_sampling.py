"""Sampling: greedy, top-k, top-p, seeds, parameter checks."""

from __future__ import annotations

import pytest
import torch

from streamgrok.model.sampling import SamplingParams, filter_logits, new_generator, sample


def test_greedy_picks_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    assert sample(logits, [SamplingParams()] * 2, [None, None]).tolist() == [1, 0]


def test_top_k_one_is_greedy():
    logits = torch.randn(1, 100)
    params = SamplingParams(temperature=1.5, top_k=1, seed=3)
    token = sample(logits.clone(), [params], [new_generator(params)])
    assert token.item() == logits.argmax().item()


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.7)).isfinite()
    assert kept.tolist() == [True, True, False, False]
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.5)).isfinite()
    assert kept.tolist() == [True, False, False, False]


def test_seed_reproduces_and_varies():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=7)
    runs = [
        [sample(logits.clone(), [params], [gen]).item() for _ in range(20)]
        for gen in (new_generator(params), new_generator(params))
    ]
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 5


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_tokens=0)]
)
def test_bad_parameters_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_repetition_penalty_discourages_produced_tokens():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    params = SamplingParams(repetition_penalty=1.5)
    assert sample(logits.clone(), [params], [None], [[]]).item() == 0
    assert sample(logits.clone(), [params], [None], [[0]]).item() == 1  # 2.0/1.5 < 1.9
    assert sample(logits.clone(), [SamplingParams()], [None], [[0]]).item() == 0  # off
    with pytest.raises(ValueError):
        SamplingParams(repetition_penalty=0)
