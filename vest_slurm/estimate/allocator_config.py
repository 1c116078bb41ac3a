"""PYTORCH_CUDA_ALLOC_CONF, parsed into one frozen AllocatorConfig.

Mirrors the option parser of PyTorch's caching allocator: the torch 2.9 generation,
``c10/core/AllocatorConfig.cpp`` (``AcceleratorAllocatorConfig::parseArgs`` and friends), which took
over the device-independent options from ``c10/cuda/CUDAAllocatorConfig.cpp`` (read at the 2.8-era
version that still parsed them itself; both agree on everything below except the two notes).

Grammar (the C++ lexer): the text is split into tokens at ``,`` ``:`` ``[`` ``]``; spaces are dropped.
``key:value`` pairs are separated by ``,``.  Options that change what the allocator does:

- ``max_split_size_mb:N``      blocks of N MiB or more are never split (N >= 20, torch 2.9; 2.8 wanted > 20)
- ``max_non_split_rounding_mb:N``  an oversize cached block serves a request up to N MiB smaller (default 20)
- ``roundup_power2_divisions:D`` or ``[256:1,512:2,>:4]``  round request sizes up to one of D steps
  between powers of two; the list form sets D per power-of-two size interval (keys in MiB)
- ``expandable_segments:True|False``
- ``garbage_collection_threshold:F``  0 < F < 1
- ``backend:native`` (``cudaMallocAsync`` is a different allocator, not modelled: refused)

Options that only touch pinned host memory or locking are accepted and ignored (PINNED_OR_LOCK_KEYS).

Note 1: in the list form, ``>:D`` fills the intervals after the last listed one (torch 2.9). Torch 2.8
and earlier filled from the last listed interval itself, overwriting its value.
Note 2: ``per_process_memory_fraction`` is not read from the text: it is what
``torch.cuda.set_per_process_memory_fraction`` sets, and it is what arms garbage collection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import WorkloadError
from ..units import MiB

# 16 power-of-two size intervals for roundup_power2_divisions: [1 MiB, 2 MiB), ..., [32 GiB, 64 GiB) and
# above. Interval i holds sizes with floor(log2(size)) == 20 + i; sizes under 1 MiB use interval 0,
# sizes of 32 GiB and more the last one. Source: kRoundUpPowerOfTwoIntervals, kRoundUpPowerOfTwoStart.
ROUNDUP_INTERVALS = 16
ROUNDUP_FIRST_LOG2 = 20
# Smallest max_split_size_mb / max_non_split_rounding_mb accepted: kLargeBuffer / 1 MiB.
MIN_SPLIT_SIZE_MB = 20
DEFAULT_NON_SPLIT_ROUNDING_BYTES = 20 * MiB  # kLargeBuffer, the default of max_non_split_rounding_mb

ALLOCATOR_KEYS = (
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "roundup_power2_divisions",
    "expandable_segments",
    "garbage_collection_threshold",
    "backend",
)
PINNED_OR_LOCK_KEYS = (
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
)
VALID_KEYS = ALLOCATOR_KEYS + PINNED_OR_LOCK_KEYS


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator's knobs. Sizes in bytes; ``None`` means the option is off (PyTorch's default)."""

    max_split_size_bytes: int | None = None
    # One division count per size interval (ROUNDUP_INTERVALS of them); 0 or 1 means plain 512 B
    # rounding. An int is accepted and applied to every interval, like ``roundup_power2_divisions:4``.
    roundup_power2_divisions: tuple[int, ...] | int = (0,) * ROUNDUP_INTERVALS
    expandable_segments: bool = False
    garbage_collection_threshold: float | None = None
    max_non_split_rounding_bytes: int = DEFAULT_NON_SPLIT_ROUNDING_BYTES
    # torch.cuda.set_per_process_memory_fraction(f): the allocator may reserve f x capacity and runs
    # garbage collection against that amount. Not part of PYTORCH_CUDA_ALLOC_CONF.
    per_process_memory_fraction: float | None = None
    text: str = field(default="", compare=False)  # the text it was parsed from, for reports

    def __post_init__(self) -> None:
        div = self.roundup_power2_divisions
        if isinstance(div, int):
            div = (div,) * ROUNDUP_INTERVALS
        div = tuple(int(d) for d in div)
        if len(div) != ROUNDUP_INTERVALS:
            raise ValueError(f"roundup_power2_divisions needs {ROUNDUP_INTERVALS} intervals, got {len(div)}")
        if any(d != 0 and not _is_pow2(d) for d in div):
            raise ValueError(f"roundup_power2_divisions must be 0 or powers of 2, got {div}")
        object.__setattr__(self, "roundup_power2_divisions", div)
        if self.max_split_size_bytes is not None and self.max_split_size_bytes <= 0:
            raise ValueError("max_split_size_bytes must be positive")
        t = self.garbage_collection_threshold
        if t is not None and not 0.0 < t < 1.0:
            raise ValueError("garbage_collection_threshold must be in (0, 1)")
        f = self.per_process_memory_fraction
        if f is not None and not 0.0 < f <= 1.0:
            raise ValueError("per_process_memory_fraction must be in (0, 1]")

    def divisions_for(self, size_bytes: int) -> int:
        """CUDAAllocatorConfig::roundup_power2_divisions(size): the division count of size's interval."""
        index = size_bytes.bit_length() - 1 - ROUNDUP_FIRST_LOG2
        index = min(max(index, 0), ROUNDUP_INTERVALS - 1)
        return self.roundup_power2_divisions[index]


