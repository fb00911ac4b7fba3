"""Recall's per-layer page scoring as one expression: it equals the step-by-step rule (explicit
rotations, resident log-sum-exp, `score_pages`), compiled equals eager for every size kind, and
a plan refreshed for one layer equals the plan built again."""

from __future__ import annotations

import pytest
import torch

from streamgrok.cache.attention_plan import build_attention_plan, refresh_layer
from streamgrok.cache.tiers.page_scorer import PageScorer, layer_page_scores
from streamgrok.cache.tiers.recall import page_gains, resident_lse, score_pages
from streamgrok.cache.tokens import LayerTokens
from streamgrok_kernels.rotary import apply_rotary

HEADS, KV_HEADS, DIM = 4, 2, 16
SCALE = DIM ** -0.5


def rotary(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    inverse = 1.0 / 10000 ** (torch.arange(0, DIM, 2) / DIM)
    angles = torch.outer(torch.arange(width).float(), inverse)
    return angles.cos(), angles.sin()


def problem(rows: int, resident: int, pages: int, seed: int) -> tuple:
    """Queries at the last `rows` positions of `resident` keys, and `pages` host pages."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, HEADS, DIM, generator=gen) * 2
    positions = torch.arange(resident - rows, resident).clamp(min=0)
    keys = torch.randn(resident, KV_HEADS, DIM, generator=gen) * 2
    centers = torch.randn(pages, KV_HEADS, DIM, generator=gen)
    insert_at = torch.randint(0, resident + 1, (pages,), generator=gen).sort().values
    radii = torch.rand(pages, KV_HEADS, generator=gen) * 3
    plane_vars = torch.rand(pages, KV_HEADS, DIM // 2, generator=gen)
    counts = torch.randint(1, 17, (pages,), generator=gen)
    cos, sin = rotary(resident + 9)
    return q, positions, keys, centers, insert_at, radii, plane_vars, counts, cos, sin, SCALE


def step_by_step(q, positions, keys, centers, insert_at, radii, plane_vars, counts, cos, sin,
                 scale):
    """The rule as recall ran it before it was one expression."""
    def rot(x, at):
        return apply_rotary(x, cos[at], sin[at])
    q_rot = rot(q, positions)
    k_rot = rot(keys, torch.arange(keys.shape[0]))
    lse = resident_lse(q_rot, k_rot, positions, scale)
    return score_pages(q_rot, lse, rot(centers, insert_at), radii, plane_vars, counts, scale)


SIZES = [(5, 40, 9), (1, 40, 9), (5, 1, 9), (5, 40, 1), (1, 1, 1), (19, 300, 60)]


@pytest.mark.parametrize("rows,resident,pages", SIZES)
def test_one_expression_scores_as_the_step_by_step_rule(rows, resident, pages):
    args = problem(rows, resident, pages, seed=rows + resident + pages)
    want_score, want_mass = step_by_step(*args)
    want_gain, want_base = page_gains(want_mass)
    score, gain, base = layer_page_scores(*args)
    torch.testing.assert_close(score, want_score, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gain, want_gain, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(base, want_base, rtol=1e-5, atol=1e-7)


def test_compiled_scoring_equals_eager_for_every_size_kind():
    scorer = PageScorer(compiled=True)
    eager = PageScorer(compiled=False)
    assert scorer.compiled and not eager.compiled
    kinds = set()
    for rows, resident, pages in SIZES:
        args = problem(rows, resident, pages, seed=7)
        want = eager(*args)
        torch.testing.assert_close(scorer(*args), want)  # eager while it compiles
        assert scorer.wait_compiled(timeout=600)
        assert scorer.compiled
        kinds.add((rows == 1, resident == 1, pages == 1))
        got = scorer(*args)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert scorer.compiled_kinds() == len(kinds)
    with torch.compiler.set_stance("fail_on_recompile"):  # the stand-ins' graphs serve all
        for rows, resident, pages in ((3, 70, 4), (11, 129, 33)):
            args = problem(rows, resident, pages, seed=11)
            for g, w in zip(scorer(*args), eager(*args)):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert scorer.compiled


def test_scoring_under_inference_mode_compiles_for_it_in_the_background():
    """Recall's way: inside the model's inference-mode pass, the queries a strided view of a
    wider projection. The background compilation matches that, so the first compiled call
    does not compile again on the caller's thread."""
    scorer = PageScorer(compiled=True)
    q, positions, keys, *rest = problem(6, 90, 12, seed=3)  # the tier's summaries: made before
    with torch.inference_mode():
        wide = torch.cat([q, torch.zeros_like(q)], dim=1)  # q's rows strided, as in a pass
        args = (wide[:, : q.shape[1]], positions.clone(), keys.clone(), *rest)
        want = PageScorer(compiled=False)(*args)
        scorer(*args)
        assert scorer.wait_compiled(timeout=600)
        with torch.compiler.set_stance("fail_on_recompile"):
            got = scorer(*args)
    assert scorer.compiled
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_the_environment_sets_whether_scoring_compiles_by_default(monkeypatch):
    monkeypatch.setenv("STREAMGROK_COMPILED_READS", "0")
    assert not PageScorer().compiled
    monkeypatch.setenv("STREAMGROK_COMPILED_READS", "1")
    assert PageScorer().compiled


def layer_tokens(page_size: int, pages: list[int], length: int) -> LayerTokens:
    rec = LayerTokens(page_size)
    rec.add_pages(pages)
    rec.length = length
    return rec


@pytest.mark.parametrize("layer", [0, 2])
def test_a_plan_refreshed_for_one_layer_equals_the_plan_built_again(layer):
    page, layers = 4, 3
    # sequence 7 decodes one token, 8 and 9 prefill chunks; every layer has its own pages
    spans = [(7, 0, 1), (8, 1, 5), (9, 6, 3)]
    starts = {7: [6, 5, 9], 8: [2, 2, 2], 9: [0, 4, 1]}
    records = {s: [layer_tokens(page, [100 * s + 10 * li + p for p in range(4)],
                                starts[s][li] + n)
                   for li in range(layers)]
               for s, _, n in spans}
    plan = build_attention_plan(spans, records, starts, page, torch.device("cpu"))
    # recall rewrote `layer`: more tokens before the new ones, on other (and more) pages
    for s, grown in ((7, 9), (8, 13), (9, 2)):
        starts[s][layer] += grown
        n = next(n for seq, _, n in spans if seq == s)
        used = -(-(starts[s][layer] + n) // page)
        records[s][layer] = layer_tokens(page, [5000 + 50 * s + p for p in range(used)],
                                         starts[s][layer] + n)
    refresh_layer(plan, layer, records, page)
    want = build_attention_plan(spans, records, starts, page, torch.device("cpu"))
    torch.testing.assert_close(plan.new_slots, want.new_slots)
    assert len(plan.groups) == len(want.groups)
    for got, expected in zip(plan.groups, want.groups):
        assert got.totals == expected.totals and got.widths == expected.widths
        width = expected.tables.shape[2]
        assert got.tables.shape[2] >= width and not got.tables[:, :, width:].any()
        torch.testing.assert_close(got.tables[:, :, :width], expected.tables)
        for name in ("rows", "positions", "lengths", "past", "cu_q"):
            torch.testing.assert_close(getattr(got, name), getattr(expected, name))
