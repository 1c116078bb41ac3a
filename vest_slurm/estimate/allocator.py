"""Replay of an AllocTrace through a model of PyTorch's CUDA caching allocator.

Mirrored source: pytorch/pytorch ``c10/cuda/CUDACachingAllocator.cpp`` at commit
001074d25084fdb87a799823e395a50f5ec044d3 (DeviceCachingAllocator: malloc, get_free_block,
should_split, alloc_found_block, alloc_block, free_block, try_merge_blocks,
release_available_cached_blocks, release_cached_blocks, garbage_collect_cached_blocks and the
expandable-segment code: find_expandable_block, map_block, try_allocate_expandable_block,
unmap_block). The decision sequence was checked against the torch 2.9-era ``get_free_block``, whose
only change is that the oversize tolerance is the option max_non_split_rounding_mb (default
kLargeBuffer), modelled here. Option parsing: see vest_slurm/estimate/allocator_config.py (torch 2.9).

The policy (one device, the default pools; what ``malloc`` below does, in this order)
-------------------------------------------------------------------------------------
1. A request of 0 bytes never reaches the allocator (``allocate()`` returns a null pointer).
2. Round the size: below 512 B to 512 B; otherwise, if roundup_power2_divisions gives D > 1 for the
   size's power-of-two interval and size > 512 x D, up to the next of D equal steps between the
   surrounding powers of two; else up to a multiple of 512 B.                        (round_size)
3. Pool: sizes up to 1 MiB go to the small pool, larger ones to the large pool.       (get_pool)
4. Best fit: the smallest free cached block of that pool on the same stream with size >= request
   (blocks ordered by stream, size, address; a block freed on one stream serves only that stream).
   With max_split_size set: a request below it never gets an oversize block (>= max_split_size),
   and a request at or above it gets an oversize block only if the block is less than
   max_non_split_rounding (20 MiB) larger.                                          (get_free_block)
5. No fit: if garbage collection is armed (garbage_collection_threshold and a memory fraction),
   free old unsplit cached large blocks while reserved > threshold x allowed.
6. Ask the driver for a new segment: 2 MiB for small requests, 20 MiB for large requests under
   10 MiB, else the request rounded up to 2 MiB (get_allocation_size). With expandable segments,
   instead grow the stream's one segment of that pool by mapping 2 MiB (small) / 20 MiB (large)
   pages. Fails when it would exceed the capacity (or the allowed fraction).           (alloc_block)
7. On failure: with max_split_size set, free cached oversize blocks enough for the request and
   retry (release_available_cached_blocks); then free every unsplit cached block, i.e. empty the
   cache (release_cached_blocks; counts a retry), and retry once more; then out of memory.
8. Split the block when the remainder is worth keeping: small pool (or expandable segments):
   remainder >= 512 B; large pool: remainder > 1 MiB and request < max_split_size. (should_split)
9. Free: the block goes back to its pool and merges with a free neighbour on either side in the
   same segment; nothing is returned to the driver (only steps 5, 7 and empty_cache do that).

Known limitations
-----------------
- One device, default pools only: no CUDA-graph private pools, no ``MemPool``, no recordStream
  (cross-stream uses and their deferred frees), no free-memory callbacks.
- The driver is a capacity counter: a segment fits if reserved + its size <= capacity. Physical
  fragmentation, driver overhead and other processes are not modelled (they live in overheads).
- Addresses are a bump pointer, so among equal-size free blocks the older segment wins ties; the
  real driver's address order is not predictable.
- release_available_cached_blocks is skipped with expandable segments (PyTorch would assert there).
- An expandable segment's address space is unbounded (PyTorch: 9/8 of the GPU's memory).
- Garbage collection runs only with a memory fraction, like PyTorch (``set_fraction``); the
  fraction is AllocatorConfig.per_process_memory_fraction of capacity_bytes.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Iterable, Sequence

from .allocator_config import AllocatorConfig, parse_alloc_conf
from .trace import EMPTY_CACHE, AllocEvent
from ..units import MiB

__all__ = [
    "AllocatorConfig", "parse_alloc_conf", "CachingAllocator", "OutOfMemory", "TraceEntry",
    "ReplayResult", "OomPoint", "replay", "min_capacity_bytes", "round_size", "get_allocation_size",
]

# --- Constants (CUDACachingAllocator.cpp; CUDACachingAllocator.h for kLargeBuffer) -------------
K_MIN_BLOCK_SIZE = 512          # kMinBlockSize: every size is rounded to a multiple; smallest split remainder (small pool)
K_SMALL_SIZE = 1 * MiB          # kSmallSize: largest "small" request; large-pool split remainder must exceed it
K_SMALL_BUFFER = 2 * MiB        # kSmallBuffer: segment size of the small pool; its expandable page size
K_LARGE_BUFFER = 20 * MiB       # kLargeBuffer: segment for large requests under kMinLargeAlloc; expandable page size
K_MIN_LARGE_ALLOC = 10 * MiB    # kMinLargeAlloc: large requests below this share a kLargeBuffer segment
K_ROUND_LARGE = 2 * MiB         # kRoundLarge: segments of larger requests are rounded up to this
NO_MAX_SPLIT = (1 << 64) - 1    # max_split_size default: SIZE_MAX, nothing is "oversize"
# Address space reserved per expandable segment. PyTorch reserves 9/8 of the GPU's total memory,
# which only runs out when unmapped holes push mapping past the end; we treat it as unbounded so
# that a capacity the run never reaches changes nothing. A multiple of both page sizes.
UNBOUNDED_ADDRESS_SPACE = 20 * MiB * (1 << 30)


def round_size(size_bytes: int, config: AllocatorConfig = AllocatorConfig()) -> int:
    """round_size: 512 B granules, or the next power-of-two division (roundup_power2_divisions)."""
    if size_bytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = config.divisions_for(size_bytes)
    if divisions > 1 and size_bytes > K_MIN_BLOCK_SIZE * divisions:
        return _roundup_power2_next_division(size_bytes, divisions)
    return -(-size_bytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def get_allocation_size(size: int) -> int:
    """get_allocation_size: the segment cudaMalloc'd for a (rounded) request that found no block."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


