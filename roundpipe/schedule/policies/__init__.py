"""Dispatch policies: pure functions ``(forward, backward, devices, microbatches, **options) -> ScheduleTable``.

Every policy returns a validated table whose ``options`` include ``weight_bound`` (True when devices
keep their stages' weights resident: every policy but ``roundpipe``) and raises ScheduleError,
saying what to change, for arguments it cannot schedule.
"""

from roundpipe.schedule.policies.chimera import chimera
from roundpipe.schedule.policies.gpipe import gpipe
from roundpipe.schedule.policies.hanayo import hanayo
from roundpipe.schedule.policies.interleaved import interleaved
from roundpipe.schedule.policies.one_f_one_b import one_f_one_b
from roundpipe.schedule.policies.roundpipe import roundpipe
from roundpipe.schedule.policies.zb import zb

POLICIES = {
    "roundpipe": roundpipe,
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "chimera": chimera,
    "hanayo": hanayo,
    "zb": zb,
}

__all__ = ["POLICIES", "chimera", "gpipe", "hanayo", "interleaved", "one_f_one_b", "roundpipe", "zb"]
