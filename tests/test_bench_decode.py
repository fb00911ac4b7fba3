"""`python -m benchmarks decode` runs end to end on a tiny model: one process per weight format,
every row filled, the accuracy reference first, a plot written."""

from __future__ import annotations

import pytest
from helpers import random_model, tiny_config, write_gguf

from benchmarks.decode import run_decode_bench


def test_decode_bench_measures_each_format_against_float32(tmp_path, capsys):
    config = tiny_config(max_positions=256, hidden_size=128, intermediate_size=256,
                         head_dim=32)
    model = write_gguf(tmp_path / "tiny.gguf", random_model(config))
    columns = run_decode_bench(str(model), ["q8", "q4", "q4:int8"], threads=1,
                               prompt_tokens=32, batches=[1, 2], context=32, batch1_context=8,
                               steps=2, repeats=1, out=str(tmp_path / "out"))
    assert [c["weights"] for c in columns] == ["f32", "q8", "q4", "q4:int8"]
    assert [c["kv_dtype"] for c in columns][::3] == ["float32", "int8"]
    for column in columns:
        for key in ("prefill_tok_s", "decode_b1_tok_s", "decode_b2_tok_s", "peak_rss_mb"):
            assert column[key] > 0, (column["weights"], key)
    assert columns[0]["top1_agreement"] == 1.0 and columns[0]["kl_nats"] == 0.0
    assert 0 <= columns[2]["top1_agreement"] <= 1 and columns[2]["kl_nats"] >= 0
    # agreement is over every position of the text, not only its last token's logits
    tokens = columns[2]["agreement_tokens"]
    assert tokens > 16 and all(c["agreement_tokens"] == tokens for c in columns)
    agreed = columns[2]["top1_agreement"] * tokens
    assert abs(agreed - round(agreed)) < 1e-6
    assert columns[1]["weight_mb"] < columns[0]["weight_mb"]
    assert columns[0]["greedy_same"] == 1.0 and columns[0]["greedy_prefix"] == 1.0
    assert all(0 <= c["greedy_same"] <= c["greedy_prefix"] <= 1 for c in columns)
    printed = capsys.readouterr().out
    assert "decode 2 seq @32 tok/s" in printed and "q8/f32" in printed
    assert "answers = f32" in printed and "q4:int8/f32" in printed
    assert (tmp_path / "out" / "decode.png").stat().st_size > 1000


def test_a_format_the_bench_does_not_know_is_a_clear_error(tmp_path):
    for bad in ("q5", "q4:int4"):
        with pytest.raises(ValueError, match=f"unknown format '{bad}'"):
            run_decode_bench(str(tmp_path / "none.gguf"), [bad], threads=1)


def test_rounds_merge_into_one_column_per_system():
    from benchmarks.decode import _merged

    rounds = [{"weights": "q4", "prefill_tok_s": 10.0, "peak_rss_mb": 500.0, "kl_nats": 0.05},
              {"weights": "q4", "prefill_tok_s": 30.0, "peak_rss_mb": 700.0, "kl_nats": None},
              {"weights": "q4", "prefill_tok_s": 20.0, "peak_rss_mb": 600.0}]
    assert _merged(rounds) == {"weights": "q4", "prefill_tok_s": 20.0, "peak_rss_mb": 700.0,
                               "kl_nats": 0.05}


def test_answers_agree_by_whole_answers_and_by_the_prefix_before_a_difference():
    from benchmarks.decode_worker import answer_agreement

    reference = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10]]
    assert answer_agreement(reference, reference) == {"greedy_same": 1.0, "greedy_prefix": 1.0}
    mine = [[1, 2, 3, 4], [5, 9], [7, 8, 9]]  # the last stops early: a difference too
    got = answer_agreement(mine, reference)
    assert got["greedy_same"] == 1 / 3
    assert abs(got["greedy_prefix"] - (1.0 + 0.5 + 0.75) / 3) < 1e-9
