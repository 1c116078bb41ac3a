"""The allocator's answers, made once (replaycache.py): the same answers as replaying every GPU type
afresh, one capacity search for GPU types that differ only in cuDNN workspaces, and read back from
disk by the next process."""

from __future__ import annotations

import pytest
import torch  # noqa: F401

from vest_slurm.estimate import estimator, replaycache
from vest_slurm.estimate.allocator import min_capacity_bytes, replay
from vest_slurm.estimate.allocator_config import parse_alloc_conf
from vest_slurm.estimate.profiles import PROFILES, get_profile
from vest_slurm.estimate.workload import parse_workload_args


def spec(*argv):
    return parse_workload_args(["--model", "torchvision:resnet18", "--input", "3x64x64", "--batch-size", "8", *argv])


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = replaycache.min_capacity_bytes

    def counting(events, config):
        calls.append(len(events))
        return real(events, config)

    monkeypatch.setattr(replaycache, "min_capacity_bytes", counting)
    replaycache._NEEDS.clear()
    estimator._REPLAYS.clear()
    return calls


def _fresh(summary, sp, profile):
    """The answers as the estimator made them before: every GPU type replayed afresh."""
    config = parse_alloc_conf(sp.alloc_conf)
    events = estimator._events_for(summary.trace.events, profile, sp, summary)
    full, _, _ = estimator._with_rest_of_run(events, summary, config)
    return replay(full, config), min_capacity_bytes(estimator._without_cudnn_workspaces(full), config)


def test_every_gpu_type_gets_the_answers_a_fresh_replay_gives_with_fewer_capacity_searches(counted, monkeypatch):
    monkeypatch.setenv("VEST_CACHE_DIR", "off")
    sp = spec()
    profiles = [get_profile(k) for k in PROFILES]
    traces = {}
    for p in profiles:
        traces.setdefault(estimator.gpu_class(p), estimator.trace_for(sp, p))
    for p in profiles:
        est = estimator.estimate_from_trace(traces[estimator.gpu_class(p)], sp, p)
        result, need = _fresh(traces[estimator.gpu_class(p)], sp, p)
        parts = dict(est.parts())
        assert parts["allocator_peak_reserved"] == result.peak_reserved_bytes, p.key
        assert parts["allocator_peak_allocated"] == result.peak_allocated_bytes, p.key
        assert parts["allocator_required"] == need, p.key
    distinct = {(estimator.gpu_class(p), p.cublas_workspace_bytes) for p in profiles}
    assert len(counted) <= len(distinct) < len(profiles)   # one search per run without cuDNN workspaces


def test_the_next_process_reads_the_replays_and_gets_the_same_estimate(counted, tmp_path, monkeypatch):
    monkeypatch.setenv("VEST_CACHE_DIR", str(tmp_path))
    sp, p = spec(), get_profile("a100-40gb")
    summary = estimator.trace_for(sp, p, cache=True)
    first = estimator.estimate_from_trace(summary, sp, p)
    assert not counted and list(tmp_path.glob("replays/*/*.json.gz"))   # the uncapped replay, kept
    first.required_bytes
    assert len(counted) == 1    # searched when asked for, and kept beside it
    estimator._REPLAYS.clear()      # a new process: nothing in memory
    replaycache._NEEDS.clear()
    again = estimator.estimate_from_trace(estimator.trace_for(sp, p, cache=True), sp, p)
    assert again == first and len(counted) == 1   # read, not searched again
    events, _ = estimator.replayed_events(estimator.trace_for(sp, p, cache=True), sp, p)
    assert len(events) > len(summary.trace.events)   # the whole run is made again where it is asked for


def test_a_damaged_replay_entry_is_a_miss_and_is_replaced(counted, tmp_path, monkeypatch):
    monkeypatch.setenv("VEST_CACHE_DIR", str(tmp_path))
    sp, p = spec(), get_profile("h100-80gb")
    first = estimator.estimate_from_trace(estimator.trace_for(sp, p, cache=True), sp, p)
    first.required_bytes
    (entry,) = tmp_path.glob("replays/*/*.json.gz")
    entry.write_bytes(b"not gzip")
    estimator._REPLAYS.clear()
    replaycache._NEEDS.clear()
    assert estimator.estimate_from_trace(estimator.trace_for(sp, p, cache=True), sp, p) == first
    assert len(counted) == 2 and replaycache._load(entry) is not None


