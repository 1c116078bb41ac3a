"""steady.py: the last traced step repeated until the allocator settles."""

import random

import pytest

from vest_slurm.estimate import steady
from vest_slurm.estimate.allocator import replay
from vest_slurm.estimate.trace import AllocEvent
from vest_slurm.units import MiB


def _loop(steps: int, seed: int):
    """A training loop's allocations: parameters, then per step a schedule drawn once and repeated:
    blocks of random sizes allocated and freed in an interleaved order, one of them (the loop's
    reference to the step's output) kept alive into the next step, which frees it at a random
    point. The last kept block is freed after the loop. Returns (events, step_ends)."""
    rng = random.Random(seed)
    n = rng.randint(5, 12)
    sizes = [rng.choice([1, 3, 6, 12, 25, 40, 70]) * MiB + rng.randrange(0, 512 * 1024) for _ in range(n)]
    kept = rng.randrange(n)                  # this block lives into the next step
    ops = []                                 # ("a", i) / ("f", i) / ("f", "prev")
    for i in range(n):
        ops.append(("a", i))
    for i in rng.sample(range(n), n):
        if i != kept:
            pos = rng.randint([k for k, o in enumerate(ops) if o == ("a", i)][0] + 1, len(ops))
            ops.insert(pos, ("f", i))
    ops.insert(rng.randint(0, len(ops)), ("f", "prev"))
    ev, ends = [AllocEvent("alloc", 1, 50 * MiB)], []   # block 1: the parameters
    next_id = 1
    prev = None
    for _ in range(steps):
        ids = {}
        for kind, i in ops:
            if kind == "a":
                next_id += 1
                ids[i] = next_id
                ev.append(AllocEvent("alloc", ids[i], sizes[i]))
            elif i == "prev":
                if prev is not None:
                    ev.append(AllocEvent("free", prev, 0))
            else:
                ev.append(AllocEvent("free", ids[i], 0))
        prev = ids[kept]
        ends.append(len(ev))
    ev.append(AllocEvent("free", prev, 0))
    return ev, ends


def _check_valid(events):
    live = set()
    for e in events:
        if e.action == "alloc":
            assert e.block not in live
            live.add(e.block)
        else:
            assert e.block in live, f"free of {e.block}, which is not alive"
            live.remove(e.block)
    return live


def _expected_copies(seed: int) -> int:
    """How many steps steady.extend should add, from the loop itself run longer (not from the
    extension): its rule is to add copies of the last step until PATIENCE copies in a row leave
    peak reserved where it was, at most MAX_COPIES. peaks[j] is the peak reserved of the real loop
    run for 2 + j steps, i.e. after j added steps."""
    peaks = [replay(_loop(2 + j, seed)[0]).peak_reserved_bytes for j in range(steady.MAX_COPIES + 1)]
    still = 0
    for j in range(1, steady.MAX_COPIES + 1):
        still = still + 1 if peaks[j] == peaks[j - 1] else 0
        if still == steady.PATIENCE:
            return j
    return steady.MAX_COPIES


@pytest.mark.parametrize("seed", range(40))
def test_extension_replays_like_the_longer_run(seed):
    """Two traced steps extended by steady.extend reach the peak reserved of the same loop run
    for as many steps, and the extended trace is well formed."""
    two, ends = _loop(2, seed)
    extended, copies = steady.extend(two, ends)
    expected = _expected_copies(seed)
    assert copies == expected and steady.PATIENCE <= copies <= steady.MAX_COPIES
    assert _check_valid(extended) == {1}   # only the parameters outlive the run
    long, _ = _loop(2 + expected, seed)
    assert replay(extended).peak_reserved_bytes == replay(long).peak_reserved_bytes
    # The length by hand: a step of _loop allocates its n blocks and frees n - 1 of them plus the
    # block the step before kept, 2n events (ends[1] - ends[0]: the first step has no block to free
    # from before it, so only the second step has the full length); each added step is one more
    # such step, so the extension adds expected * 2n events to the two-step trace.
    step_events = ends[1] - ends[0]
    assert step_events == 2 * sum(1 for e in two[ends[0]:ends[1]] if e.action == "alloc")
    assert len(extended) == len(two) + expected * step_events


def test_some_loops_grow_after_the_traced_steps():
    """The reason the module exists: in some of these loops reserved memory grows after step 2."""
    grew = 0
    for seed in range(40):
        two, ends = _loop(2, seed)
        extended, _ = steady.extend(two, ends)
        grew += replay(extended).peak_reserved_bytes > replay(two).peak_reserved_bytes
    assert grew > 0


def test_left_as_is_when_the_step_keeps_extra_blocks():
    """A step that keeps something alive it does not take over (a list of losses kept on the
    GPU) cannot be repeated by pairing blocks: the trace is returned unchanged."""
    ev, ends = _loop(2, 0)
    i = ends[1] - 1
    ev = ev[:i] + [AllocEvent("alloc", 10_000, 512)] + ev[i:]
    ends = [ends[0], ends[1] + 1]
    out, copies = steady.extend(ev, ends)
    assert copies == 0 and out == ev


def test_left_as_is_with_one_step():
    ev, ends = _loop(1, 0)
    assert steady.extend(ev, ends) == (ev, 0)
    assert steady.extend(ev, []) == (ev, 0)


@pytest.mark.parametrize("argv", [(), ("--num-gpus", "2", "--parallelism", "ddp")])
def test_estimator_repeats_the_last_step(argv):
    """The estimator's events get the rest of the run, also where it adds DDP's buckets before
    the first step (the step ends move with them)."""
    from vest_slurm.estimate.allocator_config import AllocatorConfig
    from vest_slurm.estimate.estimator import _events_for, _with_rest_of_run, trace_for
    from vest_slurm.estimate.profiles import get_profile
    from vest_slurm.estimate.workload import parse_workload_args

    spec = parse_workload_args(["--model", 'mlp:[["Linear",256,512],["ReLU"],["Linear",512,10]]',
                                "--batch-size", "32", "--input", "256", *argv])
    profile = get_profile("a100-80gb")
    summary = trace_for(spec, profile)
    events = _events_for(summary.trace.events, profile, spec, summary)
    assert (len(events) > len(summary.trace.events)) == bool(argv)   # the buckets, for DDP
    extended, copies, _ = _with_rest_of_run(events, summary, AllocatorConfig())
    assert copies >= steady.PATIENCE
    _check_valid(extended)


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:64,roundup_power2_divisions:4"])
def test_the_replay_made_while_extending_is_the_replay_of_the_extended_run(conf):
    """extend_and_replay's uncapped replay comes from the allocator run that decides when to stop,
    carried on through the tail: it is what allocator.replay of the extended events answers, where
    the step repeats, where it cannot be repeated and with one step."""
    from vest_slurm.estimate.allocator_config import parse_alloc_conf

    config = parse_alloc_conf(conf)
    kept = _loop(2, 0)[0]
    i = _loop(2, 0)[1][1] - 1
    cases = [_loop(3, seed) for seed in range(6)] + [_loop(1, 0)] + [
        (kept[:i] + [AllocEvent("alloc", 10_000, 512)] + kept[i:], [_loop(2, 0)[1][0], _loop(2, 0)[1][1] + 1])]
    repeated = 0
    for ev, ends in cases:
        full, copies, result = steady.extend_and_replay(ev, ends, config)
        assert (full, copies) == steady.extend(ev, ends, config)
        assert result == replay(full, config)
        repeated += copies > 0
    assert 0 < repeated < len(cases)
