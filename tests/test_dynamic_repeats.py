"""Identical no-grad calls of the model (evaluation loops, token sampling) are replayed from their
trace, not run again (vest_slurm/dynamic/repeats.py): the same events as running them, and no
replay where a call writes state, keeps a tensor, or reads state that changes between calls."""

from __future__ import annotations

import os

import pytest

from vest_slurm.dynamic.launch import parse_train_command
from vest_slurm.dynamic.runner import estimate_command
from vest_slurm.estimate.profiles import get_profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "data", "scripts")
A100 = get_profile("a100-40gb")


def estimate_script(*args):
    return estimate_command(parse_train_command(["python", "sample_eval_train.py", *args]), [A100], cwd=SCRIPTS)


def renumbered(events) -> list:
    """The events with each block named by the order of its allocation (a replay takes new ids)."""
    ids: dict = {}
    out = []
    for e in events:
        if e.action == "alloc":
            ids[e.block] = len(ids)
        out.append((e.action, ids[e.block], e.size_bytes, e.phase, e.category, e.module, e.detail))
    return out


@pytest.mark.parametrize("amp", [[], ["--amp"]], ids=["fp32", "autocast-per-call"])
def test_repeated_eval_and_sampling_calls_replay_the_events_running_them_makes(monkeypatch, amp):
    """6 evaluation calls of one shape before each step; 24 sampled tokens after each, the context
    cropped to 16 (a (1, 16) view whose row stride grows each call). Replayed: the eval calls from
    the third on, and the sampling calls at full context from their third on; each run's trace
    equals, event for event, that of the run in which every call runs. With --amp each call has
    its own autocast region (nanoGPT's ``with ctx:``): the weights' bf16 casts outlive the call
    in autocast's cache until the region exits; a replay puts its casts there."""
    (est,), run = estimate_script(*amp)
    monkeypatch.setenv("VEST_REPEATS", "run")
    (est_all,), run_all = estimate_script(*amp)
    assert run_all.repeats_replayed == 0
    # evaluations before each of the 3 steps: the first's 1st call holds one-time work (the main
    # thread's cuBLAS workspace), its 2nd and 3rd make the same events: 3 + 6 + 6 replayed.
    # Sampling after the first two steps: the full context 9 calls each (7 + 9 replayed); the 15
    # shorter contexts of the first sampling are confirmed in the second, not replayed. With no
    # DataLoader, the run goes on past the third step to the next training forward
    # (standins.start_drain): the third sampling (its 15 shorter contexts and 9 full ones) and the
    # fourth evaluation (6), all replayed
    assert run.repeats_replayed == 3 + 6 + 6 + 7 + 9 + (15 + 9 + 6)
    assert renumbered(run.trace.events) == renumbered(run_all.trace.events)
    assert run.trace.step_ends == run_all.trace.step_ends
    assert est.peak_bytes == est_all.peak_bytes and est.breakdown == est_all.breakdown


def test_a_flag_switched_in_the_models_config_object_is_another_call(monkeypatch):
    """--switch turns on a flag of an object the model holds (model.config) after step 1: the
    full-context sampling calls confirmed before it are not replayed after it (the trace equals
    the all-run one; a key that looked only at the model's own attributes replayed the old calls)."""
    (_est,), run = estimate_script("--switch")
    monkeypatch.setenv("VEST_REPEATS", "run")
    (_est,), run_all = estimate_script("--switch")
    assert renumbered(run.trace.events) == renumbered(run_all.trace.events)
    # as without --switch, but the calls after the switch are new keys: the second sampling's full
    # context replays 7 of 9, the third evaluation 4 of 6; after the third step (the run goes on to
    # the next training forward) the third sampling's 9 full contexts (its 15 shorter ones, new at the
    # switch, are confirmed there) and the fourth evaluation's 6
    assert run.repeats_replayed == 3 + 7 + 6 + 7 + 4 + (9 + 6)


@pytest.mark.parametrize("flag", ["--cache", "--counter"])
def test_calls_that_write_or_read_changing_state_run_every_time(flag):
    """--cache: each no-grad call writes its keys into a buffer the model owns; --counter: the
    forward counts its calls in an attribute and crops its input on odd counts. Neither is replayed."""
    (_est,), run = estimate_script(flag)
    assert run.steps == 3 and run.repeats_replayed == 0
