"""Tools for a machine with a GPU: measure real runs, calibrate a site's floor, compare allocations.

- ``measure``: run a workload for real and record what the device and the caching allocator held.
- ``calibrate``: ``vest calibrate``, the floor (CUDA context, loaded kernels) of a GPU type.
- ``allocdiff``: a real memory snapshot against the traced allocations, allocation by allocation.
"""
