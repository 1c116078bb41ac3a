"""vsbatch places from the first GPU class it traces when the other classes cannot change the
choice, and traces them all when they could (a user's choice, a slow type, a refusal). Dry runs:
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
    # bf16 is emulated on the V100 (slow): an sm80 type could be chosen over it, so it is traced
    slow = _dry(tmp_path, "#SBATCH --gres=gpu:1", precision="amp-bf16")
    assert slow["gpu_type"] == "a100" and set(slow["estimates"]) == {"v100", "a100", "h100"}
