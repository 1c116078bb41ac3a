"""Unit tests of the caching-allocator model against hand-derived numbers (arithmetic beside each)."""

from __future__ import annotations

import pytest

from vest_slurm.estimate.allocator import (
    AllocatorConfig, CachingAllocator, OutOfMemory, get_allocation_size, min_capacity_bytes,
    parse_alloc_conf, replay, round_size,
)
from vest_slurm.errors import WorkloadError
from vest_slurm.estimate.trace import AllocEvent
from vest_slurm.units import KiB, MiB

A = lambda block, size, stream=0: AllocEvent("alloc", block, size, stream)  # noqa: E731
F = lambda block: AllocEvent("free", block, 0)  # noqa: E731


def alloc(cfg=AllocatorConfig(), capacity=None):
    return CachingAllocator(cfg, capacity, record_events=True)


def actions(a, *names):
    return [e for e in a.events if e.action in names]


# ---- rounding -----------------------------------------------------------------------------------

@pytest.mark.parametrize("request_bytes, rounded", [
    (1, 512),                 # below kMinBlockSize -> 512
    (511, 512),
    (512, 512),               # already a multiple
    (513, 1024),              # ceil(513/512) = 2 granules
    (1000, 1024),
    (1 * MiB + 1, 1 * MiB + 512),
    (10 * MiB - 100, 10 * MiB),  # 10485660 -> ceil(/512) = 20480 granules = 10485760
])
def test_round_size_512(request_bytes, rounded):
    assert round_size(request_bytes) == rounded


def test_round_size_power2_divisions():
    cfg = AllocatorConfig(roundup_power2_divisions=4)
    # 1200 B: 4 divisions but 1200 <= 512*4 = 2048, so plain 512 rounding: 1536
    assert round_size(1200, cfg) == 1536
    # 3000 B: > 2048; between 2048 and 4096 the 4 steps are 512 B apart: 2048, 2560, 3072 -> 3072
    assert round_size(3000, cfg) == 3072
    # 5 MiB + 1: between 4 and 8 MiB, steps of 1 MiB -> 6 MiB
    assert round_size(5 * MiB + 1, cfg) == 6 * MiB
    # exactly a power of two stays
    assert round_size(8 * MiB, cfg) == 8 * MiB
    # exactly on a step stays: 5 MiB
    assert round_size(5 * MiB, cfg) == 5 * MiB
    # divisions 8 on 1200 MiB: steps of 1024/8 = 128 MiB above 1024 -> 1280 MiB
    assert round_size(1200 * MiB, AllocatorConfig(roundup_power2_divisions=8)) == 1280 * MiB


def test_round_size_per_interval_list():
    cfg = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:4]")
    # intervals (index = log2(size) - 20): [0..7] filled with the first value 1, [8]=1, [9]=2, [10..15]=4
    assert cfg.roundup_power2_divisions == (1,) * 9 + (2,) + (4,) * 6
    # 300 MiB is in [256, 512) MiB: 1 division -> plain 512 rounding, unchanged
    assert round_size(300 * MiB, cfg) == 300 * MiB
    # 600 MiB is in [512, 1024): 2 divisions of 256 MiB -> 768 MiB
    assert round_size(600 * MiB, cfg) == 768 * MiB
    # 1100 MiB is in [1024, 2048): 4 divisions of 256 MiB -> 1280 MiB
    assert round_size(1100 * MiB, cfg) == 1280 * MiB


# ---- pool choice and segment sizes ----------------------------------------------------------------

@pytest.mark.parametrize("size, segment", [
    (512, 2 * MiB),                    # small pool: kSmallBuffer
    (1 * MiB, 2 * MiB),                # 1 MiB is still small (<= kSmallSize)
    (1 * MiB + 512, 20 * MiB),         # large under 10 MiB: kLargeBuffer
    (10 * MiB - 512, 20 * MiB),
    (10 * MiB, 10 * MiB),              # >= kMinLargeAlloc: rounded to 2 MiB -> 10 MiB
    (11 * MiB, 12 * MiB),              # 11 MiB -> next multiple of 2 MiB
])
def test_segment_sizes(size, segment):
    assert get_allocation_size(size) == segment
    a = alloc()
    a.malloc(1, size)
    assert a.reserved_bytes == segment
    assert actions(a, "segment_alloc")[0].size_bytes == segment


