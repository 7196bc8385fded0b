"""The warmup-stable-decay schedule: its multiplier at every batch of a run, and its keys."""

from types import SimpleNamespace

import pytest
from composer.core import Time, Timestamp

from llm.train.config import SchedulerConfig
from llm.train.schedule import WarmupStableDecayScheduler
from llm.utils.config import ConfigError, to_dict


def multipliers(scheduler, batches: int) -> list[float]:
    out = []
    for batch in range(batches + 1):
        state = SimpleNamespace(max_duration=Time.from_timestring(f"{batches}ba"), timestamp=Timestamp(batch=batch))
        out.append(scheduler(state))
    return out


def test_warmup_then_flat_then_a_linear_cool_down_to_alpha_f():
    got = multipliers(WarmupStableDecayScheduler("4ba", "0.5dur", alpha_f=0.1), 20)
    assert got[:5] == pytest.approx([0, 0.25, 0.5, 0.75, 1])
    assert got[4:11] == [1.0] * 7
    assert got[10:] == pytest.approx([1 - 0.9 * k / 10 for k in range(11)])
    # a decay given in batches is the same schedule
    assert multipliers(WarmupStableDecayScheduler("0.2dur", "10ba", alpha_f=0.1), 20) == pytest.approx(got)


def test_decay_in_another_unit_than_the_run_or_overlapping_warmup_is_refused():
    with pytest.raises(ValueError, match="t_decay"):
        multipliers(WarmupStableDecayScheduler("1ba", "1ep"), 10)
    with pytest.raises(ValueError, match="overlaps"):
        multipliers(WarmupStableDecayScheduler("8ba", "5ba"), 10)


def test_the_yaml_keys():
    config = SchedulerConfig(name="warmup_stable_decay", t_warmup="0.05dur")
    assert (config.t_decay, config.alpha_f, config.t_max) == ("0.3dur", 0.0, None)
    assert "t_max" not in to_dict(config)  # the keys passed to the scheduler are its own
    with pytest.raises(ConfigError, match="t_decay"):
        SchedulerConfig(name="cosine_with_warmup", t_warmup="10ba", t_decay="0.3dur")
    with pytest.raises(ConfigError, match="t_max"):
        SchedulerConfig(name="warmup_stable_decay", t_warmup="10ba", t_max="1dur")
    with pytest.raises(ConfigError, match="overlap"):
        SchedulerConfig(name="warmup_stable_decay", t_warmup="0.8dur", t_decay="0.3dur")