# --- State -------------------------------------------------------------------------------------

class _Segment:
    """One cudaMalloc (base, size) or one expandable segment (reserved address space)."""

    __slots__ = ("base", "size", "stream", "pool", "expandable", "page_bytes")

    def __init__(self, base: int, size: int, stream: int, pool: "_Pool", expandable: bool, page_bytes: int = 0):
        self.base, self.size, self.stream, self.pool = base, size, stream, pool
        self.expandable, self.page_bytes = expandable, page_bytes


class _Block:
    __slots__ = ("addr", "size", "stream", "pool", "segment", "allocated", "mapped", "prev", "next",
                 "requested", "gc_base")

    def __init__(self, addr: int, size: int, stream: int, pool: "_Pool", segment: _Segment, mapped: bool = True):
        self.addr, self.size, self.stream, self.pool, self.segment = addr, size, stream, pool, segment
        self.allocated = False
        self.mapped = mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.requested = 0
        self.gc_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """BlockPool: free mapped blocks ordered like BlockComparatorSize (stream, size, address) and
    unmapped expandable ranges ordered like BlockComparatorAddress (stream, address)."""

    __slots__ = ("is_small", "blocks", "unmapped", "free_calls", "whole")

    def __init__(self, is_small: bool):
        self.is_small = is_small
        self.blocks: list[tuple[int, int, int, _Block]] = []
        self.unmapped: list[tuple[int, int, _Block]] = []
        self.free_calls = 0  # get_free_blocks_call_count: the clock of garbage-collection ages
        # Cached blocks that are a whole (unsplit, cudaMalloc'd) segment: what a flush can release.
        # Kept apart so that a flush costs O(those) rather than O(every cached block).
        self.whole: set[_Block] = set()

    def insert(self, b: _Block) -> None:  # insert_into_blocks
        b.gc_base = self.free_calls
        insort(self.blocks, (b.stream, b.size, b.addr, b))
        if b.prev is None and b.next is None and not b.segment.expandable:
            self.whole.add(b)

    def remove(self, b: _Block) -> None:
        blocks = self.blocks
        i = bisect_left(blocks, (b.stream, b.size, b.addr))
        assert i < len(blocks) and blocks[i][3] is b, "free block missing from its pool"
        del blocks[i]
        self.whole.discard(b)

    def whole_in_order(self) -> list[_Block]:
        """The whole-segment cached blocks in pool order (stream, size, address)."""
        return sorted(self.whole, key=lambda b: (b.stream, b.size, b.addr))

    def insert_unmapped(self, b: _Block) -> None:
        insort(self.unmapped, (b.stream, b.addr, b))

    def remove_unmapped(self, b: _Block) -> None:
        i = bisect_left(self.unmapped, (b.stream, b.addr))
        assert i < len(self.unmapped) and self.unmapped[i][2] is b, "unmapped block missing from its pool"
        del self.unmapped[i]