def test_pools_are_separate():
    a = alloc()
    a.malloc(1, 4 * MiB)       # large segment of 20 MiB, 16 MiB left free in it
    a.malloc(2, 100 * KiB)     # small request: must not use the large remainder -> new 2 MiB segment
    assert a.reserved_bytes == 22 * MiB          # 20 + 2
    assert len(actions(a, "segment_alloc")) == 2
    a.check_invariants()


# ---- best fit, splitting, merging ----------------------------------------------------------------

def test_best_fit_takes_smallest_fitting_block():
    a = alloc()
    for i, s in enumerate([12 * MiB, 16 * MiB, 14 * MiB]):
        a.malloc(i, s)                    # three segments of exactly 12, 16, 14 MiB
    for i in range(3):
        a.free(i)
    a.malloc(10, 13 * MiB)               # fits 14 and 16; best fit = 14 MiB segment (remainder 1 MiB, no split)
    seg14 = actions(a, "segment_alloc")[2].addr
    assert actions(a, "alloc")[-1].addr == seg14
    assert a.reserved_bytes == 42 * MiB   # no new segment
    assert a.allocated_bytes == 14 * MiB  # 1 MiB remainder not > kSmallSize: the whole block is handed out


def test_large_split_rule_remainder_must_exceed_1mib():
    a = alloc()
    a.malloc(1, 12 * MiB)
    a.free(1)
    # 10 MiB + 512 rounded -> remainder 12 MiB - (10 MiB + 512) = 2 MiB - 512 > 1 MiB: split
    a.malloc(2, 10 * MiB + 512)
    assert a.allocated_bytes == 10 * MiB + 512
    a.free(2)
    # 11 MiB -> remainder exactly 1 MiB, not > 1 MiB: no split, the whole 12 MiB is allocated
    a.malloc(3, 11 * MiB)
    assert a.allocated_bytes == 12 * MiB
    a.check_invariants()


def test_small_split_rule_remainder_at_least_512():
    a = alloc()
    a.malloc(1, 1 * MiB)         # small pool (<= 1 MiB), 2 MiB segment; remainder 1 MiB >= 512: split
    a.malloc(2, 1 * MiB - 512)   # takes the 1 MiB remainder; remainder 512 >= 512: split again
    assert a.allocated_bytes == 2 * MiB - 512
    a.malloc(3, 100)             # rounds to 512: exactly the last remainder, no new segment
    assert a.reserved_bytes == 2 * MiB
    assert a.allocated_bytes == 2 * MiB
    assert len(actions(a, "segment_alloc")) == 1
    a.check_invariants()


def test_small_blocks_pack_into_one_segment_and_merge_on_free():
    a = alloc()
    for i in range(4):
        a.malloc(i, 512 * KiB)   # 4 x 512 KiB = 2 MiB: one small segment, split 3 times
    assert a.reserved_bytes == 2 * MiB and len(actions(a, "segment_alloc")) == 1
    a.free(1)
    a.free(2)                    # merges with its free neighbour 1 -> one free 1 MiB block
    a.check_invariants()
    a.malloc(9, 1 * MiB)         # fits the merged hole exactly, at the address of block 1
    assert actions(a, "alloc")[-1].addr == actions(a, "alloc")[1].addr
    assert a.reserved_bytes == 2 * MiB
    a.check_invariants()


def test_merge_with_both_neighbours_restores_whole_segment():
    a = alloc()
    a.malloc(1, 4 * MiB)
    a.malloc(2, 4 * MiB)
    a.malloc(3, 4 * MiB)          # 12 MiB of a 20 MiB segment used, 8 MiB free tail
    a.free(1)
    a.free(3)                     # merges with the tail: 12 MiB free at the end
    a.free(2)                     # merges with both: the 20 MiB segment is one free block again
    a.check_invariants()
    a.malloc(4, 20 * MiB)         # 20 MiB request: best fit is the whole cached segment
    assert a.reserved_bytes == 20 * MiB and len(actions(a, "segment_alloc")) == 1


def test_nothing_returned_on_free():
    a = alloc()
    a.malloc(1, 100 * MiB)
    a.free(1)
    assert a.reserved_bytes == 100 * MiB and a.allocated_bytes == 0
    assert not actions(a, "segment_free")
    a.empty_cache()
    assert a.reserved_bytes == 0
    assert len(actions(a, "segment_free")) == 1