def test_what_the_replay_reads_changes_the_key():
    from vest_slurm.estimate.trace import AllocEvent

    base = [AllocEvent("alloc", 1, 4096, 0, "forward", "activation", "conv1"), AllocEvent("free", 1, 4096)]
    d = replaycache._digest(base, [1])
    assert replaycache._digest(base, [1]) == d
    assert replaycache._digest([AllocEvent("alloc", 1, 4097, 0, "forward", "activation", "conv1"), base[1]], [1]) != d
    assert replaycache._digest([AllocEvent("alloc", 1, 4096, 0, "forward", "workspace", "cudnn"), base[1]], [1]) != d
    assert replaycache._digest(base, [2]) != d
    # what no replay reads (phase, category, module name, op) does not
    assert replaycache._digest([AllocEvent("alloc", 1, 4096, 0, "backward", "temporary", "fc", op="mm"), base[1]],
                               [1]) == d


def test_the_need_is_never_above_the_reserved_peak(monkeypatch):
    """A cuDNN workspace of 22 MiB, freed; 2.1 MiB then 21 MiB: with the workspace the 2.1 MiB
    is split off its cached segment and the job reserves 24 MiB; with no workspace (the capacity
    search's events) the 2.1 MiB opens a 20 MiB segment of its own and the search needs 42 MiB.
    The job runs at 24 MiB (its replay found room for everything there): the need says so, not 42."""
    from vest_slurm.estimate.allocator_config import AllocatorConfig
    from vest_slurm.estimate.trace import AllocEvent

    monkeypatch.setenv("VEST_CACHE_DIR", "off")
    ev = [AllocEvent("alloc", 0, 23072768, 0, "forward", "workspace", "cudnn"), AllocEvent("free", 0, 0),
          AllocEvent("alloc", 1, 2199552, 0, "forward", "activation"),
          AllocEvent("alloc", 2, 22024192, 0, "forward", "activation")]
    full = replay(ev)
    assert min_capacity_bytes(replaycache.zero_cudnn(ev)) > full.peak_reserved_bytes   # the search alone
    got = replaycache.replayed(ev, [], AllocatorConfig(), lambda: (ev, full))
    assert got.need_bytes == full.peak_reserved_bytes


def test_an_empty_cache_marker_is_its_own_key():
    """The replay releases its cached segments at an empty_cache marker (trace.EMPTY_CACHE), a
    zero-size allocation: the answers kept by digest tell it from an ordinary zero-size one."""
    from vest_slurm.estimate.trace import EMPTY_CACHE, AllocEvent

    ev = [AllocEvent("alloc", 1, 100 << 20, 0), AllocEvent("free", 1, 0), AllocEvent("alloc", 2, 0, 0),
          AllocEvent("free", 2, 0), AllocEvent("alloc", 3, 120 << 20, 0)]
    marked = ev[:2] + [AllocEvent("alloc", 2, 0, 0, "other", "other", EMPTY_CACHE)] + ev[3:]
    assert replaycache._digest(ev) != replaycache._digest(marked)
    assert replay(ev).peak_reserved_bytes > replay(marked).peak_reserved_bytes


def test_the_capacity_search_is_made_only_where_it_decides_the_peak(counted, monkeypatch):
    """The peak is the uncapped replay's except where that is above the GPU and the live tensors
    are not (the job may run by flushing the cache: then the search decides). Elsewhere the need is
    searched when asked for, and it is the one an eager search gives."""
    from dataclasses import replace

    monkeypatch.setenv("VEST_CACHE_DIR", "off")
    sp, p = spec(), get_profile("a100-40gb")
    summary = estimator.trace_for(sp, p)
    roomy = estimator.estimate_from_trace(summary, sp, p)
    assert not counted
    result, need = _fresh(summary, sp, p)
    outside = roomy.required_bytes - need
    assert len(counted) == 1 and roomy.peak_bytes == outside + result.peak_reserved_bytes
    assert dict(roomy.parts())["allocator_required"] == need
    # a GPU between the need and the uncapped peak: the search is made, and the GPU fills up
    estimator._REPLAYS.clear()
    replaycache._NEEDS.clear()
    tight_mib = (outside + (need + result.peak_reserved_bytes) // 2) // (1 << 20) + p.reserved_mib
    tight = replace(p, total_mib=tight_mib)
    est = estimator.estimate_from_trace(summary, sp, tight)
    assert len(counted) == 2 and est.peak_bytes == tight.usable_bytes < outside + result.peak_reserved_bytes
    # below the live tensors: nothing to search, the uncapped peak stands
    small = replace(p, total_mib=(outside + need // 2) // (1 << 20) + p.reserved_mib)
    assert estimator.estimate_from_trace(summary, sp, small).peak_bytes == outside + result.peak_reserved_bytes
    assert len(counted) == 2
