#!/usr/bin/env python3
"""Sharded training per rank, side by side: torch's FSDPMemTracker, vest-slurm's estimate, and the
published measurement where there is one (issue 24).

For each configuration, in one run:
- FSDPMemTracker (torch.distributed._tools.fsdp2_mem_tracker), used as torchtitan's
  scripts/estimate/estimation.py uses it: a fake process group of N ranks, FakeTensorMode, the same
  model vest-slurm builds (models.build_model), fully_shard on each of vest-slurm's wrapping units
  (sharded_trace.wrap_units) and the root, the same MixedPrecisionPolicy, AdamW (foreach), two
  iterations, the second's peak. Fake tensors on the CPU device: with fake CUDA on a machine without
  a driver, backward stops in C++. Reported: its total peak, and the peak of the root's forward and
  backward snapshots (before the optimizer step).
- vest-slurm through its CLI (`vest estimate --json`): live-tensor peak, allocator peak allocated and
  reserved (the replay of the caching allocator, streams with their own pools), and what it adds
  outside the allocator (context, NCCL); its wall time and peak RSS.
- the published figure: peak active (active_bytes.all.peak) and peak reserved
  (reserved_bytes.all.peak), with the source, the configuration and the allocator setting it ran with.

Writes benchmarks/sharding-results.csv (paths relative to the checkout) and prints the table.
    python scripts/bench_sharding.py [--quick] [--only TEXT] [--mirror DIR]   # --quick: the small rows only
(--mirror: the fetched mirrors, for the row on torchtitan's own model; without it that row is skipped)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2 ** 30
MiB = 2 ** 20

# torchtitan PR #165 (https://github.com/pytorch/torchtitan/pull/165), "Used per-parameter FSDP":
# 8 H100 (95.0396 GiB each), local batch 8, sequence 2048, bf16 mixed precision with fp32
# reduce-scatter, full activation checkpointing per block ("AC"), AdamW, eager; its llama_7b.toml
# at the time (commit 6722657): Llama 2 7B (dim 4096, 32 layers, 32 heads, vocab 32000 from the
# Llama 2 tokenizer), AdamW lr 3e-4, max_norm 1.0 (foreach clip_grad_norm_). Its run_llama_train.sh
# set no PYTORCH_CUDA_ALLOC_CONF: the default allocator (no expandable segments). Percentages of
# 95.0396 GiB as published.
TT165 = "torchtitan PR #165 (github.com/pytorch/torchtitan/pull/165)"
TT_GPU_GIB = 95.0396
# The two published runs of PR #165 (peak active and reserved as fractions of the 95.0396 GiB card), each
# the measurement of several rows below (the model as transformers and as torchtitan build it, the job's torch)
TT165_ALLOC = "default (run_llama_train.sh sets none)"
TT165_FSDP2 = dict(published_active_gib=0.2392 * TT_GPU_GIB, published_reserved_gib=0.3264 * TT_GPU_GIB,
                   source=TT165, alloc_conf=TT165_ALLOC)
TT165_FSDP1 = dict(published_active_gib=0.2481 * TT_GPU_GIB, published_reserved_gib=0.3382 * TT_GPU_GIB,
                   source=TT165, alloc_conf=TT165_ALLOC)


@dataclass(frozen=True)
class Config:
    name: str
    args: tuple[str, ...]        # vest estimate workload arguments
    gpu: str                     # the built-in profile the estimate uses
    quick: bool = False
    tracker: bool = True         # FSDP2 only (FSDPMemTracker tracks fully_shard)
    published_active_gib: float | None = None
    published_reserved_gib: float | None = None
    source: str = ""
    published_config: str = ""
    alloc_conf: str = ""
    env: tuple[tuple[str, str], ...] = ()   # the job's stack where it is not this one (VEST_JOB_TORCH)
    tracker_note: str = ""                  # why the tracker did not run on this row
    torchtitan: bool = False                # the model is torchtitan's code, from the mirror (--mirror)


def _llama7b(parallelism: str) -> tuple[str, ...]:
    return ("--model", "hf:llama-7b", "--batch-size", "8", "--input", "seq2048", "--optimizer", "adamw",
            "--parallelism", parallelism, "--num-gpus", "8", "--param-dtype", "bf16", "--reduce-dtype", "fp32",
            "--gradient-checkpointing", "on")


# torchtitan's Transformer returns fp32 logits (`self.output(h).float()`) and its train.py keeps them
# (`pred`) through backward: transformers' Llama blocks with that output
# (benchmarks/models/torchtitan_logits.py), the PR #165 runs' model at the loss.
TT_LOGITS_MODEL = "benchmarks/models/torchtitan_logits.py:llama2_7b"


def _llama7b_tt(parallelism: str) -> tuple[str, ...]:
    args = list(_llama7b(parallelism))
    args[args.index("hf:llama-7b")] = TT_LOGITS_MODEL
    return tuple(args)


CAI_GPT_SOURCE = dict(
    source="hpcaitech/ColossalAI-Pytorch-lightning benchmark/gpt/README.md at 6a82b80 (2022-08-18)",
    alloc_conf="default (train.py sets none)")


def _cai(name: str, size: str, published_mib: float, published: str, *args: str) -> Config:
    """A row of the ColossalAI-Lightning GPT-2 benchmark: its model (seq 1024, gradient checkpointing
    on, A100 40GB) with ``args``, and its published max_memory_allocated in MiB."""
    return Config(f"{name} (ColossalAI-Lightning benchmark)",
                  ("--model", f"benchmarks/models/colossalai_gpt.py:{size}", "--loss", "model", "--input", "seq1024",
                   "--gradient-checkpointing", "on", *args),
                  "a100-40gb", tracker=False, published_active_gib=published_mib / 1024, **CAI_GPT_SOURCE,
                  published_config=f"{published}; HF gradient checkpointing; max_memory_allocated {published_mib:.3f} MB",
                  tracker_note=("DDP" if "ddp" in args else "DeepSpeed") + ": FSDPMemTracker tracks fully_shard only")


CONFIGS = (
    Config("tiny-llama fsdp2 x3 (uneven shards)",
           ("--model", "hf:tiny-llama", "--batch-size", "2", "--input", "seq128", "--optimizer", "adamw",
            "--parallelism", "fsdp2", "--num-gpus", "3", "--param-dtype", "bf16", "--reduce-dtype", "fp32"),
           "h100-80gb", quick=True),
    Config("llama-1b fsdp2 x8 bf16 batch 1 seq 2048",
           ("--model", "hf:llama-1b", "--batch-size", "1", "--input", "seq2048", "--optimizer", "adamw",
            "--parallelism", "fsdp2", "--num-gpus", "8", "--param-dtype", "bf16", "--reduce-dtype", "fp32"),
           "h100-80gb"),
    Config("llama-2-7b fsdp2 x8 AC batch 8 seq 2048", _llama7b("fsdp2"), "h100-80gb",
           **TT165_FSDP2,
           published_config="FSDP2 (AC): 8xH100 96GB; Llama 2 7B; local batch 8; seq 2048; bf16 params fp32 "
                            "reduce; full AC; AdamW; eager; 23.92% active 32.64% reserved of 95.0396 GiB"),
    Config("llama-2-7b fsdp (FSDP1) x8 AC batch 8 seq 2048", _llama7b("fsdp"), "h100-80gb", tracker=False,
           **TT165_FSDP1,
           published_config="FSDP1 (AC): same run as the FSDP2 row; 24.81% active 33.82% reserved of 95.0396 GiB"),
    Config("llama-2-7b fsdp (FSDP1) x8 AC batch 8 seq 2048, torchtitan's fp32 logits", _llama7b_tt("fsdp"),
           "h100-80gb", tracker=False,
           **TT165_FSDP1,
           published_config="FSDP1 (AC), as the FSDP1 row; the model returns fp32 logits kept through backward, "
                            "as torchtitan's Transformer and train.py (commit 6722657)",
           tracker_note="FSDP1: FSDPMemTracker tracks fully_shard only"),
    Config("llama-2-7b fsdp2 x8 AC batch 8 seq 2048, torchtitan's fp32 logits, job torch 2.4", _llama7b_tt("fsdp2"),
           "h100-80gb", tracker=False,
           **TT165_FSDP2,
           published_config="FSDP2 (AC), as the FSDP2 row, VEST_JOB_TORCH=2.4; the model returns fp32 logits kept "
                            "through backward, as torchtitan's Transformer and train.py (commit 6722657)",
           env=(("VEST_JOB_TORCH", "2.4"),),
           tracker_note="the tracker child runs transformers' own LlamaForCausalLM (the FSDP2 row)"),
    # The same run estimated for its own torch: FSDP2 of March 2024 allocated the reduce-scatter
    # input on the reduce-scatter stream (pytorch/pytorch PR #129721 moved it to the compute stream
    # in June 2024, first in torch 2.5): VEST_JOB_TORCH=2.4 models that (sharding.py).
    Config("llama-2-7b fsdp2 x8 AC batch 8 seq 2048, job torch 2.4", _llama7b("fsdp2"), "h100-80gb", tracker=False,
           **TT165_FSDP2,
           published_config="as the FSDP2 row, estimated with VEST_JOB_TORCH=2.4 (the run's FSDP2 predates PR #129721)",
           env=(("VEST_JOB_TORCH", "2.4"),),
           tracker_note="same model and config as the FSDP2 row"),
    # pytorch/pytorch PR #132445 (github.com/pytorch/pytorch/pull/132445), its "Before" (= the
    # "After" of PR #129721), 2024-06-27: torchtitan Llama3-8B, 1D FSDP2 over 8 H100 (95.04 GiB),
    # bf16 params / fp32 reduce, no AC, local batch 1; torchtitan's llama3_8b.toml of that day
    # (commit 1ec2ece51): seq_len 8192, AdamW lr 3e-4, max_norm 1.0, compile off; its log's
    # "memory" is reserved_bytes.all.peak, reset every step: steps 2 and 3 77.29 GiB (81.32%).
    # run_llama_train.sh sets no PYTORCH_CUDA_ALLOC_CONF. RS input on the compute stream, as 2.14.
    Config("llama-3-8b fsdp2 x8 no AC batch 1 seq 8192",
           ("--model", "hf:llama-3-8b", "--batch-size", "1", "--input", "seq8192", "--optimizer", "adamw",
            "--parallelism", "fsdp2", "--num-gpus", "8", "--param-dtype", "bf16", "--reduce-dtype", "fp32"),
           "h100-80gb", tracker=False, published_reserved_gib=77.29,
           source="pytorch/pytorch PR #132445 'Before' (github.com/pytorch/pytorch/pull/132445)",
           published_config="FSDP2: 8xH100 95.04 GiB; torchtitan Llama3-8B; local batch 1; seq 8192; bf16 params fp32 "
                            "reduce; no AC; AdamW; eager; steps 2-3 reserved 77.29 GiB (81.32%)",
           alloc_conf="default (run_llama_train.sh sets none)",
           tracker_note="not run: FSDPMemTracker on 8B x 8192 tokens takes longer than this pass had"),
    # The same run on the run's own model: torchtitan's Transformer at commit 1ec2ece51 (its RMSNorm,
    # complex rotary embedding, fp32 logits) and its train.py's loss with `del pred` before backward
    # (benchmarks/models/torchtitan_llama3.py; the code is read from the mirror, --mirror DIR).
    Config("llama-3-8b fsdp2 x8 no AC batch 1 seq 8192, torchtitan's own model",
           ("--model", "benchmarks/models/torchtitan_llama3.py:llama3_8b", "--batch-size", "1", "--input", "seq8192",
            "--loss", "model", "--optimizer", "adamw", "--parallelism", "fsdp2", "--num-gpus", "8",
            "--param-dtype", "bf16", "--reduce-dtype", "fp32"),
           "h100-80gb", tracker=False, published_reserved_gib=77.29, torchtitan=True,
           source="pytorch/pytorch PR #132445 'Before' (github.com/pytorch/pytorch/pull/132445)",
           published_config="as the row above, with torchtitan's Transformer and train.py loss (commit 1ec2ece51)",
           alloc_conf="default (run_llama_train.sh sets none)",
           tracker_note="the tracker builds the model vest-slurm builds; not run on 8B x 8192"),
    # DeepSpeed ZeRO-3 and DDP runs of a GPT-2 (benchmarks/models/colossalai_gpt.py), published as
    # max_memory_allocated of rank 0 (MiB) by CAI_GPT: Lightning 1.7's DeepSpeedStrategy(stage=3),
    # whose own defaults set reduce_bucket_size 2e8, fp16 (the model in half, fp32 masters),
    # DeepSpeed's FusedAdam (in place: no temporaries), transformers' gradient checkpointing on,
    # random token batches of 1024; the DDP row Lightning's native AMP with torch.optim.Adam of torch
    # 1.12 (for-loop by default, foreach came in 2.0) whose zero_grad() kept the gradients
    # (set_to_none=False until 2.0): --zero-grad never is that memory. Only allocated is published.
    _cai("gpt2-xl zero3 x4 fp16 AC batch 40 seq 1024", "gpt2_xl", 25360.968,
         "deepspeed (zero3): 4xA100 40GB; GPT2-XL (1600/48/25, vocab 50257); micro batch 40; seq 1024; fp16; "
         "FusedAdam", "--parallelism", "zero3", "--num-gpus", "4", "--precision", "fp16", "--batch-size", "40",
         "--optimizer", "adamw", "--optimizer-impl", "fused", "--reduce-bucket-size", "2e8"),
    _cai("gpt2-12B zero3 x8 fp16 AC batch 1 seq 1024", "gpt2_12b", 29751.203,
         "deepspeed (zero3): 8xA100 40GB; GPT-2 12B (4096/60/16); micro batch 1; seq 1024; fp16; FusedAdam",
         "--parallelism", "zero3", "--num-gpus", "8", "--precision", "fp16", "--batch-size", "1",
         "--optimizer", "adamw", "--optimizer-impl", "fused", "--reduce-bucket-size", "2e8"),
    _cai("gpt2-18B zero3 offload x1 fp16 AC batch 1 seq 1024", "gpt2_18b", 5699.500,
         "deepspeed (zero3 offload): 1xA100 40GB; GPT-2 18B (4096/90/16); micro batch 1; seq 1024; fp16; params "
         "and optimizer on the CPU (DeepSpeedCPUAdam)", "--parallelism", "zero3", "--num-gpus", "1",
         "--offload", "params", "--precision", "fp16", "--batch-size", "1", "--optimizer", "adamw",
         "--reduce-bucket-size", "2e8"),
    _cai("gpt2-xl ddp x4 amp-fp16 AC batch 6 seq 1024", "gpt2_xl", 37905.422,
         "ddp (AMP): 4xA100 40GB; GPT2-XL; batch 6 per GPU (global 24); seq 1024; native AMP fp16; "
         "torch.optim.Adam (torch 1.12: for-loop, zero_grad keeps the gradients); DDP static_graph",
         "--parallelism", "ddp", "--num-gpus", "4", "--precision", "amp-fp16", "--batch-size", "6",
         "--optimizer", "adam", "--optimizer-impl", "for-loop", "--zero-grad", "never"),
    # issue 24's speed target: an 8B model over 8 GPUs (32 identical blocks: traced at 4 and 5, scaled)
    Config("llama-3-8b fsdp2 x8 batch 1 seq 2048 (speed)",
           ("--model", "hf:llama-3-8b", "--batch-size", "1", "--input", "seq2048", "--optimizer", "adamw",
            "--parallelism", "fsdp2", "--num-gpus", "8", "--param-dtype", "bf16", "--reduce-dtype", "fp32"),
           "h100-80gb", tracker=False, tracker_note="speed row"),
)


TORCHTITAN_COMMIT = "1ec2ece51"   # the llama3_8b.toml of the PR #132445 run (2024-06-26)


def _shown(name: str, value: str) -> str:
    """An environment variable as the results file shows it: the extracted torchtitan folder (a
    temp path of this machine) by what it holds."""
    return f"<torchtitan/models at {TORCHTITAN_COMMIT}>" if name == "VEST_TORCHTITAN" else value


def _torchtitan_source(mirror: str) -> str:
    """torchtitan/models at TORCHTITAN_COMMIT, extracted from the mirror into a temp folder."""
    import tempfile

    repo = os.path.join(mirror, "pytorch+torchtitan", "repo")
    where = tempfile.mkdtemp(prefix="vest-torchtitan-")
    tar = subprocess.run(["git", "-C", repo, "archive", TORCHTITAN_COMMIT, "torchtitan/models"],
                         capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", where], input=tar, check=True)
    return where


# -- FSDPMemTracker, in a child process (the fake process group and FakeTensorMode stay there)

def tracker_child(argv: list[str]) -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModState
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, ROOT)
    from vest_slurm.estimate.models import build_model
    from vest_slurm.estimate.sharded_trace import wrap_units
    from vest_slurm.estimate.sharding import dtypes
    from vest_slurm.estimate.tracing import _DTYPES
    from vest_slurm.estimate.workload import parse_workload_args

    spec = parse_workload_args(argv)
    world = spec.num_gpus
    _, param, reduce = dtypes(spec)
    t0 = time.perf_counter()
    torch.distributed.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (world,))
    with FakeTensorMode():
        # built in the weights' dtype (a module.to(dtype) under FakeTensorMode cannot swap parameters)
        default = torch.get_default_dtype()
        torch.set_default_dtype(_DTYPES[spec.weight_dtype])
        try:
            model = build_model(spec).module
        finally:
            torch.set_default_dtype(default)
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, param), reduce_dtype=getattr(torch, reduce))
        for _name, m in wrap_units(model):
            fully_shard(m, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        model.to_empty(device="cpu")
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        x = torch.randint(0, model.config.vocab_size, (spec.batch_size, spec.input.shape[0]))
        tracker = FSDPMemTracker(mod=model, optm=opt)
        tracker.track_inputs((x,))
        with tracker:
            for it in range(2):
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                if it == 0:
                    tracker.reset_mod_stats()   # as torchtitan: the first iteration has no optimizer state
        dev = torch.device("cpu")
        peak = tracker.get_tracker_snapshot("peak")[dev]
        stats = tracker.memory_tracking[model]
        fwbw = max((s[dev]["Total"] for st in (_FSDPModState.PEAK_FW, _FSDPModState.PEAK_BW)
                    for s in stats.snapshots.get(st, ()) if dev in s), default=0)
    print(json.dumps({"peak": peak["Total"], "fwbw_peak": fwbw,
                      "parts": {str(k.value if hasattr(k, "value") else k): v for k, v in peak.items()},
                      "seconds": time.perf_counter() - t0,
                      "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def _child(cmd: list[str], timeout: int = 1800) -> tuple[dict | None, float, str]:
    """Run a child; (its JSON on the last stdout line, wall seconds, error). The child reports its
    own peak RSS in that JSON."""
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        return None, time.perf_counter() - t0, "timeout"
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return None, wall, (err.strip().splitlines() or ["failed"])[-1][:200]
    line = [ln for ln in out.splitlines() if ln.startswith("{")]
    return (json.loads(line[-1]) if line else None), wall, ""


def _vest(cfg: Config) -> tuple[dict | None, float, str]:
    """vest estimate through its CLI (--json), under /usr/bin/time for the command's peak RSS."""
    cmd = ["/usr/bin/time", "-f", "VEST_RSS_KB %M", sys.executable, "-m", "vest_slurm.cli", "estimate", *cfg.args,
           "--gpu", cfg.gpu, "--json"]
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **dict(cfg.env))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    rss = [ln.split()[1] for ln in p.stderr.splitlines() if ln.startswith("VEST_RSS_KB")]
    if p.returncode != 0:
        err = [ln for ln in p.stderr.strip().splitlines() if not ln.startswith("VEST_RSS_KB")]
        return None, wall, (err or ["failed"])[-1][:200]
    d = json.loads(p.stdout)
    d["rss"] = int(rss[0]) * 1024 if rss else 0
    return d, wall, ""


