"""How idle OpenMP worker threads (torch's intra-op pool) wait for work in streamgrok's own
processes, chosen before torch loads.

libgomp's default lets an idle worker spin ~7 ms here before it sleeps (300,000 spins), which
takes cores from media workers and other processes; `OMP_WAIT_POLICY=PASSIVE` (the earlier
choice) puts it to sleep at once, so every parallel op of a step pays a wake-up: on these 2
cores a recall question pass took 217 ms with it and 145 ms with the default. A bounded spin
of 30,000 (~1.2 ms of one core per idle gap) kept workers awake between a step's ops: the
same pass took 150 ms, and under 16 live clients (`bench live`) the engine's step p50 was
38 ms against 97 ms with PASSIVE.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

IDLE_SPIN_COUNT = "30000"
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def set_idle_spin(environ: MutableMapping[str, str] = os.environ) -> None:
    """Bound how long idle OpenMP workers spin (GOMP_SPINCOUNT), unless the user chose how
    they wait (OMP_WAIT_POLICY or GOMP_SPINCOUNT is set). Takes effect in a process that
    loads torch after it, and in the processes it starts."""
    if not any(name in environ for name in WAIT_VARIABLES):
        environ["GOMP_SPINCOUNT"] = IDLE_SPIN_COUNT


def without_wait_choices(environ: MutableMapping[str, str]) -> dict[str, str]:
    """`environ` with OpenMP's default wait restored: the wait variables removed (a user's own
    choice kept only if it is not streamgrok's default spin)."""
    env = dict(environ)
    env.pop("OMP_WAIT_POLICY", None)
    if env.get("GOMP_SPINCOUNT") == IDLE_SPIN_COUNT:
        del env["GOMP_SPINCOUNT"]
    return env
