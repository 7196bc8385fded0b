"""The benchmark's timing helpers: calls that are compared take turns, and each keeps its own best."""

import time

from llm.generation.bench import _timed, _timed_interleaved


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
    best, _ = _timed(lambda: calls.append(time.sleep(0.01)), repeats=1, min_total_s=0.05)
    assert 6 <= len(calls) <= 8 and best >= 0.01
