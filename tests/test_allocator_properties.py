"""Property tests: random alloc/free sequences through the allocator model keep its invariants."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vest_slurm.estimate.allocator import (
    AllocatorConfig, CachingAllocator, OutOfMemory, min_capacity_bytes, replay, round_size,
)
from vest_slurm.estimate.trace import AllocEvent
from vest_slurm.units import KiB, MiB

SIZES = st.one_of(
    st.integers(0, 4 * KiB),                 # tiny, including 0-byte storages
    st.integers(4 * KiB, 1 * MiB),           # small pool
    st.integers(1 * MiB + 1, 12 * MiB),      # large, sharing 20 MiB segments
    st.integers(12 * MiB, 300 * MiB),        # large, own segments (some oversize)
)

CONFIGS = st.sampled_from([
    AllocatorConfig(),
    AllocatorConfig(max_split_size_bytes=64 * MiB),
    AllocatorConfig(roundup_power2_divisions=4),
    AllocatorConfig(expandable_segments=True),
    AllocatorConfig(max_split_size_bytes=32 * MiB, garbage_collection_threshold=0.6, per_process_memory_fraction=0.9),
    AllocatorConfig(expandable_segments=True, max_split_size_bytes=100 * MiB, roundup_power2_divisions=2),
])


@st.composite
def traces(draw, max_ops=80):
    """A well-formed trace: every free names a live block; some blocks stay live at the end."""
    n = draw(st.integers(1, max_ops))
    live: list[int] = []
    events = []
    next_id = 0
    for _ in range(n):
        if live and draw(st.booleans()):
            block = live.pop(draw(st.integers(0, len(live) - 1)))
            events.append(AllocEvent("free", block, 0))
        else:
            events.append(AllocEvent("alloc", next_id, draw(SIZES), stream=draw(st.sampled_from([0, 0, 0, 1]))))
            live.append(next_id)
            next_id += 1
    if draw(st.booleans()):                      # sometimes an empty_cache-free tail of frees
        events += [AllocEvent("free", b, 0) for b in live]
    return events


def _rounded_live_peak(trace, config) -> int:
    """Peak of the live request sizes, each rounded as the allocator rounds it."""
    live, peak, sizes = 0, 0, {}
    for e in trace:
        if e.action == "alloc":
            sizes[e.block] = round_size(e.size_bytes, config) if e.size_bytes else 0
            live += sizes[e.block]
            peak = max(peak, live)
        else:
            live -= sizes.pop(e.block)
    return peak


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), config=CONFIGS, capacity_mib=st.one_of(st.none(), st.integers(2, 1200)))
def test_invariants_hold_after_every_event(trace, config, capacity_mib):
    """allocated + free == reserved, blocks tile their segments, no unmerged free neighbours,
    no block crosses a segment, stream or pool: checked after every event, with or without a cap."""
    capacity = None if capacity_mib is None else capacity_mib * MiB
    a = CachingAllocator(config, capacity)
    for e in trace:
        if e.action == "alloc":
            try:
                a.malloc(e.block, e.size_bytes, e.stream)
            except OutOfMemory as exc:
                assert capacity is not None
                assert exc.reserved_bytes <= capacity
                a.check_invariants()
                return
        else:
            a.free(e.block)
        a.check_invariants()
        assert a.peak_reserved_bytes >= a.reserved_bytes >= a.allocated_bytes
    a.empty_cache()
    a.check_invariants()
    if a.allocated_bytes == 0:   # everything freed and the cache emptied: nothing reserved
        assert a.reserved_bytes == 0 and a.num_segments == 0


@settings(max_examples=200, deadline=None)
@given(trace=traces(), config=CONFIGS)
def test_ample_capacity_agrees_with_uncapped(trace, config):
    free = replay(trace, config)
    assert free.oom is None
    # a cap the run never reaches changes nothing (a fraction moves the cap and arms GC: leave it out)
    if config.per_process_memory_fraction is None:
        capped = replay(trace, config, capacity_bytes=free.peak_reserved_bytes)
        assert capped == free
    else:
        capped = replay(trace, config, capacity_bytes=64 * 1024 * MiB)
        assert capped.oom is None and capped.peak_allocated_bytes == free.peak_allocated_bytes


@settings(max_examples=150, deadline=None)
@given(trace=traces(max_ops=50), config=CONFIGS)
def test_allocated_at_least_rounded_live_bytes(trace, config):
    """A block handed out is at least the rounded request (more when the remainder is not split off),
    so peak allocated >= the peak of live rounded sizes; and reserved >= allocated."""
    peak = _rounded_live_peak(trace, config)
    r = replay(trace, config)
    assert r.peak_allocated_bytes >= peak
    assert r.peak_reserved_bytes >= r.peak_allocated_bytes


@settings(max_examples=100, deadline=None)
@given(trace=traces(max_ops=60), config=CONFIGS)
def test_min_capacity_is_a_verified_boundary(trace, config):
    """min_capacity_bytes (which resumes capped runs from a copied uncapped prefix) agrees with full
    replays: its answer passes, and one granule less fails unless it is below the rounded live peak."""
    g = 2 * MiB
    c = min_capacity_bytes(trace, config, g)
    need = _rounded_live_peak(trace, config)
    if need == 0:
        assert c == 0
        return
    assert c % g == 0
    assert replay(trace, config, capacity_bytes=c).oom is None
    assert c - g < need or replay(trace, config, capacity_bytes=c - g).oom is not None