def test_empty_cache_keeps_segments_with_live_blocks():
    a = alloc()
    a.malloc(1, 4 * MiB)
    a.malloc(2, 4 * MiB)          # same 20 MiB segment
    a.free(1)
    a.empty_cache()               # segment is split (block 2 live): stays
    assert a.reserved_bytes == 20 * MiB


def test_streams_do_not_share_blocks():
    a = alloc()
    a.malloc(1, 8 * MiB, stream=0)
    a.free(1)                     # 20 MiB cached on stream 0
    a.malloc(2, 8 * MiB, stream=1)
    assert a.reserved_bytes == 40 * MiB   # stream 1 cannot use stream 0's cache: new 20 MiB segment
    a.malloc(3, 8 * MiB, stream=0)
    assert a.reserved_bytes == 40 * MiB   # stream 0 reuses its own
    a.check_invariants()


def test_zero_byte_request_never_reaches_allocator():
    a = alloc()
    a.malloc(1, 0)
    assert a.reserved_bytes == 0 and not a.events
    a.free(1)
    with pytest.raises(KeyError):
        a.free(1)


# ---- capacity, flush and retry, OOM -----------------------------------------------------------------

def test_flush_and_retry_at_capacity():
    a = alloc(capacity=60 * MiB)
    a.malloc(1, 40 * MiB)
    a.free(1)                     # 40 MiB cached
    # 50 MiB: no cached fit; 40 + 50 > 60 fails; empty cache (frees 40) and retry: 50 <= 60
    a.malloc(2, 50 * MiB)
    assert a.num_alloc_retries == 1
    assert a.reserved_bytes == 50 * MiB
    assert [e.action for e in a.events][-3:] == ["segment_free", "segment_alloc", "alloc"]


def test_oom_after_flush():
    a = alloc(capacity=60 * MiB)
    a.malloc(1, 40 * MiB)
    with pytest.raises(OutOfMemory) as err:
        a.malloc(2, 30 * MiB)     # 40 live + 30 > 60, nothing to flush
    e = err.value
    assert (e.requested_bytes, e.segment_bytes, e.allocated_bytes, e.reserved_bytes, e.capacity_bytes) == \
        (30 * MiB, 30 * MiB, 40 * MiB, 40 * MiB, 60 * MiB)
    assert a.num_ooms == 1 and actions(a, "oom")


def fragmenting_trace():
    # Two 20 MiB large segments, each kept alive by a 2 MiB block, plus a 40 MiB tensor after:
    # uncapped: 20 + 20 + 40 = 80 MiB reserved. Allocated peak: 2 + 2 + 8 + 8 = 20 MiB early,
    # then 2 + 2 + 40 = 44 MiB. The free 16 MiB remainders are split blocks: a flush cannot free them,
    # so the need is exactly 80 MiB.
    return [A(1, 2 * MiB), A(2, 8 * MiB), A(3, 8 * MiB), A(4, 2 * MiB), A(5, 8 * MiB),
            F(2), F(3), F(5), A(6, 40 * MiB)]


def test_capacity_exactly_at_need_works_and_2mib_less_ooms():
    ev = fragmenting_trace()
    # segments: A1 -> seg1 (20); A2, A3 split seg1 (2+8+8 = 18, remainder 2 MiB > 1 MiB kept free);
    # A4 takes the 2 MiB remainder exactly? remainder 2 MiB, request 2 MiB -> yes, fits seg1.
    # A5 8 MiB -> seg2 (20). frees leave seg1 [2 live][16 free][2 live], seg2 [8 free..] -> seg2 unsplit
    # free 20 MiB: a flush frees seg2. A6 40 MiB: 20 + 20 + 40 = 80 uncapped; at 60 MiB the flush of
    # seg2 gives 20 + 40 = 60.
    free = replay(ev, check=True)
    assert free.peak_reserved_bytes == 80 * MiB and free.oom is None
    assert free.peak_allocated_bytes == 44 * MiB        # 2 + 2 + 40
    ok = replay(ev, capacity_bytes=60 * MiB, check=True)
    assert ok.oom is None and ok.num_alloc_retries == 1 and ok.peak_reserved_bytes == 60 * MiB
    bad = replay(ev, capacity_bytes=58 * MiB, check=True)
    assert bad.oom is not None
    assert (bad.oom.event_index, bad.oom.requested_bytes, bad.oom.allocated_bytes, bad.oom.reserved_bytes,
            bad.oom.capacity_bytes) == (8, 40 * MiB, 4 * MiB, 20 * MiB, 58 * MiB)
    assert min_capacity_bytes(ev) == 60 * MiB


