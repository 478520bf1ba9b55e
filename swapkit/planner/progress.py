"""Progress of the measurement runs, for a planner that would otherwise be silent for minutes.

Note [An emulated link makes planning slow]
``runtime.engine_options.latency_s`` emulates the target machine's link on the thread engine: every
copy sleeps it. The planner measures that link (:func:`swapkit.planner.link.measure_link`: a few
copies per size and direction) and runs a swap probe (every layer swapped with distance 1,
``swapkit.planner.measure`` Note [Release lag]) whose backward waits for each prefetch in turn, so
with a latency of 0.2 s a 2-layer model took a minute to plan, in silence. The sleeps are the
measurement (how late copies finish under that link is what the release lag and the copy overhead
need), so they stay; instead the planner says up front, once (once for a pipeline config too, whose
stages each measure the link), that the emulated latency makes it slow and how long the link
measurement alone sleeps, and logs each measurement round as it ends
with an estimate of what is left. Without an emulated latency the rounds take a few seconds in all
and are logged at DEBUG (``-v``). Progress goes to the ``swapkit.planner.progress`` logger, which
the CLI shows at INFO even where it hides the measurement runs' own lines.
"""
from __future__ import annotations

import logging

from swapkit.config.types import RuntimeConfig
from swapkit.planner.link import copies_per_measurement

logger = logging.getLogger(__name__)


def emulated_latency(runtime: RuntimeConfig, device_type: str) -> float:
    """The latency the thread engine will sleep on every copy (0 for the CUDA engine, which ignores it)."""
    thread = runtime.engine == "thread" or (runtime.engine == "auto" and device_type != "cuda")
    return runtime.engine_options.latency_s if thread else 0.0


def link_seconds(latency: float) -> float:
    """How long one link measurement sleeps under an emulated ``latency`` (0: not slow)."""
    return copies_per_measurement() * latency


def announce(latency: float, stages: int = 1) -> None:
    """The up-front line when an emulated latency makes the measurement slow (Note [An emulated link
    makes planning slow]), said once for the user's config: a pipeline's ``stages`` each measure the link."""
    if latency <= 0:
        return
    copies = copies_per_measurement()
    count = f"{copies} copies" if stages == 1 else f"{copies} copies on each of {stages} stages"
    logger.info("runtime.engine_options.latency_s: %g emulates a slow link: every copy of the planner's swap "
                "probe and of its link measurement sleeps it (the link measurement alone: %s, %.1f s); "
                "progress follows per measurement round", latency, count, stages * link_seconds(latency))


class Progress:
    """Logs each measurement round as it ends, with an estimate of the time left.

    Args:
        rounds: how many rounds the measurement runs (each: one traced and one untraced step per mode).
        slow: log at INFO (an emulated latency), else at DEBUG.
        after: seconds of measuring still to come after the rounds (the link measurement's sleeps).
    """

    def __init__(self, rounds: int, slow: bool, after: float = 0.0) -> None:
        self.rounds, self.done, self.longest, self.after = rounds, 0, 0.0, after
        self.level = logging.INFO if slow else logging.DEBUG

    def round_done(self, modes: list[str], seconds: float) -> None:
        """One round of ``modes`` took ``seconds``; the rounds left are estimated at the longest so far
        (the swap probe's, in nearly every round)."""
        self.done, self.longest = self.done + 1, max(self.longest, seconds)
        left = max(self.rounds - self.done, 0) * self.longest + self.after
        estimate = f"; about {left:.0f} s left" if left >= 1 else ""
        logger.log(self.level, "measured round %d of %d (%s) in %.1f s%s", self.done, self.rounds,
                   ", ".join(modes), seconds, estimate)