def _torch_import_seconds() -> float:
    """Wall seconds of `python -c "import torch"` (the speed figures are read against it)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t0


def gib(v) -> str:
    return "" if v is None else f"{v / GiB:.2f}"


def pct(est, ref) -> str:
    return "" if est is None or not ref else f"{100 * (est / GiB - ref) / ref:+.1f}%"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", metavar="TEXT", help="only the rows whose name contains TEXT (results: "
                                                   "benchmarks/sharding-results-only.csv)")
    ap.add_argument("--tracker-child", nargs=argparse.REMAINDER)
    ap.add_argument("--mirror", metavar="DIR", help="folder of bare mirrors OWNER+NAME/repo (the fetch tool's): "
                                                    "torchtitan's code for the rows on its own model")
    a = ap.parse_args()
    if a.tracker_child is not None:
        tracker_child(a.tracker_child)
        return 0
    titan = _torchtitan_source(a.mirror) if a.mirror else None
    imports = [_torch_import_seconds()]   # the yardstick of the speed figures, before and after the rows
    rows = []
    for cfg in CONFIGS:
        if (a.quick and not cfg.quick) or (a.only and a.only not in cfg.name):
            continue
        if cfg.torchtitan and titan is None:
            print(f"[{cfg.name}] skipped: needs torchtitan's code (--mirror DIR)", flush=True)
            continue
        print(f"[{cfg.name}] ...", flush=True)
        if cfg.torchtitan:
            cfg = replace(cfg, env=cfg.env + (("VEST_TORCHTITAN", titan),))
        tr, tr_wall, tr_err = (_child([sys.executable, os.path.abspath(__file__), "--tracker-child", *cfg.args])
                               if cfg.tracker else (None, 0.0, cfg.tracker_note or "FSDP1: FSDPMemTracker tracks fully_shard only"))
        ve, ve_wall, ve_err = _vest(cfg)
        b = ve["estimates"][0]["breakdown"] if ve else {}
        mib = lambda k: b[k] * MiB if k in b else None   # noqa: E731
        outside = (mib("cuda_context") or 0) + (mib("nccl") or 0) if b else None
        rows.append({
            "config": cfg.name,
            "vest_args": " ".join(cfg.args) + f" --gpu {cfg.gpu}",
            "tracker_peak_gib": gib(tr["peak"]) if tr else "",
            "tracker_fwd_bwd_peak_gib": gib(tr["fwbw_peak"]) if tr else "",
            "tracker_opt_state_at_peak_gib": gib(tr["parts"].get("OptState")) if tr else "",
            "tracker_seconds": f"{tr_wall:.1f}" if tr else "",
            "tracker_note": tr_err,
            "vest_live_peak_gib": gib(mib("live_tensor_peak")),
            "vest_alloc_allocated_gib": gib(mib("allocator_peak_allocated")),
            "vest_alloc_reserved_gib": gib(mib("allocator_peak_reserved")),
            "vest_outside_allocator_gib": gib(outside) if b else "",
            "vest_optimizer_state_gib": gib(mib("optimizer_state")),
            "vest_seconds": f"{ve_wall:.1f}",
            "vest_rss_mib": f"{ve['rss'] / MiB:.0f}" if ve else "",
            "vest_note": ve_err or "; ".join(n for n in (ve or {}).get("trace_notes", ())),
            "vest_env": " ".join(f"{k}={_shown(k, v)}" for k, v in cfg.env),
            "published_active_gib": f"{cfg.published_active_gib:.2f}" if cfg.published_active_gib else "",
            "published_reserved_gib": f"{cfg.published_reserved_gib:.2f}" if cfg.published_reserved_gib else "",
            "allocated_vs_active": pct(mib("allocator_peak_allocated"), cfg.published_active_gib),
            "reserved_vs_reserved": pct(mib("allocator_peak_reserved"), cfg.published_reserved_gib),
            "tracker_vs_active": pct(tr["peak"] if tr else None, cfg.published_active_gib),
            "alloc_conf": cfg.alloc_conf,
            "published_config": cfg.published_config,
            "source": cfg.source,
        })
        r = rows[-1]
        print(f"  tracker {r['tracker_peak_gib'] or '-'} GiB (fwd/bwd {r['tracker_fwd_bwd_peak_gib'] or '-'}) "
              f"{r['tracker_note']} | vest live {r['vest_live_peak_gib']} alloc {r['vest_alloc_allocated_gib']} "
              f"reserved {r['vest_alloc_reserved_gib']} GiB ({r['vest_seconds']} s, {r['vest_rss_mib']} MiB) "
              f"{r['vest_note']} | published {r['published_active_gib'] or '-'} / {r['published_reserved_gib'] or '-'}",
              flush=True)
    imports.append(_torch_import_seconds())
    mean_import = sum(imports) / len(imports)
    for r in rows:
        r["torch_import_seconds"] = f"{mean_import:.1f}"
        r["vest_x_torch_import"] = f"{float(r['vest_seconds']) / mean_import:.2f}" if r["vest_seconds"] else ""
    name = "sharding-results-quick.csv" if a.quick else "sharding-results-only.csv" if a.only else "sharding-results.csv"
    out = os.path.join(ROOT, "benchmarks", name)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cols = ("config", "tracker_peak_gib", "tracker_fwd_bwd_peak_gib", "vest_live_peak_gib", "vest_alloc_allocated_gib",
            "vest_alloc_reserved_gib", "published_active_gib", "published_reserved_gib", "allocated_vs_active",
            "reserved_vs_reserved")
    print("\n" + " | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    print(f"\nimport torch: {mean_import:.1f} s (mean of {len(imports)}); vest time / import: "
          + ", ".join(f"{r['config']} {r['vest_x_torch_import']}" for r in rows))
    print(f"\nwrote {os.path.relpath(out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
