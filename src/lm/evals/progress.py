"""Progress of a benchmark pass: items done, items per second and the time left, said every few seconds, so
`lm eval` and a milestone's scoring are never minutes of silence."""

from __future__ import annotations

import time
from collections.abc import Callable


class Progress:
    """Counts scored items and says `scoring: 1,200/9,848 items (12%), 35.1 items/s, ETA 4m06s` through
    `say` at most every `every_s` seconds (0: never), and once at the end."""

    def __init__(self, every_s: float, say: Callable[[str], None] = print, what: str = "scoring") -> None:
        self.every_s, self.say, self.what = every_s, say, what
        self.total = self.done = 0
        self.started = self.last = 0.0

    def start(self, total: int) -> None:
        self.total, self.done = total, 0
        self.started = self.last = time.monotonic()

    def advance(self, items: float) -> None:
        """`items` more scored (a fraction where a batch ends inside an item)."""
        self.done += items
        now = time.monotonic()
        if self.every_s and now - self.last >= self.every_s:
            self.last = now
            self.say(self.line(now))

    def finish(self) -> None:
        self.done = self.total
        if self.every_s and self.total:
            self.say(self.line(time.monotonic()))

    def line(self, now: float) -> str:
        seconds = max(now - self.started, 1e-9)
        rate = self.done / seconds
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        share = self.done / self.total if self.total else 1.0
        eta = "done" if self.done >= self.total else f"ETA {clock(left)}"
        return (
            f"{self.what}: {round(self.done):,}/{self.total:,} items ({share:.0%}), {rate:.1f} items/s, {eta} "
            f"({clock(seconds)} so far)"
        )


def clock(seconds: float) -> str:
    """`4m06s`, `1h02m`, `12s`; `?` for a time not known yet."""
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