def test_replay_fragmentation_at_peak():
    r = replay(fragmenting_trace())
    # reserved first reaches 80 MiB at A6: allocated then 2 + 2 + 40 = 44 -> 36 MiB unused
    assert r.reserved_minus_allocated_at_peak_bytes == 36 * MiB
    assert r.num_segments == 3 and r.final_reserved_bytes == 80 * MiB


def test_replay_agrees_with_uncapped_when_capacity_ample():
    ev = fragmenting_trace()
    assert replay(ev) == replay(ev, capacity_bytes=80 * MiB)


# ---- PYTORCH_CUDA_ALLOC_CONF options -----------------------------------------------------------------

def test_max_split_size_blocks_oversize_reuse():
    ev = [A(1, 200 * MiB), F(1), A(2, 50 * MiB)]
    # default: 50 MiB request takes the cached 200 MiB block and splits it (remainder 150 > 1 MiB)
    assert replay(ev).peak_reserved_bytes == 200 * MiB
    # max_split 128 MiB: the 200 MiB block is oversize; a 50 MiB request (< 128) must not take it
    cfg = parse_alloc_conf("max_split_size_mb:128")
    assert replay(ev, cfg).peak_reserved_bytes == 250 * MiB


def test_max_split_size_oversize_tolerance_20mib():
    cfg = parse_alloc_conf("max_split_size_mb:128")
    # 200 MiB cached; a 181 MiB request (>= 128): 200 < 181 + 20 -> reused whole (not split)
    r = replay([A(1, 200 * MiB), F(1), A(2, 181 * MiB)], cfg)
    assert r.peak_reserved_bytes == 200 * MiB and r.peak_allocated_bytes == 200 * MiB
    # 180 MiB: 200 >= 180 + 20 -> refused, new 180 MiB segment
    assert replay([A(1, 200 * MiB), F(1), A(2, 180 * MiB)], cfg).peak_reserved_bytes == 380 * MiB
    # max_non_split_rounding_mb widens the tolerance: 200 < 180 + 30
    cfg30 = parse_alloc_conf("max_split_size_mb:128,max_non_split_rounding_mb:30")
    assert replay([A(1, 200 * MiB), F(1), A(2, 180 * MiB)], cfg30).peak_reserved_bytes == 200 * MiB


def test_max_split_size_releases_oversize_blocks_before_flush():
    cfg = parse_alloc_conf("max_split_size_mb:128")
    a = alloc(cfg, capacity=400 * MiB)
    a.malloc(1, 150 * MiB)
    a.malloc(2, 200 * MiB)
    a.free(1)
    a.free(2)                     # cached: 150 and 200 MiB oversize blocks
    # 250 MiB request: neither fits; 350 + 250 > 400; release_available_cached_blocks: no single
    # block >= 250, so free the largest oversize ones until 250 MiB freed: 200, then 150 -> 350 >= 250
    a.malloc(3, 250 * MiB)
    assert a.num_alloc_retries == 0           # the full flush was not needed
    assert a.reserved_bytes == 250 * MiB
    a.check_invariants()


def test_expandable_segments_one_growing_segment():
    cfg = parse_alloc_conf("expandable_segments:True")
    a = alloc(cfg)
    a.malloc(1, 30 * MiB)     # large pool: maps 2 pages of 20 MiB = 40 MiB
    assert a.reserved_bytes == 40 * MiB
    a.malloc(2, 30 * MiB)     # 10 MiB free at the tail + map 1 more page: 60 MiB, same segment
    assert a.reserved_bytes == 60 * MiB
    assert a.num_segments == 1
    a.malloc(3, 100 * KiB)    # small pool: its own segment, one 2 MiB page
    assert a.reserved_bytes == 62 * MiB and a.num_segments == 2
    a.check_invariants()
    a.free(1)
    a.free(2)
    assert a.reserved_bytes == 62 * MiB       # nothing unmapped on free
    a.empty_cache()                           # unmap the free pages: the large segment goes entirely
    assert a.reserved_bytes == 2 * MiB and a.num_segments == 1
    a.check_invariants()


