"""MemoryEstimate: the per-GPU-type answer that placement, vsbatch, vest check and the bridge read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, eq=False)
class MemoryEstimate:
    """A job's GPU memory on one GPU type (per GPU, for multi-GPU jobs).

    ``required_bytes``: the smallest device capacity at which the job runs (the allocator's
    flush-and-retry applied). Shown beside the peak. The estimator gives it as ``required``, a
    zero-argument callable searched on first use where nothing it decides needs it (a capacity
    search replays the run ~15 times; the advice's many estimates rarely read it), else an int.
    ``peak_bytes``: what nvidia-smi would show at the peak on this GPU type. Placement applies
    the site's headroom to it (placement.estimate_need); comparisons with measured runs use it.
    ``breakdown``: named parts (context, allocator reserved, workspaces, ...) in bytes; those that
    live outside the allocator come first, up to "parameters". ``parts()`` adds the allocator's
    need ("allocator_required") where the estimator made the estimate.
    ``floor``: where the CUDA-context floor came from: "calibrated" (the site measured this GPU
    type) or "default" (profiles.py's bound for a type no site calibrated); "" for records from
    before it was kept (an attached estimate of an older vsbatch).
    ``placement_bytes``: where the cuDNN that answered is not the job's, the peak with every
    convolution's workspace at the largest over the engines cuDNN may pick; placement uses it
    (placement.estimate_need), ``peak_bytes`` stays the first plan's. 0 where not needed.
    """

    gpu: str
    capacity_bytes: int
    required: int | Callable[[], int]
    peak_bytes: int
    breakdown: tuple[tuple[str, int], ...] = ()
    floor: str = ""
    placement_bytes: int = 0

    @property
    def required_bytes(self) -> int:
        if callable(self.required):
            object.__setattr__(self, "required", int(self.required()))
        return self.required

    def parts(self) -> tuple[tuple[str, int], ...]:
        """``breakdown`` with the allocator's need after its peak reserved (required less what
        lives outside the allocator), where the breakdown has one."""
        names = [k for k, _ in self.breakdown]
        if "allocator_peak_reserved" not in names or "parameters" not in names:
            return self.breakdown
        outside = sum(v for _, v in self.breakdown[:names.index("parameters")])
        at = names.index("allocator_peak_reserved") + 1
        return self.breakdown[:at] + (("allocator_required", self.required_bytes - outside),) + self.breakdown[at:]

    def _key(self) -> tuple:
        return (self.gpu, self.capacity_bytes, self.required_bytes, self.peak_bytes, self.breakdown, self.floor,
                self.placement_bytes)

    def __eq__(self, other) -> bool:
        return isinstance(other, MemoryEstimate) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.capacity_bytes

    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.required_bytes
