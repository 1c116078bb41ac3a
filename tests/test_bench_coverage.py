"""scripts/bench_coverage.py: its workload list parses, and a run writes what it found per workload."""

from __future__ import annotations

import csv
import importlib.util
import os
import shlex
import subprocess
import sys

import torch

from vest_slurm.estimate.workload import parse_workload_args

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_coverage.py")


def load_script():
    spec = importlib.util.spec_from_file_location("bench_coverage_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_workload_of_the_sweep_parses():
    mod = load_script()
    work = mod.workloads({"torchvision", "timm", "hf"})
    families = {fam for fam, _ in work}
    assert families == {"torchvision", "timm", "hf"}
    for _fam, args in work:
        parse_workload_args(shlex.split(args))
    # each listed model is there in both precisions (video and detection: AMP only)
    assert sum(1 for fam, a in work if fam == "timm") == 2 * sum(1 for n in mod.TIMM if __import__("timm").is_model(n))


def test_a_run_reports_traced_refused_and_writes_its_csv(tmp_path):
    out = tmp_path / "coverage.csv"
    pattern = r"torchvision:(resnet18|fcn_resnet50) .*fp32$|torchvision:fasterrcnn_resnet50_fpn "
    proc = subprocess.run([sys.executable, SCRIPT, "--family", "torchvision", "--filter", pattern, "--workers", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr   # a refused model is not a failure
    rows = {r["args"].split()[1]: r for r in csv.DictReader(open(out))}
    assert set(rows) == {"torchvision:resnet18", "torchvision:fcn_resnet50", "torchvision:fasterrcnn_resnet50_fpn"}
    assert rows["torchvision:resnet18"]["status"] == "ok" and float(rows["torchvision:resnet18"]["peak_mib"]) > 0
    assert rows["torchvision:fcn_resnet50"]["status"] == "ok"
    assert rows["torchvision:resnet18"]["host_ops"] == "0"
    assert rows["torchvision:fasterrcnn_resnet50_fpn"]["status"] == "refused"
    assert "torchvision" in proc.stdout and "3 workloads" in proc.stdout


def test_host_op_diagnostic_counts_a_device_op_with_a_host_output():
    # the lead it gives: an op with a fake CUDA input whose output landed on the host (here the copy
    # op of a host copy the script asked for, which can count too); a host factory does not count
    from vest_slurm.estimate import _fakecuda as fc

    mod = load_script()
    dispatch, threads = fc.FakeCudaMode.__torch_dispatch__, torch.get_num_threads()
    try:
        mod._init_worker()
        recorder = fc.Recorder(lambda *a: None, lambda *a: None)
        with (fc.cuda_answers(total_memory_bytes=80 << 30, capability=(9, 0)), fc.FakeCudaMode(recorder),
              fc.CudaFactoryMode()):
            torch.zeros(100, 100)
            assert sum(mod._HOST_OPS.values()) == 0
            x = torch.empty(100, 100, device="cuda")
            fc.HOST_COPY[0] += 1
            try:
                torch.ops.aten._to_copy.default(x, device=torch.device("cpu"))
            finally:
                fc.HOST_COPY[0] -= 1
        assert sum(mod._HOST_OPS.values()) == 1
    finally:
        fc.FakeCudaMode.__torch_dispatch__ = dispatch
        torch.set_num_threads(threads)