def test_expandable_segments_avoid_fragmentation():
    # 8 MiB and 12 MiB blocks alternate; freeing the 8s leaves holes a 40 MiB tensor cannot use.
    ev = []
    for i in range(4):
        ev += [A(2 * i, 12 * MiB), A(2 * i + 1, 8 * MiB)]
    ev += [F(2 * i + 1) for i in range(4)] + [A(100, 40 * MiB)]
    plain = replay(ev, check=True)
    # plain: A0 12 MiB -> own 12 MiB segment; A1 8 -> 20 MiB segment split, 12 MiB remainder; A2 12
    # takes that remainder exactly; A3/A4, A5/A6 the same; A7 8 -> a 4th 20 MiB segment whose 12 MiB
    # remainder stays free: 12 + 4 x 20 = 92. After the frees the cache holds 8, 8, 8 and a merged 20:
    # the 40 MiB tensor needs a new 40 MiB segment -> 132 MiB.
    assert plain.peak_reserved_bytes == 132 * MiB
    exp = replay(ev, parse_alloc_conf("expandable_segments:True"), check=True)
    # expandable: 80 MiB of tensors packed back to back -> 80 MiB = 4 pages; the 4 free 8 MiB holes
    # are not contiguous, so the 40 MiB tensor maps 2 more pages at the end: 120 MiB
    assert exp.peak_reserved_bytes == 120 * MiB
    assert exp.num_segments == 1


def test_expandable_segments_capacity_retry_unmaps():
    cfg = parse_alloc_conf("expandable_segments:True")
    a = alloc(cfg, capacity=60 * MiB)
    a.malloc(1, 40 * MiB)       # 2 pages
    a.free(1)
    a.malloc(2, 100 * KiB, stream=1)   # small pool, stream 1: 2 MiB -> 42 MiB reserved
    # stream 1 large 50 MiB: needs 60 MiB mapped on a new segment; 42 + 60 > 60 fails; flush unmaps
    # stream 0's 40 MiB -> 2 + 60 > 60 still fails -> OOM. With 58 MiB it cannot work either way.
    with pytest.raises(OutOfMemory):
        a.malloc(3, 50 * MiB, stream=1)
    assert a.num_alloc_retries == 1
    assert a.reserved_bytes == 2 * MiB      # the flush unmapped stream 0's free pages
    a.check_invariants()
    a.malloc(4, 30 * MiB, stream=1)         # 2 + 40 <= 60
    assert a.reserved_bytes == 42 * MiB
    a.check_invariants()


def test_garbage_collection_threshold_frees_old_blocks():
    # capacity 100 MiB, fraction 1.0 -> allowed 100 MiB; threshold 0.5 -> GC once reserved > 50 MiB
    ev = [A(1, 30 * MiB), A(2, 30 * MiB), F(1), F(2), A(3, 40 * MiB)]
    no_gc = replay(ev, AllocatorConfig(per_process_memory_fraction=1.0), capacity_bytes=100 * MiB)
    # without GC: 30 + 30 cached, 40 MiB new -> 100 MiB reserved, all fits
    assert no_gc.peak_reserved_bytes == 100 * MiB and no_gc.final_reserved_bytes == 100 * MiB
    cfg = AllocatorConfig(garbage_collection_threshold=0.5, per_process_memory_fraction=1.0)
    gc = replay(ev, cfg, capacity_bytes=100 * MiB, check=True)
    # with GC: at A3 reserved 60 > 50; target 10 MiB; both cached blocks have the same age (avg) ->
    # both freed (the C++ frees every block at or above the average age in one sweep) -> 40 MiB
    assert gc.final_reserved_bytes == 40 * MiB and gc.peak_reserved_bytes == 60 * MiB
    assert gc.num_alloc_retries == 0


