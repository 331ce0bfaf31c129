"""A periodic progress line with an ETA for long evaluations (no tqdm: it goes to the log)."""

from __future__ import annotations

import logging
import time


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    """Counts work units and logs `label: done/total (pct) | elapsed | ETA` at most every
    `interval` seconds, and once when the total is reached."""

    def __init__(self, label: str, total: int, log: logging.Logger, interval: float = 10.0):
        self.label, self.total, self.log, self.interval = label, total, log, interval
        self.done = 0
        self.start = self.last_log = time.perf_counter()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        eta_text = format_seconds(eta) if self.done else "?"
        pct = 100.0 * self.done / max(1, self.total)
        return (
            f"{self.label}: {self.done}/{self.total} ({pct:.0f}%) | "
            f"elapsed {format_seconds(elapsed)} | ETA {eta_text}"
        )

    def update(self, count: int = 1) -> None:
        self.done += count
        now = time.perf_counter()
        if self.done >= self.total or now - self.last_log >= self.interval:
            self.last_log = now
            self.log.info(self.line())