@dataclass(frozen=True)
class TraceEntry:
    """A memory-snapshot-style event (TraceEntry in the C++): alloc, free_completed, segment_alloc,
    segment_free, segment_map, segment_unmap, oom. ``size_bytes`` is the block or segment size."""

    action: str
    addr: int
    size_bytes: int
    stream: int


class OutOfMemory(Exception):
    """The request did not fit, even after emptying the cache (PyTorch's OutOfMemoryError)."""

    def __init__(self, requested_bytes: int, rounded_bytes: int, segment_bytes: int, stream: int,
                 allocated_bytes: int, reserved_bytes: int, capacity_bytes: int | None):
        self.requested_bytes = requested_bytes
        self.rounded_bytes = rounded_bytes
        self.segment_bytes = segment_bytes
        self.stream = stream
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes
        self.capacity_bytes = capacity_bytes
        super().__init__(
            f"out of memory: tried to allocate {segment_bytes} B for a request of {requested_bytes} B "
            f"on stream {stream}; {allocated_bytes} B allocated, {reserved_bytes} B reserved, "
            f"capacity {capacity_bytes} B")


class CachingAllocator:
    """DeviceCachingAllocator for one device. Block ids come from the trace; sizes in bytes."""

    def __init__(self, config: AllocatorConfig = AllocatorConfig(), capacity_bytes: int | None = None,
                 record_events: bool = False):
        self.config = config
        self.capacity_bytes = capacity_bytes
        self.record_events = record_events
        self.events: list[TraceEntry] = []
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_segments = 0
        self._max_split = config.max_split_size_bytes if config.max_split_size_bytes is not None else NO_MAX_SPLIT
        self._non_split_rounding = config.max_non_split_rounding_bytes
        self._expandable = config.expandable_segments
        # set_fraction / allowed_memory_maximum: only with a memory fraction and a capacity.
        f = config.per_process_memory_fraction
        self._allowed = int(f * capacity_bytes) if (f is not None and capacity_bytes is not None) else None
        self._gc_armed = self._allowed is not None and config.garbage_collection_threshold is not None
        self._small = _Pool(True)
        self._large = _Pool(False)
        self._live: dict[int, _Block] = {}
        self._zero_size: set[int] = set()
        self._next_addr = 1 << 32   # bump pointer for fake device addresses
        self._segments: set[_Segment] = set()
        self._sizing: dict[int, tuple[int, bool, int]] = {}

    # ---- public API ---------------------------------------------------------------------------

    def malloc(self, block: int, size_bytes: int, stream: int = 0) -> None:
        """DeviceCachingAllocator::malloc. Raises OutOfMemory when the request cannot be met."""
        if block in self._live or block in self._zero_size:
            raise ValueError(f"block {block} is already allocated")
        if size_bytes == 0:                    # allocate(): size 0 never calls malloc
            self._zero_size.add(block)
            return
        sizing = self._sizing.get(size_bytes)
        if sizing is None:   # round_size, get_pool, get_allocation_size; memoized (sizes repeat)
            size = round_size(size_bytes, self.config)
            sizing = self._sizing[size_bytes] = (size, size <= K_SMALL_SIZE, get_allocation_size(size))
        size, is_small, alloc_size = sizing
        pool = self._small if is_small else self._large

        b = self._get_free_block(pool, stream, size)
        if b is None:
            if self._gc_armed:
                self._garbage_collect_cached_blocks()
            b = (self._alloc_block(pool, stream, size, alloc_size, is_retry=False)
                 or (self._release_available_cached_blocks(pool, stream, size)
                     and self._alloc_block(pool, stream, size, alloc_size, is_retry=False))
                 or (self._release_cached_blocks()
                     and self._alloc_block(pool, stream, size, alloc_size, is_retry=True)))
        if not b:
            self.num_ooms += 1
            self._record("oom", 0, alloc_size, stream)
            raise OutOfMemory(size_bytes, size, alloc_size, stream, self.allocated_bytes,
                              self.reserved_bytes, self.capacity_bytes)
        self._alloc_found_block(b, block, size, size_bytes, split=self._should_split(b, size))

    def free(self, block: int) -> None:
        """DeviceCachingAllocator::free: back to the pool, merged with free neighbours."""
        b = self._live.pop(block, None)
        if b is None:
            if block in self._zero_size:
                self._zero_size.discard(block)
                return
            raise KeyError(f"free of block {block}, which is not allocated")
        b.allocated = False
        self.allocated_bytes -= b.size
        if self.record_events:
            self._record("free_completed", b.addr, b.requested, b.stream)
        pool = b.pool
        if b.prev is not None and not b.prev.allocated:
            self._try_merge_blocks(b, b.prev, pool)
        if b.next is not None and not b.next.allocated:
            self._try_merge_blocks(b, b.next, pool)
        b.gc_base = pool.free_calls
        insort(pool.blocks, (b.stream, b.size, b.addr, b))   # pool.insert, inlined: the hot path
        if b.prev is None and b.next is None and not b.segment.expandable:
            pool.whole.add(b)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): release every unsplit cached block (and unmap free pages)."""
        self._release_cached_blocks()

    # ---- the steps of malloc ------------------------------------------------------------------

    def _get_free_block(self, pool: _Pool, stream: int, size: int) -> _Block | None:
        if self._gc_armed:
            pool.free_calls += 1
        blocks = pool.blocks
        i = bisect_left(blocks, (stream, size))
        if i == len(blocks) or blocks[i][0] != stream:
            return None
        b = blocks[i][3]
        if b.segment.expandable:
            # Best fit counts a block's unmapped tail: it can grow into it.
            n = len(blocks)
            while i + 1 < n and blocks[i + 1][0] == stream and \
                    _expandable_size(blocks[i + 1][3]) < _expandable_size(blocks[i][3]):
                i += 1
            b = blocks[i][3]
        if size < self._max_split and b.size >= self._max_split:
            return None                  # never hand an oversize block to a request below max_split
        if size >= self._max_split and b.size >= size + self._non_split_rounding:
            return None                  # oversize blocks serve requests at most 20 MiB smaller
        del blocks[i]
        pool.whole.discard(b)
        return b

    def _should_split(self, b: _Block, size: int) -> bool:
        remaining = b.size - size
        if b.pool.is_small or self._expandable:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self._max_split and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, b: _Block, block_id: int, size: int, requested: int, split: bool) -> None:
        if split:
            remaining = b
            b = _Block(remaining.addr, size, remaining.stream, remaining.pool, remaining.segment)
            b.prev = remaining.prev
            if b.prev is not None:
                b.prev.next = b
            b.next = remaining
            remaining.prev = b
            remaining.addr += size
            remaining.size -= size
            remaining.pool.insert(remaining)
        b.allocated = True
        b.requested = requested
        self._live[block_id] = b
        self.allocated_bytes += b.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        if self.record_events:
            self._record("alloc", b.addr, requested, b.stream)

    def _alloc_block(self, pool: _Pool, stream: int, size: int, alloc_size: int, is_retry: bool) -> _Block | None:
        if is_retry:
            self.num_alloc_retries += 1
        if self._allowed is not None and self.reserved_bytes + alloc_size > self._allowed:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, stream, size)
        if self.capacity_bytes is not None and self.reserved_bytes + alloc_size > self.capacity_bytes:
            return None                                        # cudaMalloc: out of memory
        seg = _Segment(self._take_addresses(alloc_size), alloc_size, stream, pool, expandable=False)
        self._segments.add(seg)
        self.num_segments += 1
        self._grow_reserved(alloc_size)
        self._record("segment_alloc", seg.base, alloc_size, stream)
        return _Block(seg.base, alloc_size, stream, pool, seg)

    def _release_available_cached_blocks(self, pool: _Pool, stream: int, size: int) -> bool:
        """Free oversize cached blocks (largest first) until the request's size is freed."""
        if self._max_split == NO_MAX_SPLIT or self._expandable:
            return False
        key_size = max(size, self._max_split)
        blocks = pool.blocks
        i = bisect_left(blocks, (stream, key_size))
        if i < len(blocks) and blocks[i][0] == stream:
            b = blocks[i][3]
            if b.is_split():
                return False
            self._release_block(b)
            return True
        released = 0
        i -= 1
        while i >= 0 and released < key_size:
            s, bsize, _, b = blocks[i]
            if s != stream or bsize < self._max_split:
                break
            if not b.is_split():
                released += bsize
                self._release_block(b)
            i -= 1
        return released >= key_size

    def _release_cached_blocks(self) -> bool:
        self._release_blocks(self._large)
        self._release_blocks(self._small)
        return True

    def _release_blocks(self, pool: _Pool) -> None:
        for b in pool.whole_in_order():          # unsplit, non-expandable cached blocks
            self._release_block(b)
        to_unmap = [b for _, _, _, b in pool.blocks if b.segment.expandable] if self._expandable else []
        for b in to_unmap:
            self._unmap_block(b)
            if not b.mapped and b.prev is None and b.next is None:   # the whole segment is unmapped
                pool.remove_unmapped(b)
                self._segments.discard(b.segment)
                self.num_segments -= 1

    def _release_block(self, b: _Block) -> None:
        """cudaFree of a whole cached segment."""
        b.pool.remove(b)
        self._segments.discard(b.segment)
        self.num_segments -= 1
        self.reserved_bytes -= b.size
        self._record("segment_free", b.addr, b.size, b.stream)

    def _garbage_collect_cached_blocks(self) -> None:
        """Free unsplit cached large blocks older than the average age until under the threshold."""
        gc_threshold = int(self.config.garbage_collection_threshold * self._allowed)
        if self.reserved_bytes <= gc_threshold:
            return
        target = self.reserved_bytes - gc_threshold
        pool = self._large
        ages = [pool.free_calls - b.gc_base for b in pool.whole]
        total_age, count = sum(ages), len(ages)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for b in pool.whole_in_order():
                age = pool.free_calls - b.gc_base
                if age >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(b)

    def _try_merge_blocks(self, dst: _Block, src: _Block | None, pool: _Pool) -> int:
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:          # [src dst]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:                        # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # ---- expandable segments ------------------------------------------------------------------

    def _try_allocate_expandable_block(self, pool: _Pool, stream: int, size: int) -> _Block | None:
        c = self._find_expandable_block(pool, stream, size)
        if not c.mapped and not self._map_block(c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next
            if not self._map_block(nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt                  # map_block merged the old candidate into nxt
        pool.remove(c)
        return c

    def _find_expandable_block(self, pool: _Pool, stream: int, size: int) -> _Block:
        """Lowest address where free + unmapped space of this stream's segment holds size."""
        unmapped = pool.unmapped
        i = bisect_left(unmapped, (stream,))
        while i < len(unmapped) and unmapped[i][0] == stream:
            c = unmapped[i][2]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room, b = 0, c
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return c
            i += 1
        page = K_SMALL_BUFFER if pool.is_small else K_LARGE_BUFFER
        space = UNBOUNDED_ADDRESS_SPACE
        seg = _Segment(self._take_addresses(space), space, stream, pool, expandable=True, page_bytes=page)
        self._segments.add(seg)
        self.num_segments += 1
        c = _Block(seg.base, space, stream, pool, seg, mapped=False)
        pool.insert_unmapped(c)
        return c

    def _map_block(self, to_map: _Block, size: int) -> bool:
        seg = to_map.segment
        page = seg.page_bytes
        offset = to_map.addr - seg.base                      # page aligned: unmapped ranges are
        mapped_size = -(-(offset + size) // page) * page - offset
        if self.capacity_bytes is not None and self.reserved_bytes + mapped_size > self.capacity_bytes:
            return False                                     # cuMemCreate: out of memory
        pool = to_map.pool
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped_size < to_map.size:
            rest = _Block(to_map.addr + mapped_size, to_map.size - mapped_size, to_map.stream, pool, seg, mapped=False)
            rest.prev, rest.next = to_map, to_map.next
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            pool.insert_unmapped(rest)
            to_map.size = mapped_size
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.insert(to_map)
        self._grow_reserved(mapped_size)
        self._record("segment_map", to_map.addr, mapped_size, to_map.stream)
        return True

    def _unmap_block(self, b: _Block) -> None:
        """Unmap the whole pages inside free block b; the partial pages at its ends stay mapped."""
        seg = b.segment
        page = seg.page_bytes
        begin = -(-(b.addr - seg.base) // page)
        end = (b.addr + b.size - seg.base) // page
        if begin >= end:
            return
        pool = b.pool
        pool.remove(b)
        start = seg.base + begin * page
        unmapped_size = (end - begin) * page
        before = start - b.addr
        after = b.size - before - unmapped_size
        if before > 0:
            nb = _Block(b.addr, before, b.stream, pool, seg)
            nb.prev, nb.next = b.prev, b
            if b.prev is not None:
                b.prev.next = nb
            b.prev = nb
            pool.insert(nb)
        if after > 0:
            na = _Block(start + unmapped_size, after, b.stream, pool, seg)
            na.prev, na.next = b, b.next
            if b.next is not None:
                b.next.prev = na
            b.next = na
            pool.insert(na)
        b.addr, b.size, b.mapped = start, unmapped_size, False
        self._try_merge_blocks(b, b.prev, pool)
        self._try_merge_blocks(b, b.next, pool)
        pool.insert_unmapped(b)
        self.reserved_bytes -= unmapped_size
        self._record("segment_unmap", start, unmapped_size, b.stream)

    # ---- bookkeeping --------------------------------------------------------------------------

    def _take_addresses(self, size: int) -> int:
        base = self._next_addr
        self._next_addr += -(-size // K_SMALL_BUFFER) * K_SMALL_BUFFER + K_SMALL_BUFFER  # gap: no accidental adjacency
        return base

    def _grow_reserved(self, size: int) -> None:
        self.reserved_bytes += size
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes

    def _record(self, action: str, addr: int, size: int, stream: int) -> None:
        if self.record_events:
            self.events.append(TraceEntry(action, addr, size, stream))

    def _clone(self, capacity_bytes: int | None) -> "CachingAllocator":
        """A deep copy of the state with another capacity (min_capacity_bytes resumes from it).
        Iterative: segments may hold thousands of linked blocks, too deep for copy.deepcopy."""
        new = object.__new__(CachingAllocator)
        new.__dict__.update(self.__dict__)
        new.capacity_bytes = capacity_bytes
        new.events = list(self.events)
        new._small, new._large = _Pool(True), _Pool(False)
        pools = {id(self._small): new._small, id(self._large): new._large}
        segs = {id(sg): _Segment(sg.base, sg.size, sg.stream, pools[id(sg.pool)], sg.expandable, sg.page_bytes)
                for sg in self._segments}
        new._segments = set(segs.values())
        old_blocks = list(self._live.values())
        for p in (self._small, self._large):
            old_blocks += [e[3] for e in p.blocks] + [e[2] for e in p.unmapped]
        copies: dict[int, _Block] = {}
        for b in old_blocks:
            c = _Block(b.addr, b.size, b.stream, pools[id(b.pool)], segs[id(b.segment)], b.mapped)
            c.allocated, c.requested, c.gc_base = b.allocated, b.requested, b.gc_base
            copies[id(b)] = c
        for b in old_blocks:
            c = copies[id(b)]
            c.prev = copies[id(b.prev)] if b.prev is not None else None
            c.next = copies[id(b.next)] if b.next is not None else None
        for old, p in ((self._small, new._small), (self._large, new._large)):
            p.free_calls = old.free_calls
            p.blocks = [(s, z, a, copies[id(b)]) for s, z, a, b in old.blocks]
            p.unmapped = [(s, a, copies[id(b)]) for s, a, b in old.unmapped]
            p.whole = {copies[id(b)] for b in old.whole}
        new._live = {k: copies[id(b)] for k, b in self._live.items()}
        new._zero_size = set(self._zero_size)
        return new

    def check_invariants(self) -> None:
        """allocated + free-in-segments == reserved; a segment's blocks tile it exactly, linked in
        address order; no two free neighbours (same mapping state) left unmerged; pools consistent."""
        by_seg: dict[_Segment, list[_Block]] = {s: [] for s in self._segments}
        live = list(self._live.values())
        for b in live:
            assert b.allocated and b.mapped, f"live block at {b.addr:#x} not allocated+mapped"
        free_total = 0
        for pool in (self._small, self._large):
            keys = [e[:3] for e in pool.blocks]
            assert keys == sorted(keys), "pool not ordered by (stream, size, address)"
            for s, size, addr, b in pool.blocks:
                assert (s, size, addr) == (b.stream, b.size, b.addr), f"stale pool key for block at {addr:#x}"
                assert not b.allocated and b.mapped and b.pool is pool, f"bad free block at {addr:#x}"
                free_total += b.size
            expected_whole = {e[3] for e in pool.blocks if not e[3].is_split() and not e[3].segment.expandable}
            assert pool.whole == expected_whole, "whole-segment index out of step with the pool"
            for s, addr, b in pool.unmapped:
                assert (s, addr) == (b.stream, b.addr) and not b.mapped and not b.allocated
        all_blocks = live + [e[3] for p in (self._small, self._large) for e in p.blocks] + \
            [e[2] for p in (self._small, self._large) for e in p.unmapped]
        assert len({id(b) for b in all_blocks}) == len(all_blocks), "a block is in two places"
        for b in all_blocks:
            assert b.segment in by_seg, f"block at {b.addr:#x} belongs to a released segment"
            by_seg[b.segment].append(b)
        mapped_total = 0
        for seg, blocks in by_seg.items():
            blocks.sort(key=lambda b: b.addr)
            assert blocks, f"segment at {seg.base:#x} has no blocks"
            pos = seg.base
            for j, b in enumerate(blocks):
                assert b.addr == pos, f"segment {seg.base:#x}: gap or overlap at {pos:#x} (block at {b.addr:#x})"
                assert b.size > 0, f"empty block at {b.addr:#x}"
                assert b.stream == seg.stream and b.pool is seg.pool, f"block at {b.addr:#x} crossed stream/pool"
                assert b.prev is (blocks[j - 1] if j else None), f"prev link broken at {b.addr:#x}"
                assert b.next is (blocks[j + 1] if j + 1 < len(blocks) else None), f"next link broken at {b.addr:#x}"
                if j and not b.allocated and not blocks[j - 1].allocated and b.mapped == blocks[j - 1].mapped:
                    raise AssertionError(f"unmerged free neighbours at {blocks[j - 1].addr:#x} and {b.addr:#x}")
                if b.mapped:
                    mapped_total += b.size
                pos += b.size
            assert pos == seg.base + seg.size, f"segment {seg.base:#x}: blocks end at {pos:#x}, not {seg.base + seg.size:#x}"
        assert len(by_seg) == self.num_segments, f"{len(by_seg)} segments, counter says {self.num_segments}"
        alloc_total = sum(b.size for b in live)
        assert alloc_total == self.allocated_bytes, f"allocated {self.allocated_bytes} != blocks {alloc_total}"
        assert mapped_total == self.reserved_bytes, f"reserved {self.reserved_bytes} != mapped {mapped_total}"
        assert alloc_total + free_total == self.reserved_bytes, \
            f"allocated {alloc_total} + free {free_total} != reserved {self.reserved_bytes}"
        if self.capacity_bytes is not None:
            assert self.reserved_bytes <= self.capacity_bytes, "reserved beyond capacity"


def _expandable_size(b: _Block) -> int:
    n = b.next
    return b.size + (n.size if n is not None and not n.mapped else 0)


# --- Replay ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OomPoint:
    event_index: int
    requested_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    capacity_bytes: int | None


@dataclass(frozen=True)
class ReplayResult:
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    final_reserved_bytes: int
    reserved_minus_allocated_at_peak_bytes: int   # fragmentation + cache when reserved first peaked
    num_segments: int                             # segments held at the end (or at the OOM)
    num_alloc_retries: int                        # cache flushes (release_cached_blocks + retry)
    oom: OomPoint | None


EMPTY_CACHE_OP = -(1 << 62)   # an op's block: torch.cuda.empty_cache() (trace.EMPTY_CACHE)


def _compile(events: Iterable[AllocEvent]) -> list[tuple[bool, int, int, int]]:
    ops = []
    for e in events:
        if e.action == "alloc":
            ops.append((True, e.block, e.size_bytes, e.stream))   # (an empty_cache marker: size 0, no block)
            if e.module == EMPTY_CACHE:
                ops.append((False, EMPTY_CACHE_OP, 0, 0))
        elif e.action == "free":
            ops.append((False, e.block, 0, 0))
        else:
            raise ValueError(f"unknown trace action {e.action!r} (expected 'alloc' or 'free')")
    return ops


def _run(a: CachingAllocator, ops: Sequence[tuple[bool, int, int, int]], start: int,
         check: bool) -> tuple[OomPoint | None, int, int]:
    """Apply ops[start:] to a; returns (oom, reserved at its first peak, reserved - allocated then)."""
    malloc, free = a.malloc, a.free
    best_reserved = -1
    frag_at_peak = 0
    for i in range(start, len(ops)):
        is_alloc, block, size, stream = ops[i]
        if is_alloc:
            try:
                malloc(block, size, stream)
            except OutOfMemory as exc:
                return (OomPoint(i, exc.requested_bytes, exc.allocated_bytes, exc.reserved_bytes, a.capacity_bytes),
                        best_reserved, frag_at_peak)
            if a.reserved_bytes > best_reserved:
                best_reserved = a.reserved_bytes
                frag_at_peak = best_reserved - a.allocated_bytes
        elif block == EMPTY_CACHE_OP:
            a.empty_cache()
        else:
            free(block)
        if check:
            a.check_invariants()
    return None, best_reserved, frag_at_peak


def _replay_ops(ops: Sequence[tuple[bool, int, int, int]], config: AllocatorConfig,
                capacity_bytes: int | None, check: bool) -> ReplayResult:
    a = CachingAllocator(config, capacity_bytes)
    oom, _, frag_at_peak = _run(a, ops, 0, check)
    return result_of(a, oom, frag_at_peak)


def result_of(a: CachingAllocator, oom: OomPoint | None, frag_at_peak: int) -> ReplayResult:
    """The ReplayResult of an allocator that has run a trace (_run's oom and fragmentation at the peak)."""
    return ReplayResult(
        peak_allocated_bytes=a.peak_allocated_bytes,
        peak_reserved_bytes=a.peak_reserved_bytes,
        final_reserved_bytes=a.reserved_bytes,
        reserved_minus_allocated_at_peak_bytes=frag_at_peak,
        num_segments=a.num_segments,
        num_alloc_retries=a.num_alloc_retries,
        oom=oom,
    )


def _prefix_state(ops: Sequence[tuple[bool, int, int, int]], config: AllocatorConfig,
                  below_bytes: int) -> tuple[CachingAllocator, int]:
    """Uncapped state just before the first alloc that could take reserved above below_bytes.
    Without a memory fraction, any capacity > below_bytes replays identically up to there (every
    segment so far fit under below_bytes), so a capped run can resume from a copy of this state."""
    a = CachingAllocator(config, None)
    page = K_LARGE_BUFFER if config.expandable_segments else 0
    for i, (is_alloc, block, size, stream) in enumerate(ops):
        if is_alloc:
            growth = get_allocation_size(round_size(size, config)) + page if size else 0   # most one malloc adds
            if a.reserved_bytes + growth > below_bytes:
                return a, i
            a.malloc(block, size, stream)
        elif block == EMPTY_CACHE_OP:
            a.empty_cache()
        else:
            a.free(block)
    return a, len(ops)


def replay(events: Iterable[AllocEvent], config: AllocatorConfig = AllocatorConfig(),
           capacity_bytes: int | None = None, check: bool = False) -> ReplayResult:
    """Replay a trace. Never raises on OOM: the replay stops there and reports it in ``.oom``.
    ``check=True`` runs check_invariants after every event (slow; for tests)."""
    return _replay_ops(_compile(events), config, capacity_bytes, check)


def _live_need(ops: Sequence[tuple[bool, int, int, int]], config: AllocatorConfig) -> int:
    live = need = 0
    sizes: dict[int, int] = {}
    for is_alloc, block, size, _ in ops:
        if is_alloc:
            sizes[block] = round_size(size, config) if size else 0
            live += sizes[block]
            need = max(need, live)
        else:
            live -= sizes.pop(block, 0)
    return need


def live_need_bytes(events: Iterable[AllocEvent], config: AllocatorConfig = AllocatorConfig()) -> int:
    """The peak of the live blocks' rounded requests: no capacity below it runs ``events`` (every
    block handed out is at least its rounded request), so min_capacity_bytes is never below it."""
    return _live_need(_compile(events), config)


def min_capacity_bytes(events: Sequence[AllocEvent], config: AllocatorConfig = AllocatorConfig(),
                       granularity_bytes: int = 2 * MiB) -> int:
    """Smallest capacity (a multiple of granularity_bytes) at which the replay has no OOM.

    Bisection between a capacity known to fail and one known to pass:
    - fails: the largest multiple of the granularity below the peak of live *rounded request* bytes
      (every block handed out is at least its rounded request, and allocated <= reserved <= capacity);
    - passes: the uncapped peak reserved, rounded up (the cap is never reached, so the run is the
      uncapped one); checked, and doubled while it fails (only a memory fraction can make it fail).
    Success is not monotone in capacity in general (a cap changes when the cache is flushed and so the
    layout after it), so the answer is a capacity verified to pass whose next smaller multiple was
    verified to fail (or is below the rounded live peak), not a proof that no smaller one passes.
    """
    g = granularity_bytes
    config_ops = _compile(events)
    need = _live_need(config_ops, config)
    if need == 0:
        return 0
    free_run = _replay_ops(config_ops, config, None, False)
    lo = -(-need // g) * g - g                                   # < need: fails
    hi = max(-(-free_run.peak_reserved_bytes // g) * g, lo + g)
    ops = config_ops
    if config.per_process_memory_fraction is not None:
        # allowed = fraction x capacity moves with the capacity (and arms GC): replay from the start
        def passes(capacity: int) -> bool:
            return _replay_ops(ops, config, capacity, False).oom is None
        for _ in range(64):
            if passes(hi):
                break
            lo, hi = hi, 2 * hi
    else:
        prefix, start = _prefix_state(ops, config, lo)

        def passes(capacity: int) -> bool:
            return _run(prefix._clone(capacity), ops, start, False)[0] is None
    while hi - lo > g:
        mid = lo + (hi - lo) // g // 2 * g
        if passes(mid):
            hi = mid
        else:
            lo = mid
    return hi