def test_garbage_collection_prefers_old_blocks():
    # allowed 100 MiB, threshold 0.5 -> GC when reserved > 50 MiB. Every large-pool lookup ticks the
    # clock; a cached block's age = ticks since it was cached.
    cfg = AllocatorConfig(garbage_collection_threshold=0.5, per_process_memory_fraction=1.0)
    a = alloc(cfg, capacity=100 * MiB)
    a.malloc(1, 12 * MiB)      # tick 1, segment 12        reserved 12
    a.malloc(2, 14 * MiB)      # tick 2, segment 14        reserved 26
    a.free(1)                  # 12 cached at tick 2
    a.malloc(3, 16 * MiB)      # tick 3, no fit, 26 <= 50: no GC; segment 16 -> 42
    a.free(2)                  # 14 cached at tick 3
    a.malloc(4, 18 * MiB)      # tick 4, no fit, 42 <= 50; segment 18 -> 60
    assert not actions(a, "segment_free")
    a.malloc(5, 20 * MiB)      # tick 5, no fit; 60 > 50, target 10: ages 12 MiB: 3, 14 MiB: 2, average
    #                            2.5 -> only the 12 MiB block is freed (12 >= 10: done); 48 + 20 = 68
    assert [e.size_bytes for e in actions(a, "segment_free")] == [12 * MiB]
    assert a.reserved_bytes == 68 * MiB   # 14 cached + 16 + 18 + 20 live
    assert a.num_alloc_retries == 0
    a.check_invariants()


def test_garbage_collection_needs_memory_fraction():
    # like PyTorch: without set_per_process_memory_fraction the threshold does nothing
    ev = [A(1, 30 * MiB), A(2, 30 * MiB), F(1), F(2), A(3, 40 * MiB)]
    cfg = parse_alloc_conf("garbage_collection_threshold:0.5")
    assert replay(ev, cfg, capacity_bytes=100 * MiB).final_reserved_bytes == 100 * MiB


# ---- parsing ----------------------------------------------------------------------------------------

def test_parse_full_example():
    cfg = parse_alloc_conf("max_split_size_mb:128,roundup_power2_divisions:4,expandable_segments:True,"
                           "garbage_collection_threshold:0.8")
    assert cfg.max_split_size_bytes == 128 * MiB
    assert cfg.roundup_power2_divisions == (4,) * 16
    assert cfg.expandable_segments is True
    assert cfg.garbage_collection_threshold == 0.8
    assert parse_alloc_conf("") == AllocatorConfig()
    assert parse_alloc_conf(" expandable_segments : False ") == AllocatorConfig()
    assert parse_alloc_conf("backend:native,pinned_use_cuda_host_register:True") == AllocatorConfig()


@pytest.mark.parametrize("text, needle", [
    ("max_split_sizemb:128", "max_split_size_mb"),           # unknown key: lists the valid ones
    ("max_split_size_mb:10", ">= 20"),
    ("max_split_size_mb:abc", "whole number"),
    ("max_split_size_mb", "missing value"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("roundup_power2_divisions:[100:2]", "power of 2"),
    ("roundup_power2_divisions:[256:3]", "power of 2"),
    ("expandable_segments:yes", "True or False"),
    ("garbage_collection_threshold:1.5", "(0.0, 1.0)"),
    ("garbage_collection_threshold:0", "(0.0, 1.0)"),
    ("backend:cudaMallocAsync", "does not model"),
    ("max_split_size_mb:128;expandable_segments:True", "whole number"),
])
def test_parse_errors(text, needle):
    with pytest.raises(WorkloadError) as err:
        parse_alloc_conf(text)
    assert needle in str(err.value)
    assert err.value.fix


def test_empty_cache_in_a_trace_releases_the_cached_segments():
    """torch.cuda.empty_cache() in a script's run is marked in its trace (a zero-size allocation of
    module trace.EMPTY_CACHE); the replay releases the cached segments there, as the real call does,
    so an allocation that does not fit the cached segment after it takes a new one alone."""
    from vest_slurm.estimate.trace import EMPTY_CACHE

    big = 100 * 2**20
    before = [A(1, big), F(1)]
    after = [A(2, big + 20 * 2**20), F(2)]
    marker = [AllocEvent("alloc", 99, 0, 0, "other", "other", EMPTY_CACHE), F(99)]
    kept = replay(before + after)
    emptied = replay(before + marker + after)
    assert kept.peak_reserved_bytes == 2 * big + 20 * 2**20   # the cached segment stays beside the new one
    assert emptied.peak_reserved_bytes == big + 20 * 2**20
    assert min_capacity_bytes(before + marker + after) <= emptied.peak_reserved_bytes
