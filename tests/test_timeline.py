"""`vest estimate --timeline/--snapshot`: the picture, and a snapshot PyTorch's own memory_viz
tools read (its accounting check included), made from a real trace and replay."""

from __future__ import annotations

import pickle
import subprocess
import sys

import torch  # noqa: F401  (the estimate traces with real torch)

from vest_slurm.cli import run
from vest_slurm.estimate import estimator, timeline
from vest_slurm.estimate.profiles import get_profile
from vest_slurm.estimate.workload import parse_workload_args

ARGS = ["--model", "torchvision:resnet18", "--batch-size", "4", "--optimizer", "adam"]


def test_the_recording_is_the_estimates_replay():
    spec = parse_workload_args(ARGS)
    p = get_profile("a100-40gb")
    summary = estimator.trace_for(spec, p)
    events, config = estimator.replayed_events(summary, spec, p)
    rec = timeline.record(events, config, "a100", summary.trace.step_ends)
    parts = dict(estimator.estimate_from_trace(summary, spec, p).breakdown)
    assert max(rec.allocated) == parts["allocator_peak_allocated"]
    assert max(rec.reserved) == parts["allocator_peak_reserved"]
    # the stacked groups add up to what the allocator holds allocated, at every event
    assert all(sum(g[i] for g in rec.groups) == rec.allocated[i] for i in range(0, len(rec.allocated), 97))
    assert rec.peak_event.action == "alloc" and rec.peak_event.op


def test_cli_writes_the_picture_and_a_snapshot_torchs_viewer_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("VEST_CACHE_DIR", "off")
    png, snap = tmp_path / "t.png", tmp_path / "s.pickle"
    rc = run(["estimate", *ARGS, "--gpu", "v100-16gb", "--gpu", "h100-80gb", "--timeline", str(png),
              "--snapshot", str(snap)])
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = pickle.loads(snap.read_bytes())
    assert data["vest_devices"] == ["v100-16gb", "h100-80gb"] and len(data["device_traces"]) == 2
    allocs = [e for e in data["device_traces"][0] if e["action"] == "alloc"]
    assert {"segment_alloc", "alloc", "free_completed"} <= {e["action"] for e in data["device_traces"][0]}
    # frames name the module (resnet18's own) and the op
    assert any(e["frames"][0]["filename"] == "layer1.0.conv1" and "convolution" in e["frames"][0]["name"]
               for e in allocs)
    # torch's own tools: stats checks allocated + free == reserved per segment and in all
    for cmd in (["stats", str(snap)], ["trace", str(snap)],
                ["trace_plot", str(snap), "-d", "1", "-o", str(tmp_path / "t.html")],
                ["segment_plot", str(snap), "-d", "0", "-o", str(tmp_path / "s.html")]):
        r = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", *cmd], capture_output=True, text=True)
        assert r.returncode == 0, (cmd, r.stderr[-2000:])
        if cmd[0] == "stats":
            assert "total_reserved" in r.stdout
    assert (tmp_path / "t.html").stat().st_size > 10_000 and (tmp_path / "s.html").stat().st_size > 10_000
