"""The benchmark's timing helpers: calls that are compared take turns, and each keeps its own best."""

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks.generate import _timed_interleaved, linear_table
from tests.conftest import tiny_model


def test_interleaved_calls_take_turns_and_keep_their_own_best_and_result():
    order = []

    def call(name, seconds):
        def run():
            order.append(name)
            time.sleep(seconds)
            return f"{name}{len(order)}"
        return run

    (best_a, last_a), (best_b, last_b) = _timed_interleaved([call("a", 0.0), call("b", 0.01)], repeats=3,
                                                             min_total_s=0.0)
    assert order == ["a", "b"] * 4  # a warm-up round, then three timed rounds, a and b alternating
    assert (last_a, last_b) == ("a7", "b8")
    assert best_a < 0.005 <= 0.01 <= best_b


def test_short_calls_repeat_until_the_minimum_time_is_measured():
    calls = []
    [(best, _)] = _timed_interleaved([lambda: calls.append(time.sleep(0.01))], repeats=1, min_total_s=0.05)
    assert 6 <= len(calls) <= 8 and best >= 0.01


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_linear_table_times_every_projection_at_each_row_count(threads):
    model = tiny_model("llama", d_model=384, n_heads=6, kv_n_heads=2, tie_word_embeddings=True)
    table = linear_table(model, rows=(1, 3), repeats=1)
    assert [row["rows"] for row in table] == [1, 3]
    assert all(row["f_linear_ms"] > 0 and row["split_ms"] > 0 for row in table)
    assert all(abs(row["speedup"] - row["f_linear_ms"] / row["split_ms"]) < 1e-9 for row in table)


def test_bits_per_byte_of_the_fast_table_is_the_evaluators_cross_entropy_per_byte():
    import math

    import torch

    from llm.data import build_char_tokenizer, load_corpus
    from benchmarks.generate_fast import bits_per_byte, eval_blocks, ours_nll

    tokenizer = build_char_tokenizer(load_corpus("validation"))
    blocks, n_bytes = eval_blocks(tokenizer, blocks=3, length=40)
    assert [len(b) for b in blocks] == [40] * 3
    # characters of the plays: one byte each but for the few non-ASCII ones
    assert 3 * 39 <= n_bytes <= 3 * 39 * 2
    model = tiny_model("llama", vocab_size=len(tokenizer))
    nll = ours_nll(model, blocks)
    logits = model(torch.tensor(blocks)).logits[:, :-1]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.tensor(blocks)[:, 1:].reshape(-1), reduction="sum")
    assert math.isclose(nll, float(expected), rel_tol=1e-5)
    assert math.isclose(bits_per_byte(nll, n_bytes), nll / math.log(2) / n_bytes)


def test_the_fast_table_without_llama_cpp_says_how_to_get_it():
    from benchmarks.generate import main

    with pytest.raises(SystemExit, match="make bench-peers"):
        main(["--fast"])


def test_token_clock_skips_the_prompt_and_times_from_the_first_new_token_to_the_last(monkeypatch):
    from benchmarks.generate import TokenClock

    now = iter([10.0, 10.5, 11.0, 12.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(now))
    clock = TokenClock(batch=2)
    clock.put(torch.zeros(2, 7))  # the prompt: not a step
    for _ in range(3):
        clock.put(torch.zeros(2))  # transformers' shape: (batch,) a step
    clock.tick(np.zeros((2, 2)))  # two tokens a row at once
    clock.end()
    assert clock.times == [10.0, 10.5, 11.0, 12.0] and clock.tokens == [1, 1, 1, 2]
    assert clock.decode_tokens_per_s() == 2 * (1 + 1 + 2) / 2.0
    one = TokenClock()
    one.put(torch.zeros(1, 3))
    assert math.isnan(one.decode_tokens_per_s())


@pytest.mark.parametrize("hf", [False, True])
def test_token_clock_sees_every_new_token_of_our_generate_and_of_transformers(hf):
    from benchmarks.generate import TokenClock, hf_llama
    from benchmarks.generate_fast import _generate

    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (3, 5))
    clock = TokenClock(batch=3)
    out = _generate(hf, hf_llama(model) if hf else model, ids, 6, False, SimpleNamespace(pad_token_id=0), clock)
    assert out.shape == (3, 11)
    assert clock.tokens == [1] * 6 and clock.decode_tokens_per_s() > 0


def test_decode_rounds_take_turns_after_a_warm_up_rotating_who_goes_first_and_keep_every_rate():
    from benchmarks.generate import decode_rounds, versus

    order, rates = [], iter([9.0, 9.0, 9.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.5])

    def call(name):
        def run():
            order.append(name)
            return f"{name}{len(order)}", next(rates)
        return run

    (a, last_a), (b, last_b), (c, last_c) = decode_rounds([call("a"), call("b"), call("c")], rounds=3)
    # the warm-up, then rounds starting at a, b and c in turn: no call always follows the same one
    assert order == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert (last_a, last_b, last_c) == ("a11", "b12", "c10")
    assert a == [1.0, 6.0, 8.0] and b == [2.0, 4.0, 9.5] and c == [3.0, 5.0, 7.0]
    # each round's rate against the same round's rate of the reference
    assert versus(a, c) == (8.0 / 7.0, 1.0 / 3.0, 6.0 / 5.0)  # ratios 1/3, 6/5, 8/7
    with pytest.raises(ValueError):
        versus(a, c[:2])  # rounds that do not pair up


@pytest.mark.parametrize("rate", [float("nan"), 0.0, float("inf")])
def test_decode_rounds_refuse_a_call_that_timed_no_decoding(rate):
    from benchmarks.generate import decode_rounds

    with pytest.raises(ValueError, match=r"call 1 of round 0 gave no decode rate .*fewer than two steps"):
        decode_rounds([lambda: (None, 5.0), lambda: (None, rate)], rounds=2)


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--new-tokens", "1"]])
def test_the_fast_table_refuses_settings_that_time_no_decoding(argv, capsys):
    from benchmarks.generate import main

    with pytest.raises(SystemExit):
        main(["--fast", *argv])
    assert "--fast needs --repeats >= 1 and --new-tokens >= 2" in capsys.readouterr().err


def test_the_cache_stamp_benchmark_compares_the_same_tokens_with_and_without_the_check(tmp_path, capsys):
    import json

    from benchmarks import cache_stamp
    from llm.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer("bpe:300", ["the quick brown fox jumps over the lazy dog " * 20])
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "m", tokenizer=tokenizer)
    assert cache_stamp.main(["--model", str(tmp_path / "m"), "--rounds", "2", "--new-tokens", "6"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rounds"] == 2 and result["ratio_low"] <= result["ratio_median"] <= result["ratio_high"]
    assert result["tokens_per_s_with_check"] > 0 and result["tokens_per_s_without"] > 0
