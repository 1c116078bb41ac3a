"""Pairing a GPU run's allocations with the CPU trace (allocdiff.py), checked on hand-made inputs in
torch's snapshot format and on a real CPU trace with allocations the trace lacks added to it."""

import pytest
import torch

from vest_slurm.gpu.allocdiff import aggregate, allocations_from_snapshot, diff_allocations, expand, RealAlloc
from vest_slurm.estimate.tracing import trace_training
from vest_slurm.estimate.workload import parse_workload_args

CONV = {"filename": "/usr/lib/python3/site-packages/torch/nn/modules/conv.py", "line": 548, "name": "_conv_forward"}
USER = {"filename": "/home/u/train.py", "line": 42, "name": "step"}
INNER = {"filename": "/usr/lib/python3/site-packages/torch/_tensor.py", "line": 10, "name": "backward"}


def snapshot(*entries):
    return {"segments": [], "device_traces": [list(entries)]}


def test_snapshot_allocations_keep_order_and_name_the_caller():
    s = snapshot(
        {"action": "segment_alloc", "addr": 0, "size": 2 << 20, "stream": 0, "frames": []},
        {"action": "alloc", "addr": 0, "size": 1000, "stream": 0, "frames": [CONV, USER]},
        {"action": "alloc", "addr": 1024, "size": 300, "stream": 0, "frames": [INNER, USER]},
        {"action": "free_requested", "addr": 0, "size": 1000, "stream": 0, "frames": []},
        {"action": "free_completed", "addr": 0, "size": 1000, "stream": 0, "frames": []},
        {"action": "alloc", "addr": 2048, "size": 4096, "stream": 0, "frames": [CONV]},
        {"action": "alloc", "addr": 8192, "size": 64, "stream": 0, "frames": []},
    )
    got = allocations_from_snapshot(s)
    # user code wins over torch's frames; torch.nn names the layer when there is no user frame;
    # an allocation made from C++ (autograd's thread) has no Python frame
    assert got == [RealAlloc(1000, "/home/u/train.py:42 step"), RealAlloc(300, "/home/u/train.py:42 step"),
                   RealAlloc(4096, "/usr/lib/python3/site-packages/torch/nn/modules/conv.py:548 _conv_forward"),
                   RealAlloc(64, "")]
    assert allocations_from_snapshot(s, device=3) == []


def test_diff_rounds_like_the_allocator_and_reports_both_sides():
    real = [RealAlloc(1000, "a"), RealAlloc(1000, "a"), RealAlloc(3 << 20, "conv"), RealAlloc(3 << 20, "conv"),
            RealAlloc(100, "b")]
    traced = [1024, 1000, 512, 5 << 20]
    d = diff_allocations(real, traced)
    # 1000 and 1024 both round to 1024: two real, two traced, paired. 100 and 512 both round to 512.
    assert d.real_count == 5 and d.traced_count == 4
    assert d.unmatched_real == ((3 << 20, 2, "conv"),)
    assert d.unmatched_traced == ((5 << 20, 1),)
    assert d.unmatched_real_bytes == 6 << 20 and d.unmatched_traced_bytes == 5 << 20
    assert d.to_dict()["unmatched_real_mib"] == 6.0


def test_aggregate_round_trips():
    real = [RealAlloc(1000, "a"), RealAlloc(1024, "a"), RealAlloc(7, "")]
    rows = aggregate(real)
    assert rows == [[512, "", 1], [1024, "a", 2]]
    assert sorted((a.size, a.where) for a in expand(rows)) == [(512, ""), (1024, "a"), (1024, "a")]


def test_a_real_trace_against_itself_plus_workspaces_leaves_only_the_workspaces():
    spec = parse_workload_args(["--model", "torchvision:resnet18", "--batch-size", "2", "--input", "3x32x32",
                                "--optimizer", "sgd"])
    trace = trace_training(spec)
    sizes = [e.size_bytes for e in trace.events if e.action == "alloc" and e.size_bytes > 0]
    ws = 7 * 2**20 + 3   # a size no tensor of this run has
    real = [RealAlloc(s, "") for s in sizes] + [RealAlloc(ws, "conv.py:548 _conv_forward")] * 5
    d = diff_allocations(real, sizes)
    assert d.unmatched_traced == ()
    assert d.unmatched_real == ((7 * 2**20 + 512, 5, "conv.py:548 _conv_forward"),)
