"""Idle OpenMP workers of streamgrok's processes spin a bounded while unless the user chose
how they wait; measured processes get OpenMP's own default back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from streamgrok.bench.timing import measurement_env
from streamgrok.openmp_wait import IDLE_SPIN_COUNT, set_idle_spin, without_wait_choices


def test_the_bounded_spin_is_set_only_where_the_user_chose_nothing():
    env: dict[str, str] = {}
    set_idle_spin(env)
    assert env == {"GOMP_SPINCOUNT": IDLE_SPIN_COUNT}
    for chosen in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(chosen)
        set_idle_spin(env)
        assert env == chosen


def test_measured_processes_wait_as_openmp_does_by_default(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", IDLE_SPIN_COUNT)
    env = measurement_env()
    assert "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env
    assert without_wait_choices({"GOMP_SPINCOUNT": "5", "OMP_WAIT_POLICY": "PASSIVE"}) == {
        "GOMP_SPINCOUNT": "5"}


@pytest.mark.parametrize("given,seen", [({}, IDLE_SPIN_COUNT),
                                        ({"OMP_WAIT_POLICY": "ACTIVE"}, None)])
def test_the_command_line_sets_it_before_torch_loads(given, seen):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(given)
    probe = ("import os, sys; import streamgrok.cli.entry as cli; cli.process_defaults(); "
             "print('torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["False", str(seen)]
