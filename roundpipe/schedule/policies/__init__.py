"""Dispatch policies: pure functions ``(forward, backward, devices, microbatches, **options) -> ScheduleTable``.

Every policy returns a validated table whose ``options`` include ``weight_bound`` (True when devices
keep their stages' weights resident: every policy but ``roundpipe``) and raises ScheduleError,
saying what to change, for arguments it cannot schedule.

``POLICIES`` maps a name to its :class:`PolicySpec`: the builder and the facts about the policy that
the planner, the simulator, the scenario, the tuner, the closed forms and the run config need (how
many stages it takes, whether its forward and backward partitions may differ, which microbatch
counts it accepts, whether it rotates the start device between steps, whether the runtime can run
it, its closed-form step time). Code outside this package asks the spec; it never compares a
policy's name (``tests/test_policy_facts.py`` checks). ``PROVISIONAL_POLICY`` is the one policy
whose spec is ``provisional``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from roundpipe.schedule.policies.chimera import chimera
from roundpipe.schedule.policies.closed_forms import (
    ClosedFormFn,
    chimera_form,
    gpipe_form,
    hanayo_form,
    interleaved_form,
    one_f_one_b_form,
    roundpipe_form,
    zb_form,
)
from roundpipe.schedule.policies.gpipe import gpipe
from roundpipe.schedule.policies.hanayo import hanayo
from roundpipe.schedule.policies.interleaved import interleaved
from roundpipe.schedule.policies.one_f_one_b import one_f_one_b
from roundpipe.schedule.policies.roundpipe import next_start_device, roundpipe
from roundpipe.schedule.policies.zb import zb


@dataclass(frozen=True)
class PolicySpec:
    """One registered policy: its table builder and its facts.

    - ``weight_bound``: devices keep their stages' weights resident (False: weights stream per deal).
    - ``separate_partitions``: forward and backward may be cut differently (one partition otherwise).
    - ``rotates``: takes a ``start_device`` option that the runtime advances after every step;
      ``next_start_device(table)`` is the one the step after ``table`` starts on (the deal goes on
      where the table's ended).
    - ``stages_per_device``: the stage counts it accepts are multiples of ``stages_per_device *
      devices`` (``exact_stages``: only that one count); ``None``: any count from 1 to the layers.
    - ``default_grain``: stages per device when no count is given.
    - ``grain_option``: the option that sets the stages per device (``stages_per_device`` times its
      value), or ``None``.
    - ``grains``: stages per device the tuner tries (``()`` with ``stages_per_device=None``: the
      partitioner chooses the counts).
    - ``microbatch_multiple``: ``"devices"`` when the microbatch count must be a multiple of the
      device count, else an int it must be a multiple of.
    - ``even_devices``: the device count must be even.
    - ``forwards_first``: every forward of a step runs before its first backward, in table order
      (``check.runs_forwards_first``): what a loss over the whole batch's forward needs, such as a
      MoE router's load-balancing loss.
    - ``cannot_run``: why the runtime cannot execute its tables yet (``""``: it can; the simulator
      models every policy). ``RunConfig`` refuses a policy with a reason.
    - ``provisional``: what ``policy="auto"`` runs before anything is measured, and the default of
      the simulator's commands (exactly one policy; ``PROVISIONAL_POLICY``).
    - ``closed_form``: ``(devices, stages, microbatches, f, b) -> (step time, peak activations)`` on
      uniform stages (``roundpipe.schedule.formulas``; ``None``: no closed form).
    """

    name: str
    build: Callable
    weight_bound: bool = True
    separate_partitions: bool = False
    rotates: bool = False
    stages_per_device: int | None = 1
    exact_stages: bool = True
    default_grain: int = 1
    grain_option: str | None = None
    grains: tuple[int, ...] = (1,)
    microbatch_multiple: int | str = 1
    even_devices: bool = False
    forwards_first: bool = False
    next_start_device: Callable | None = None
    cannot_run: str = ""
    provisional: bool = False
    closed_form: ClosedFormFn | None = None

    @property
    def executable(self) -> bool:
        """The runtime executes this policy's tables (see ``cannot_run``)."""
        return not self.cannot_run

    def __call__(self, *args, **kwargs):
        return self.build(*args, **kwargs)

    def default_stages(self, num_devices: int) -> int | None:
        """The stage count used when none is given (``None``: the partitioner picks)."""
        return None if self.stages_per_device is None else self.default_grain * num_devices

    def stage_options(self, num_devices: int) -> list[int | None]:
        """Stage counts worth trying: ``[None]`` when the partitioner picks freely."""
        if self.stages_per_device is None:
            return [None]
        return [g * num_devices for g in self.grains]

    def accepts_stages(self, num_stages: int, num_devices: int) -> bool:
        if self.stages_per_device is None:
            return num_stages >= 1
        unit = self.stages_per_device * num_devices
        return num_stages == unit if self.exact_stages else num_stages % unit == 0 and num_stages > 0

    def microbatch_step(self, num_devices: int) -> int:
        """The microbatch count must be a multiple of this."""
        return num_devices if self.microbatch_multiple == "devices" else int(self.microbatch_multiple)

    def accepts_microbatches(self, num_microbatches: int, num_devices: int) -> bool:
        return num_microbatches >= 1 and num_microbatches % self.microbatch_step(num_devices) == 0


POLICIES: dict[str, PolicySpec] = {
    spec.name: spec
    for spec in (
        PolicySpec(
            "roundpipe", roundpipe, weight_bound=False, separate_partitions=True, rotates=True,
            stages_per_device=None, exact_stages=False, grains=(), next_start_device=next_start_device,
            provisional=True, closed_form=roundpipe_form,
        ),
        PolicySpec("gpipe", gpipe, forwards_first=True, closed_form=gpipe_form),
        PolicySpec("1f1b", one_f_one_b, closed_form=one_f_one_b_form),
        PolicySpec(
            "interleaved", interleaved, stages_per_device=1, exact_stages=False, default_grain=2,
            grains=(2, 4), microbatch_multiple="devices", grain_option="virtual_stages",
            closed_form=interleaved_form,
        ),
        PolicySpec("chimera", chimera, microbatch_multiple=2, even_devices=True, closed_form=chimera_form),
        PolicySpec(
            "hanayo", hanayo, stages_per_device=2, exact_stages=False, default_grain=2, grains=(2, 4),
            grain_option="waves", closed_form=hanayo_form,
        ),
        PolicySpec(
            "zb", zb, closed_form=zb_form,
            cannot_run="it splits the backward into I/W tasks, which the runtime does not execute yet",
        ),
    )
}  # fmt: skip

PROVISIONAL_POLICY: str = next(name for name, spec in POLICIES.items() if spec.provisional)
"""What ``policy="auto"`` runs before anything is measured (it runs any stage count), and the
default policy of the simulator, the tuner and the scenario."""

__all__ = [
    "POLICIES",
    "PROVISIONAL_POLICY",
    "PolicySpec",
    "chimera",
    "gpipe",
    "hanayo",
    "interleaved",
    "one_f_one_b",
    "roundpipe",
    "zb",
]
