"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay.

A pure function of the step, so a resumed run gets exactly the rates of an uninterrupted one
without any scheduler state to save.
"""

from __future__ import annotations

import math

from roundpipe.train.config import ScheduleConfig


def lr_at(step: int, total_steps: int, peak_lr: float, schedule: ScheduleConfig) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``total_steps``.

    Warm-up rises linearly over ``warmup_steps`` (step 0 gets ``peak / warmup_steps``, so no step
    is wasted at rate zero); after it, ``linear`` and ``cosine`` fall from the peak to
    ``min_lr_ratio x peak`` at the last step, ``constant`` stays at the peak.
    """
    warmup = schedule.warmup_steps
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    if schedule.kind == "constant":
        return peak_lr
    span = max(1, total_steps - warmup - 1)
    progress = min(1.0, (step - warmup) / span)
    floor = schedule.min_lr_ratio * peak_lr
    if schedule.kind == "linear":
        return floor + (peak_lr - floor) * (1.0 - progress)
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
