"""A one-line progress display (round, metrics, ETA) that stays quiet off a terminal."""
from __future__ import annotations

import sys
import time
from typing import IO
from collections.abc import Mapping


def format_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """``update(round, metrics)`` after each round; ``close()`` at the end.

    Enabled only when ``stream`` is a terminal (or ``enabled=True``), so logs and
    CI output carry no carriage-return noise.
    """

    KEYS = ("train_loss", "global_test_acc", "client_test_acc_mean_unweighted")
    SHORT = {"train_loss": "loss", "global_test_acc": "test acc", "client_test_acc_mean_unweighted": "client acc"}

    def __init__(self, total_rounds: int, start_round: int = 0, *, stream: IO | None = None, enabled: bool | None = None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total = total_rounds
        self.start = start_round
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.last: dict[str, float] = {}

    def update(self, round_done: int, metrics: Mapping[str, float]) -> None:
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now  # the first round includes compilation: time the rest
        for k in self.KEYS:
            if k in metrics:
                self.last[k] = float(metrics[k])
        if not self.enabled:
            return
        done_since_first = round_done - self.start - 1
        eta = ""
        if done_since_first > 0:
            per = (now - self.t_first) / done_since_first
            eta = f" | {per:.2f} s/round | ETA {format_seconds(per * (self.total - round_done))}"
        vals = " | ".join(f"{self.SHORT[k]} {v:.4f}" for k, v in self.last.items())
        self.stream.write(f"\rround {round_done}/{self.total} | {vals}{eta}\033[K")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
