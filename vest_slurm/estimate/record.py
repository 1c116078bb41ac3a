"""MemoryEstimate: the per-GPU-type answer that placement, vsbatch, vest check and the bridge read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryEstimate:
    """A job's GPU memory on one GPU type (per GPU, for multi-GPU jobs).

    ``required_bytes``: the smallest device capacity at which the job runs (the allocator's
    flush-and-retry applied). Shown beside the peak.
    ``peak_bytes``: what nvidia-smi would show at the peak on this GPU type. Placement applies
    the site's headroom to it (placement.estimate_need); comparisons with measured runs use it.
    ``breakdown``: named parts (context, allocator reserved, workspaces, ...) in bytes.
    ``floor``: where the CUDA-context floor came from: "calibrated" (the site measured this GPU
    type) or "default" (profiles.py's bound for a type no site calibrated); "" for records from
    before it was kept (an attached estimate of an older vsbatch).
    ``placement_bytes``: where the cuDNN that answered is not the job's, the peak with every
    convolution's workspace at the largest over the engines cuDNN may pick; placement uses it
    (placement.estimate_need), ``peak_bytes`` stays the first plan's. 0 where not needed.
    """

    gpu: str
    capacity_bytes: int
    required_bytes: int
    peak_bytes: int
    breakdown: tuple[tuple[str, int], ...] = ()
    floor: str = ""
    placement_bytes: int = 0

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.capacity_bytes

    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.required_bytes
