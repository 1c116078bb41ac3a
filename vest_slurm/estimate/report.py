"""Text and JSON renderings of estimates. The only place that formats MiB/GiB."""

from __future__ import annotations

import json
from typing import Callable, Mapping, Sequence

from tabulate import tabulate

from .. import __version__
from .record import MemoryEstimate
from ..units import MiB
from .workload import WorkloadSpec

_BREAKDOWN_LABELS = {
    "cuda_context": "CUDA context + kernels (outside the allocator)",
    "cudnn": "cuDNN handle + kernels (outside the allocator)",
    "nccl": "NCCL buffers (outside the allocator)",
    "nccl_nvls": "NCCL NVLink SHARP buffers (outside the allocator)",
    "parameters": "parameters",
    "gradients": "gradients (largest set alive)",
    "optimizer_state": "optimizer state",
    "live_tensor_peak": "live-tensor peak (tensors alone)",
    "live_tensor_peak_steps": "live-tensor peak in the training steps alone",
    "allocator_peak_allocated": "allocator peak allocated (rounded blocks)",
    "allocator_peak_reserved": "allocator peak reserved (segments)",
    "allocator_required": "allocator need after flush-and-retry",
    "cudnn_workspace_max": "largest cuDNN workspace (in the allocator)",
    "cudnn_benchmark_workspace_max": "largest cuDNN benchmark-mode timing workspace",
    "cudnn_engines_bound_peak": "peak with cuDNN's largest engines (placement uses it)",
}


def _mib(n: int) -> str:
    return f"{n / MiB:,.0f}"


def emulated_bf16(profile) -> str:
    """Why a job that computes in bfloat16 runs much slower on this GPU type ("" where it does not):
    before sm80 PyTorch emulates bf16 in fp32 arithmetic (no bf16 tensor cores; convolutions off
    cuDNN), with the same memory."""
    if profile.capability >= (8, 0):
        return ""
    return (f"bf16 runs emulated on sm{profile.capability[0]}{profile.capability[1]} (no bf16 tensor cores): "
            f"the same memory, much slower; amp-fp16 is the usual choice there")


def slow_types(profiles: Mapping[str, object], summary_for: Callable[[object], object]) -> dict[str, str]:
    """{GPU type: why} for the types of ``profiles`` (type -> DeviceProfile) where the job runs much
    slower: its trace for that GPU (``summary_for(profile)``, a TraceSummary or None) computes in
    bfloat16, and the GPU emulates it (emulated_bf16)."""
    return {t: why for t, p in profiles.items()
            if (why := emulated_bf16(p)) and getattr(summary_for(p), "computes_bf16", False)}


def estimate_table(spec: WorkloadSpec, estimates: Sequence[MemoryEstimate], slow: Mapping[str, str] | None = None,
                   profiles: Mapping[str, str] | None = None, site_config: str | None = None,
                   trace_notes: Sequence[str] = ()) -> str:
    """The estimate as a table. ``slow``: {GPU type: why the job runs much slower there} (report.slow_types);
    ``profiles``: {GPU type: its device profile} where they differ (a site's types); ``site_config``:
    the file the types come from."""
    if spec.model.startswith("script:"):
        head = (f"{spec.model[len('script:'):].strip()}\n(dynamic analysis: the script ran with fake CUDA; "
                f"batch {spec.batch_size} seen per GPU{f', {spec.num_gpus} GPUs' if spec.num_gpus > 1 else ''})")
    else:
        head = (f"{spec.model}  batch {spec.batch_size} per GPU  input {spec.input}  {spec.optimizer}  "
                f"{spec.precision}{'  channels_last' if spec.channels_last else ''}"
                f"{f'  {spec.num_gpus} GPUs' if spec.num_gpus > 1 else ''}")
    if site_config:
        head += f"\n(GPU types of the site config {site_config}: its memory and measured floors where it gives them)"
    profiles = profiles or {}

    def gpu(e):
        p = profiles.get(e.gpu, e.gpu)
        return e.gpu if p == e.gpu else f"{e.gpu} ({p})"

    rows = [[gpu(e), _mib(e.capacity_bytes), _mib(e.required_bytes), _mib(e.peak_bytes),
             f"{100 * e.headroom_bytes() / e.capacity_bytes:+.0f}%", "yes" if e.fits else "NO",
             f"{_mib(_context(e))} {e.floor or '?'}"] for e in estimates]
    table = tabulate(rows, headers=["GPU", "usable MiB", "required MiB", "peak MiB (nvidia-smi)", "headroom", "fits",
                                    "floor MiB"],
                     tablefmt="simple", disable_numparse=True,
                     colalign=("left", "right", "right", "right", "right", "left", "left"))
    first = estimates[0]
    brows = [[_BREAKDOWN_LABELS.get(k, k), _mib(v)] for k, v in first.parts()]
    breakdown = tabulate(brows, headers=[f"breakdown on {first.gpu}", "MiB"], tablefmt="simple",
                         disable_numparse=True, colalign=("left", "right"))
    slow = slow or {}
    notes = [f"FLAGGED: {f}" for f in spec.flags]
    notes += [f"note: {e.gpu}: {slow[e.gpu]}" for e in estimates if e.gpu in slow]
    notes += [f"note: {n}" for n in floor_notes(estimates)]
    notes += [f"note: {n}" for n in trace_notes]
    if "cudnn_workspace_max" in dict(first.breakdown):
        from . import cudnn_ws

        if not cudnn_ws.available():
            notes.append("note: cuDNN's convolution workspaces are not in this estimate (it needs cuDNN >= 9.8 and "
                         "nvidia-cudnn-frontend: pip install nvidia-cudnn-frontend)")
        elif assumed := cudnn_ws.assumed_note():
            notes.append(f"note: {assumed}")
    note = "\n" + "\n".join(notes) + "\n" if notes else ""
    return f"{head}\n\n{table}\n\n{breakdown}\n{note}"