def _fail(what: str, fix: str) -> WorkloadError:
    return WorkloadError(f"PYTORCH_CUDA_ALLOC_CONF: {what}", fix)


def _lex(text: str) -> list[str]:
    tokens: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif ch != " ":
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


class _Tokens:
    def __init__(self, text: str):
        self.toks = _lex(text)

    def at(self, i: int, key: str) -> str:
        if i >= len(self.toks):
            raise _fail(f"missing value for {key!r}", f"write {key}:<value>")
        return self.toks[i]

    def expect(self, i: int, ch: str, key: str) -> None:
        if self.at(i, key) != ch:
            raise _fail(f"expected {ch!r} after {key!r}, found {self.toks[i]!r}", f"write {key}:<value>")

    def int_at(self, i: int, key: str) -> int:
        tok = self.at(i, key)
        try:
            return int(tok)
        except ValueError:
            raise _fail(f"{key} wants a whole number, got {tok!r}", f"for example {key}:4") from None

    def bool_at(self, i: int, key: str) -> bool:
        tok = self.at(i, key)
        if tok not in ("True", "False"):
            raise _fail(f"{key} wants True or False, got {tok!r}", f"write {key}:True or {key}:False")
        return tok == "True"


def _parse_divisions(t: _Tokens, i: int, key: str) -> tuple[int, tuple[int, ...]]:
    """roundup_power2_divisions value starting at token i; returns (last token index, 16 divisions)."""
    div = [0] * ROUNDUP_INTERVALS
    pow2_fix = "divisions and interval sizes are powers of 2, e.g. roundup_power2_divisions:[256:1,512:2,>:4]"
    if t.at(i, key) != "[":
        value = t.int_at(i, key)
        if not _is_pow2(value):
            raise _fail(f"roundup_power2_divisions must be a power of 2, got {value}", pow2_fix)
        return i, tuple([value] * ROUNDUP_INTERVALS)
    first = True
    last_index = 0
    while True:
        i += 1
        tok = t.at(i, key)
        if tok == "]":
            return i, tuple(div)
        bound_tok = tok
        t.expect(i + 1, ":", key)
        value = t.int_at(i + 2, key)
        i += 2
        if value != 0 and not _is_pow2(value):
            raise _fail(f"roundup_power2_divisions: division {value} is not a power of 2 or 0", pow2_fix)
        if bound_tok == ">":
            for j in range(last_index + 1, ROUNDUP_INTERVALS):
                div[j] = value
        else:
            try:
                bound_mb = int(bound_tok)
            except ValueError:
                raise _fail(f"roundup_power2_divisions: interval {bound_tok!r} is not a number", pow2_fix) from None
            if not _is_pow2(bound_mb):
                raise _fail(f"roundup_power2_divisions: interval {bound_mb} MiB is not a power of 2", pow2_fix)
            index = min(bound_mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                for j in range(index):
                    div[j] = value
                first = False
            div[index] = value
            last_index = index
        nxt = t.at(i + 1, key)
        if nxt != "]":
            t.expect(i + 1, ",", key)
            i += 1


def parse_alloc_conf(text: str) -> AllocatorConfig:
    """Parse PYTORCH_CUDA_ALLOC_CONF text. Raises WorkloadError naming the bad key or value."""
    t = _Tokens(text or "")
    opts: dict = {}
    i = 0
    n = len(t.toks)
    while i < n:
        key = t.toks[i]
        if key not in VALID_KEYS:
            raise _fail(f"unknown option {key!r}", "valid options: " + ", ".join(VALID_KEYS))
        t.expect(i + 1, ":", key)
        i += 2
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            mb = t.int_at(i, key)
            if mb < MIN_SPLIT_SIZE_MB:
                raise _fail(f"{key} too small: {mb}, must be >= {MIN_SPLIT_SIZE_MB}", f"use {key}:{MIN_SPLIT_SIZE_MB} or more")
            opts["max_split_size_bytes" if key == "max_split_size_mb" else "max_non_split_rounding_bytes"] = mb * MiB
        elif key == "garbage_collection_threshold":
            tok = t.at(i, key)
            try:
                val = float(tok)
            except ValueError:
                raise _fail(f"garbage_collection_threshold wants a number, got {tok!r}", "use a value in (0.0, 1.0), e.g. 0.8") from None
            if not 0.0 < val < 1.0:
                raise _fail(f"garbage_collection_threshold {val} is outside (0.0, 1.0)", "use a value in (0.0, 1.0), e.g. 0.8")
            opts["garbage_collection_threshold"] = val
        elif key == "roundup_power2_divisions":
            i, opts["roundup_power2_divisions"] = _parse_divisions(t, i, key)
        elif key == "expandable_segments":
            opts["expandable_segments"] = t.bool_at(i, key)
        elif key == "backend":
            tok = t.at(i, key)
            if tok == "cudaMallocAsync":
                raise _fail("backend:cudaMallocAsync is CUDA's own allocator, which vest-slurm does not model",
                            "estimate with backend:native (the default) or drop the backend option")
            if tok != "native":
                raise _fail(f"unknown backend {tok!r}", "valid backends: native, cudaMallocAsync")
        else:  # pinned-memory / locking options: no effect on device memory; check the shape only
            t.at(i, key)
        if i + 1 < n:
            t.expect(i + 1, ",", key)
            i += 1
        i += 1
    return AllocatorConfig(text=text or "", **opts)
