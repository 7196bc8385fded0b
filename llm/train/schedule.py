"""Learning-rate schedules beyond Composer's: warmup-stable-decay."""

from __future__ import annotations

from composer.core import State, Time, TimeUnit
from composer.optim import ComposerScheduler


def _time(value: str | Time) -> Time:
    return Time.from_timestring(value) if isinstance(value, str) else value


class WarmupStableDecayScheduler(ComposerScheduler):
    """Warmup-stable-decay (WSD, "trapezoidal"; Hu et al. 2024, MiniCPM; the long linear cool-down
    of modded-nanogpt's speedruns): the multiplier rises linearly from 0 to 1 over ``t_warmup``,
    holds 1, and falls linearly to ``alpha_f`` over the run's last ``t_decay``.

    ``t_warmup`` is any Composer time string (``100ba``, ``0.02dur``); ``t_decay`` is in the
    unit of the run's ``max_duration`` or a fraction of it (``0.3dur``). The multiplier is
    continuous; with ``t_decay`` the whole run it is a linear decay after warmup.

    Raises:
        ValueError: (at the first call) when ``t_decay`` is in another unit than ``max_duration``
            or longer than it, or warmup and decay overlap.
    """

    def __init__(self, t_warmup: str | Time, t_decay: str | Time = "0.3dur", alpha_f: float = 0.0):
        self.t_warmup, self.t_decay, self.alpha_f = _time(t_warmup), _time(t_decay), alpha_f

    def __call__(self, state: State, ssr: float = 1.0) -> float:
        total = state.max_duration
        assert total is not None, "max_duration is set whenever schedulers are called"
        warmup = self._in_units(self.t_warmup, total)
        decay = self._in_units(self.t_decay, total)
        if decay.unit != total.unit or decay.value > total.value:
            raise ValueError(f"scheduler t_decay {self.t_decay} must be at most max_duration {total} and in its "
                             "unit (or a fraction of it, as 0.3dur)")
        if warmup.unit == total.unit and warmup.value > total.value - decay.value:
            raise ValueError(f"scheduler t_warmup {self.t_warmup} overlaps the decay (the last {self.t_decay} of "
                             f"{total})")
        now = state.timestamp.get(warmup.unit).value
        if now < warmup.value:
            return now / warmup.value
        into_decay = state.timestamp.get(total.unit).value - (total.value - decay.value)
        if into_decay <= 0 or decay.value == 0:
            return 1.0
        return 1.0 + (self.alpha_f - 1.0) * min(1.0, into_decay / decay.value)

    @staticmethod
    def _in_units(value: Time, total: Time) -> Time:
        if value.unit == TimeUnit.DURATION:
            return Time(int(round(value.value * total.value)), total.unit)
        return value
