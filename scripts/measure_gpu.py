#!/usr/bin/env python3
"""Run workloads on a real GPU and compare the allocator replay with what PyTorch and NVML report.

    python scripts/measure_gpu.py --out benchmarks/gpu-measurements.csv [--gpu-profile h200-141gb] \
        [--workload "--model torchvision:resnet50 --batch-size 64" ...]

For each workload (the same options as `vest estimate`): runs the estimator's training loop on the
GPU (vest_slurm/estimate/tracing.py run_training_loop, real tensors), records torch.cuda.max_memory_allocated,
max_memory_reserved, the device's used memory from NVML (a polling thread) and the CUDA context
measured before the model; then estimates the same workload on the CPU and prints both side by
side. `--device cpu` runs the loop on the CPU (no CUDA figures): the check where there is no GPU.
Each workload runs in its own process so that one's cache does not feed the next.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys

from tabulate import tabulate

# 8 steps: the estimate replays the run until the allocator settles (vest_slurm/estimate/steady.py), so the
# GPU run, whose max_memory_reserved is compared with it, runs long enough to settle too; the CPU
# trace of the allocation diff runs the same 8.
DEFAULT_WORKLOADS = [w + " --steps 8" for w in (
    "--model torchvision:resnet50 --batch-size 64 --optimizer sgd",
    "--model torchvision:resnet50 --batch-size 128 --optimizer adam --precision amp-bf16",
    "--model torchvision:vgg16 --batch-size 64 --optimizer adam",
    "--model timm:convnext_tiny --batch-size 64 --optimizer adamw --precision amp-fp16",
    "--model hf:bert-base --input seq512 --batch-size 16 --optimizer adamw",
    "--model hf:gpt2 --input seq1024 --batch-size 8 --optimizer adamw --precision amp-bf16",
    # cuDNN benchmark mode's timing workspace (fp32 3x3 NCHW: the largest plan takes about 3x the
    # first plan's): its measured peak against the same vgg16 run above without it
    "--model torchvision:vgg16 --batch-size 64 --optimizer adam --cudnn-benchmark on",
    # the two families the estimate falls short on by a few % per sample (benchmarks/README.md), as the
    # ground-truth rows describe them: the allocation diff shows what the GPU run holds beyond the trace
    "--model hf:WhisperForAudioClassification --batch-size 64 --input tensor:80x3000 --loss model "
    "--precision amp-fp16 --model-args '{\"d_model\": 384, \"encoder_attention_heads\": 6, "
    "\"encoder_ffn_dim\": 1536, \"encoder_layers\": 4, \"decoder_attention_heads\": 6, "
    "\"decoder_ffn_dim\": 1536, \"decoder_layers\": 4}'",
    "--model hf:t5-small --batch-size 8 --input seq1024 --loss model --precision amp-fp16 "
    "--model-args '{\"attn_implementation\": \"eager\"}'",
    # the largest groups of rows the estimate puts a little below the measurement: milabench's fp32
    # convnext_large (TF32 off) and Lightning's resnet152 in bf16 (zero_grad before backward)
    "--model torchvision:convnext_large --batch-size 64 --optimizer sgd --cudnn-tf32 off",
    "--model torchvision:resnet152 --batch-size 256 --optimizer adam --precision amp-bf16 "
    "--zero-grad before-backward",
    # activation checkpointing through the model's switch (the recompute in backward) and an
    # optimizer with other state than Adam's
    "--model hf:llama-3.2-1b --input seq1024 --batch-size 4 --optimizer adamw --precision amp-bf16 "
    "--gradient-checkpointing on",
    "--model hf:roberta-base --input seq512 --batch-size 32 --optimizer rmsprop-momentum",
    # factored (Adafactor) and 8-bit (bitsandbytes, where the machine has it) optimizer states
    "--model hf:t5-small --input seq512 --batch-size 16 --loss model --optimizer adafactor",
    "--model hf:llama-3.2-1b --input seq1024 --batch-size 4 --optimizer adamw-8bit --precision amp-bf16",
)]

_CHILD = r"""
import json, sys
from vest_slurm.gpu.measure import measure
from vest_slurm.estimate.workload import parse_workload_args
spec = parse_workload_args(json.loads(sys.argv[1]))
m = measure(spec, device=sys.argv[2], alloc_history=sys.argv[3] == "1")
print("VEST-RESULT " + json.dumps(m.to_dict()))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", action="append", help="workload options (repeatable); default: a built-in set")
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpu-profile", default=None, help="profile for the CPU estimate (default: from the device name)")
    p.add_argument("--out", default="benchmarks/gpu-measurements.csv")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--alloc-diff", metavar="DIR", default=None,
                   help="record the GPU run's allocations and write their difference from the CPU trace here")
    args = p.parse_args()

    from vest_slurm.estimate.estimator import estimate
    from vest_slurm.estimate.profiles import get_profile, profile_for_device_name
    from vest_slurm.estimate.workload import parse_workload_args

    rows = []
    for n, w in enumerate(args.workload or DEFAULT_WORKLOADS):
        argv = shlex.split(w)
        r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(argv), args.device, "1" if args.alloc_diff else "0"],
                           capture_output=True, text=True, timeout=args.timeout)
        line = next((l for l in r.stdout.splitlines() if l.startswith("VEST-RESULT ")), None)
        if line is None:
            rows.append({"workload": w, "status": f"failed: {(r.stderr.strip().splitlines() or ['?'])[-1][:200]}"})
            continue
        m = json.loads(line[len("VEST-RESULT "):])
        profile = get_profile(args.gpu_profile) if args.gpu_profile else profile_for_device_name(m["device_name"], m["total_mib"])
        row = {"workload": w, "status": "ok", "device": m["device_name"], "torch": m["torch_version"],
               "measured_max_allocated_mib": m["max_allocated_mib"], "measured_max_reserved_mib": m["max_reserved_mib"],
               "measured_device_peak_mib": m["device_peak_used_mib"], "measured_context_mib": m["context_used_mib"],
               # this workload's floor (device used minus reserved after its steps): with lazy loading
               # it follows the kernels the workload ran; profiles.py's context_mib is a median of such
               "measured_outside_allocator_mib": m["outside_allocator_mib"], "seconds": m["seconds"]}
        if profile is not None:
            (e,) = estimate(parse_workload_args(argv), [profile])
            b = dict(e.breakdown)
            row.update({"profile": profile.key, "replay_peak_allocated_mib": round(b["allocator_peak_allocated"] / 2**20, 1),
                        "replay_peak_reserved_mib": round(b["allocator_peak_reserved"] / 2**20, 1),
                        "predicted_peak_mib": round(e.peak_bytes / 2**20, 1)})
            if m["max_reserved_mib"]:
                row["reserved_rel_err"] = round(row["replay_peak_reserved_mib"] / m["max_reserved_mib"] - 1, 4)
            if m["device_peak_used_mib"]:
                row["peak_rel_err"] = round(row["predicted_peak_mib"] / m["device_peak_used_mib"] - 1, 4)
            if args.alloc_diff and m.get("allocations") is not None:
                row.update(_alloc_diff(args.alloc_diff, n, w, parse_workload_args(argv), profile, m["allocations"]))
        rows.append(row)
    cols = ["workload", "status", "measured_max_reserved_mib", "replay_peak_reserved_mib", "reserved_rel_err",
            "measured_device_peak_mib", "predicted_peak_mib", "peak_rel_err", "measured_context_mib",
            "measured_outside_allocator_mib"]
    if args.alloc_diff:
        cols += ["unmatched_real_mib", "unmatched_traced_mib"]
    print(tabulate([[r.get(c, "") for c in cols] for r in rows], headers=cols, tablefmt="github"))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k != "workload", k))
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def _alloc_diff(out_dir: str, n: int, workload: str, spec, profile, allocations) -> dict:
    """Pair the GPU run's allocations with the CPU trace of the same loop; write the leftovers."""
    from vest_slurm.gpu.allocdiff import diff_allocations, expand
    from vest_slurm.estimate.tracing import trace_training

    trace = trace_training(spec, capability=profile.capability)
    sizes = [e.size_bytes for e in trace.events if e.action == "alloc"]
    d = diff_allocations(expand(allocations), sizes)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{n:02d}.json"), "w") as f:
        json.dump({"workload": workload, **d.to_dict()}, f, indent=1)
    return {"unmatched_real_mib": round(d.unmatched_real_bytes / 2**20, 1),
            "unmatched_traced_mib": round(d.unmatched_traced_bytes / 2**20, 1)}


if __name__ == "__main__":
    sys.exit(main())
