"""vsbatch places from the first GPU class it traces when the other classes cannot change the
choice, and traces them all when they could (a user's choice, a slow type not known to be slow
untraced, a refusal). Dry runs:
placement needs no Slurm, and where Slurm cannot be reached a dry run goes on without it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch  # noqa: F401  (the estimate traces with real torch)

from vest_slurm.site import vsbatch

ROOT = Path(__file__).resolve().parent.parent
SITE = str(ROOT / "site-config" / "testbed.toml")
MLP = """#VEST --model 'mlp:[["Linear",512,512],["ReLU"],["Linear",512,10]]' --input 512 --batch-size 16 --optimizer sgd"""


def _dry(tmp_path, lines: str, precision: str = "fp32") -> dict:
    script = tmp_path / "job.sbatch"
    script.write_text(f"#!/bin/bash\n{lines}\n{MLP} --precision {precision}\necho hi\n")
    out, err = io.StringIO(), io.StringIO()
    env = {"PATH": "/usr/bin:/bin", "VEST_CACHE_DIR": "off", "SLURM_CONF": str(tmp_path / "no-slurm.conf")}
    rc = vsbatch.run(["--dry-run", "--json", "--site-config", SITE, str(script)], env=env, stdout=out, stderr=err)
    assert rc == 0, err.getvalue()
    return json.loads(out.getvalue())


def test_the_smallest_class_fits_so_the_others_are_not_traced(tmp_path):
    d = _dry(tmp_path, "#SBATCH --gres=gpu:1")
    assert d["gpu_type"] == "v100" and set(d["estimates"]) == {"v100"}
    assert d["not_estimated"] == ["a100", "h100"]


def test_a_typed_choice_or_a_slow_type_traces_every_class(tmp_path):
    chosen = _dry(tmp_path, "#SBATCH --gres=gpu:h100:1")
    assert set(chosen["estimates"]) == {"v100", "a100", "h100"} and not chosen["not_estimated"]
    # bf16 is emulated on the V100 (slow): for a declarative amp-bf16 job that is known from the sm80
    # trace (it computes in bf16 and asked nothing a V100 answers otherwise), so the sm80 class is
    # traced first, and the V100, ranked after the A100 it would be, is not traced
    slow = _dry(tmp_path, "#SBATCH --gres=gpu:1", precision="amp-bf16")
    assert slow["gpu_type"] == "a100" and set(slow["estimates"]) == {"a100", "h100"}
    assert slow["not_estimated"] == ["v100"]


def test_a_slow_type_is_known_untraced_only_where_the_run_cannot_have_picked_its_dtype_by_the_gpu():
    from vest_slurm.estimate.estimator import summarize
    from vest_slurm.estimate.trace import BF16_NOTE, AllocTrace
    from vest_slurm.estimate.workload import parse_workload_args
    from vest_slurm.site.advice import Prober, _trace_key
    from vest_slurm.site.advice import site_profiles
    from vest_slurm.site.config import load_site_config

    def prober_with(precision, asked):
        spec = parse_workload_args(["--model", "torchvision:resnet18", "--batch-size", "4", "--input", "3x32x32",
                                    "--precision", precision])
        p = Prober(site_profiles(load_site_config(SITE)))
        p._traces[(_trace_key(spec), True)] = summarize(AllocTrace((), notes=(BF16_NOTE,), gpu_asked=asked), 0.0)
        return p, spec

    p, spec = prober_with("amp-bf16", (("bf16_supported", True, True),))   # autocast's own question
    assert p.slow_untraced(spec, "v100") and not p.slow_untraced(spec, "a100")
    p, spec = prober_with("amp-bf16", (("bf16_supported", False, True),))  # a V100 says no: another dtype there
    assert not p.slow_untraced(spec, "v100")
    p, spec = prober_with("amp-bf16", None)                                # nothing recorded: nothing known
    assert not p.slow_untraced(spec, "v100")
    p, spec = prober_with("amp-fp16", ())
    assert not p.slow_untraced(spec, "v100")
