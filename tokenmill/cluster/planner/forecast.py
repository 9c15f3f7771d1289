"""Forecasting the arrival rate a little ahead: Holt's linear exponential smoothing (a level and a
trend), enough to see a ramp coming one worker start-up ahead without chasing every burst."""

from __future__ import annotations


class HoltForecaster:
    def __init__(self, alpha: float = 0.5, beta: float = 0.3) -> None:
        if not (0 < alpha <= 1 and 0 <= beta <= 1):
            raise ValueError("need 0 < alpha <= 1 and 0 <= beta <= 1")
        self.alpha, self.beta = alpha, beta
        self.level: float | None = None
        self.trend = 0.0
        self._seen = 0

    def observe(self, value: float) -> None:
        if self.level is None:
            self.level = value
            self._seen = 1
            return
        if self._seen == 1:  # the usual start: the first difference is the first trend
            self.trend = value - self.level
            self.level = value
            self._seen = 2
            return
        previous = self.level
        self.level = self.alpha * value + (1 - self.alpha) * (self.level + self.trend)
        self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.trend

    def forecast(self, steps: float = 1.0) -> float:
        """The value `steps` observation intervals ahead (never below zero)."""
        if self.level is None:
            return 0.0
        return max(self.level + steps * self.trend, 0.0)