def _context(e: MemoryEstimate) -> int:
    return dict(e.breakdown).get("cuda_context", 0)


def floor_notes(estimates: Sequence[MemoryEstimate]) -> list[str]:
    """What the floors of ``estimates`` rest on, said once: a default floor errs high (profiles.py)
    and is not a bound under eager module loading."""
    from .profiles import eager_loading_note

    default = [e.gpu for e in estimates if e.floor == "default"]
    if not default:
        return []
    notes = [f"floor 'default' ({', '.join(default)}): no site calibration; a bound on the CUDA context and "
             "lazily loaded libraries that errs high (calibrate: vest calibrate, or vest audit --apply)"]
    added = {e.gpu: round(v / (1 << 20)) for e in estimates if e.floor == "default"
             for k, v in e.breakdown if k == "eager_module_loading"}
    if eager := eager_loading_note(bounded_mib=added):
        notes.append(eager)
    return notes


def estimate_json(spec: WorkloadSpec, estimates: Sequence[MemoryEstimate], seconds: float | None = None,
                  profiles: Mapping[str, str] | None = None, site_config: str | None = None,
                  trace_notes: Sequence[str] = ()) -> str:
    profiles = profiles or {}
    doc = {
        "tool": "vest-slurm",
        "version": __version__,
        "workload": spec.to_dict(),
        "flags": list(spec.flags),   # why the estimate may not be the real run's (dynamic analysis)
        "site_config": site_config,
        "estimates": [
            {
                "gpu": e.gpu,
                "profile": profiles.get(e.gpu, e.gpu),
                "capacity_mib": round(e.capacity_bytes / MiB, 1),
                "peak_mib": round(e.peak_bytes / MiB, 1),
                "required_mib": round(e.required_bytes / MiB, 1),
                "fits": e.fits,
                "placement_mib": round(max(e.peak_bytes, e.required_bytes, e.placement_bytes) / MiB, 1),
                "floor": {"context_mib": round(_context(e) / MiB, 1), "source": e.floor or "unknown"},
                "breakdown": {k: round(v / MiB, 1) for k, v in e.parts()},
            }
            for e in estimates
        ],
    }
    if notes := floor_notes(estimates):
        doc["floor_notes"] = notes
    if trace_notes:
        doc["trace_notes"] = list(trace_notes)   # how the trace was made (block_scaling.py: blocks scaled)
    if estimates and "cudnn_workspace_max" in dict(estimates[0].breakdown):
        from . import cudnn_ws

        if cudnn_ws.available() and (assumed := cudnn_ws.assumed_note()):
            doc["cudnn_note"] = assumed
    if seconds is not None:
        doc["seconds"] = round(seconds, 3)
    return json.dumps(doc, indent=2)


def job_environment_notes(summaries) -> list[str]:
    """Of trace_notes, those about the Python a script ran in (the job's own, or vest's while the
    job script loads modules): vsbatch and `vest check` say them too."""
    from .trace import JOB_PYTHON_NOTE, JOB_SETUP_NOTE

    return [n for n in trace_notes(summaries) if n.startswith((JOB_PYTHON_NOTE, JOB_SETUP_NOTE))]


def trace_notes(summaries) -> list[str]:
    """What the output says about how the traces were made: a stack of identical blocks traced at
    4 and 5 and scaled, or why it was traced whole (block_scaling.py); a script run in the job's own
    Python (runner.script_python); a sharded job's per-rank model (sharding.rank_trace: the
    strategy and GPUs, DeepSpeed modelled rather than traced, accumulation, units ZeRO-3 keeps)."""
    from .block_scaling import SCALED_NOTE, WHOLE_NOTE
    from .sharding import PER_RANK_NOTES
    from .trace import JOB_PYTHON_NOTE, JOB_SETUP_NOTE

    out: list[str] = []
    for s in summaries:
        trace = getattr(s, "trace", None)
        for n in (trace.notes if trace is not None else ()):
            if n.startswith((SCALED_NOTE, WHOLE_NOTE, JOB_PYTHON_NOTE, JOB_SETUP_NOTE) + PER_RANK_NOTES) and n not in out:
                out.append(n)
    return out
