"""`vest check`: one row per GPU type of the site, the largest batch, where vsbatch would place it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch  # noqa: F401  (vest check traces)

from vest_slurm.cli import run

ROOT = Path(__file__).resolve().parent.parent
TESTBED = str(ROOT / "site-config" / "testbed.toml")
SMALL = f"{ROOT / 'tests' / 'data' / 'user_models.py'}:small_cnn"
TINY_SITE = """
# context_mib pinned: the tests size these GPUs around a 420 MiB CUDA context, whatever the
# profiles' calibrated defaults are
[gpu.tiny]
profile = "v100-16gb"
memory_mib = 700
context_mib = 420
[gpu.big]
profile = "a100-40gb"
memory_mib = 900
context_mib = 440
[partition.tiny]
gpu_types = ["tiny"]
gpus_per_node = 4
[partition.big]
gpu_types = ["big"]
gpus_per_node = 4
[policy]
headroom_percent = 0
"""
MLP = 'mlp:[["Linear",1024,1024],["ReLU"],["Linear",1024,10]]'


def _tiny_train(path, batch: int) -> None:
    """A training script of one linear layer, 4 SGD steps at ``batch``."""
    path.write_text("import torch\nm = torch.nn.Linear(32, 32).cuda()\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                    f"for _ in range(4):\n    m(torch.randn({batch}, 32, device='cuda')).sum().backward()\n"
                    "    opt.step()\n    opt.zero_grad()\n")


def _script(tmp_path, body: str, name="job.sh") -> str:
    p = tmp_path / name
    p.write_text("#!/bin/bash\n" + body + "\necho hi\n")
    return str(p)


def test_check_script_table(tmp_path, capsys):
    job = _script(tmp_path, f"#SBATCH --time=5\n#VEST --model {SMALL} --batch-size 8 --input 3x32x32")
    assert run(["check", job, "--site-config", TESTBED, "--no-search"]) == 0
    out = capsys.readouterr().out
    for word in ("v100", "a100", "h100", "capacity MiB", "largest batch", "partitions",
                 "vsbatch would submit to partition v100"):
        assert word in out, out


def test_check_json_with_search_on_a_small_site(tmp_path, capsys):
    site = tmp_path / "site.toml"
    site.write_text(TINY_SITE)
    rc = run(["check", "--model", MLP, "--input", "1024", "--batch-size", "4096", "--site-config", str(site),
              "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {g["gpu"]: g for g in doc["gpus"]}
    assert set(rows) == {"tiny", "big"}
    for g in rows.values():
        assert g["fits"] and g["capacity_mib"] in (700, 900)
        assert g["headroom_mib"] == pytest.approx(g["capacity_mib"] - g["needed_mib"], abs=0.2)
        assert g["largest_batch"] > 4096 and g["largest_batch_exact"]
    assert rows["big"]["largest_batch"] > rows["tiny"]["largest_batch"]
    assert doc["placement"]["action"] == "submit" and doc["placement"]["partition"] == "tiny"


def test_check_options_override_the_script_and_refusal_exits_3(tmp_path, capsys):
    site = tmp_path / "site.toml"
    site.write_text(TINY_SITE)
    job = _script(tmp_path, f"#VEST --model '{MLP}' --input 1024 --batch-size 64")
    rc = run(["check", job, "--batch-size", "65536", "--site-config", str(site), "--json", "--search-budget", "60"])
    assert rc == 3
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["batch_size"] == 65536
    assert doc["placement"]["action"] == "refuse" and not any(g["fits"] for g in doc["gpus"])
    assert all(g["largest_batch"] < 65536 for g in doc["gpus"])
    assert doc["advice"], doc


@pytest.mark.parametrize("body, words", [
    ("#SBATCH --time=5", ["no #VEST line"]),
    ("#VEST --model", ["#VEST line(s) 2", "expected one argument"]),
    ("#VEST --model torchvision:resnet18 --batch-size zero", ["#VEST line(s) 2", "not an integer"]),
    ("#SBATCH --no-such-option", ["line 2", "unknown sbatch option"]),
])
def test_check_bad_scripts(tmp_path, capsys, body, words):
    job = _script(tmp_path, body)
    assert run(["check", job, "--site-config", TESTBED]) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err
    assert "Traceback" not in err


def test_check_missing_script_and_bad_site_config(tmp_path, capsys):
    assert run(["check", str(tmp_path / "nope.sh"), "--site-config", TESTBED]) == 2
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[gpu.v100]\nprofile = 'v100-16gb'\nmemroy_mib = 3\n[partition.v100]\ngpu_types=['v100']\ngpus_per_node=4\n")
    job = _script(tmp_path, f"#VEST --model {SMALL} --batch-size 8 --input 3x32x32")
    assert run(["check", job, "--site-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown key gpu.v100.memroy_mib" in err and "memory_mib" in err


def test_check_table_says_what_would_fit_and_no_empty_help_line(tmp_path, capsys):
    site = tmp_path / "site.toml"
    site.write_text(TINY_SITE)   # no help_url
    rc = run(["check", "--model", MLP, "--input", "1024", "--batch-size", "65536", "--site-config", str(site),
              "--search-budget", "60"])
    out = capsys.readouterr().out
    assert rc == 3 and "vsbatch would refuse the job" in out
    assert "What would fit:\n  - batch size " in out, out      # the advice vsbatch gives, here too
    assert "See \n" not in out and "{help_url}" not in out and not any(l.rstrip().endswith("See") for l in out.splitlines())


def test_check_notes_where_bf16_runs_emulated(tmp_path, capsys):
    """bf16 autocast runs on the V100 (PyTorch emulates it: same memory), with a note that it is
    slow there; the A100 has it natively: no note, and vsbatch would place it there."""
    job = _script(tmp_path, f"#VEST --model {SMALL} --batch-size 8 --input 3x32x32 --precision amp-bf16")
    assert run(["check", job, "--site-config", TESTBED, "--no-search", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["gpu"]: r for r in doc["gpus"]}
    assert rows["v100"]["fits"] and "emulated" in rows["v100"]["note"] and "amp-fp16" in rows["v100"]["note"]
    assert rows["a100"]["fits"] and rows["a100"]["note"] == ""
    assert doc["placement"]["partition"] == "a100"   # where it runs at full speed


def test_check_of_a_script_says_in_which_python_it_ran(tmp_path, capsys, monkeypatch):
    """A job script that loads modules vest does not load: the check says which Python the script ran
    in instead (table and JSON); one that activates a venv: the script ran in the venv's Python."""
    import subprocess
    import sys

    _tiny_train(tmp_path / "train.py", 4)
    monkeypatch.chdir(tmp_path)
    job = _script(tmp_path, "#SBATCH --gres=gpu:1\nmodule load cuda/12.4 pytorch\npython train.py")
    assert run(["check", job, "--site-config", TESTBED, "--json"]) == 0
    (note,) = json.loads(capsys.readouterr().out)["notes"]
    assert note.startswith("the job script loads software vest does not load (module load cuda/12.4 pytorch)")
    assert f"ran in {sys.executable}" in note
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(tmp_path / "venv")],
                   check=True)
    job = _script(tmp_path, "#SBATCH --gres=gpu:1\nsource venv/bin/activate\npython train.py", name="venv.sh")
    assert run(["check", job, "--site-config", TESTBED]) == 0
    assert f"note: the script ran in the job's Python (venv/bin/python" in capsys.readouterr().out


def test_check_of_slurms_multi_node_torchrun_line(tmp_path, capsys, monkeypatch):
    """`srun torchrun --nnodes $SLURM_NNODES --nproc_per_node $SLURM_GPUS_ON_NODE`: the sizes are the
    job's (2 nodes x 2 GPUs: 4 ranks; the line was skipped as "not a number"), and no smallest sharded
    count is claimed for a script (its run is of its own GPU count)."""
    import shutil

    shutil.copy(ROOT / "tests" / "data" / "scripts" / "fsdp2_meta_train.py", tmp_path)
    monkeypatch.chdir(tmp_path)
    job = _script(tmp_path, "#SBATCH --nodes=2\n#SBATCH --gpus-per-node=2\n#SBATCH --ntasks-per-node=1\n"
                  "srun torchrun --nnodes $SLURM_NNODES --nproc_per_node $SLURM_GPUS_ON_NODE "
                  "--rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 fsdp2_meta_train.py --layers 2 --dim 64")
    assert run(["check", job, "--site-config", TESTBED, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["num_gpus"] == 4 and doc["workload"]["parallelism"] == "fsdp2", doc["workload"]
    assert run(["check", job, "--site-config", TESTBED]) == 0
    out = capsys.readouterr().out
    assert "4 GPUs" in out and "configuration that fits" not in out


def test_check_of_a_launch_built_in_variables(tmp_path, capsys, monkeypatch):
    """The multi-node accelerate job as Slurm sites write it: the command assembled in variables,
    its process count arithmetic on $SLURM_NNODES, run by `srun $CMD`. vest check found no training
    command in it; now the job's 2 nodes x 2 GPUs are the world the script runs for."""
    import shutil

    shutil.copy(ROOT / "tests" / "data" / "scripts" / "accelerate_train.py", tmp_path)
    monkeypatch.chdir(tmp_path)
    job = _script(tmp_path, "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gres=gpu:2\n"
                  "GPUS_PER_NODE=2\nhead_node_ip=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)\n"
                  'export LAUNCHER="accelerate launch --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \\\n'
                  '    --num_machines $SLURM_NNODES --main_process_ip $head_node_ip --main_process_port 29500"\n'
                  'export SCRIPT_ARGS="--batch-size 8 --mixed-precision bf16"\n'
                  'export CMD="$LAUNCHER accelerate_train.py $SCRIPT_ARGS"\nsrun $CMD')
    assert run(["check", job, "--site-config", TESTBED, "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["workload"]
    assert (w["num_gpus"], w["batch_size"], w["precision"]) == (4, 8, "amp-bf16"), w


def test_check_follows_the_job_scripts_cd(tmp_path, capsys, monkeypatch):
    """`cd experiments/run1 && python train.py`: the script is the one in that directory (it was
    skipped as no training command, or looked for in the submission directory)."""
    run_dir = tmp_path / "experiments" / "run1"
    run_dir.mkdir(parents=True)
    _tiny_train(run_dir / "train.py", 16)
    monkeypatch.chdir(tmp_path)
    job = _script(tmp_path, "#SBATCH --gres=gpu:1\ncd $SLURM_SUBMIT_DIR\ncd experiments/run1 && python train.py")
    assert run(["check", job, "--site-config", TESTBED, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["batch_size"] == 16


def test_the_batch_searches_of_gpu_classes_run_beside_one_another(tmp_path, capsys, monkeypatch):
    """bf16 autocast is another run on the V100 than on the A100 and H100 (two traces of the job):
    the A100's and H100's batch searches (one line: they share the job's trace) run in a forked
    child beside the V100's (Prober.in_groups) and answer as one after another; their traces are
    made in the child."""
    from vest_slurm.estimate import ahead, estimator

    monkeypatch.setattr(ahead, "cores", lambda: 2)
    monkeypatch.setattr(ahead, "_idle_cores", lambda: 1.0)
    real = estimator.trace_for
    job = _script(tmp_path, f"#VEST --model {SMALL} --batch-size 8 --input 3x32x32 --precision amp-bf16")
    docs, made = {}, {}
    for beside in ("0", "1"):
        monkeypatch.setenv("VEST_TRACE_AHEAD", beside)
        made[beside] = here = []
        monkeypatch.setattr(estimator, "trace_for",
                            lambda spec, p, cache=False, here=here: here.append((spec.batch_size, p.capability))
                            or real(spec, p, cache))
        assert run(["check", job, "--site-config", TESTBED, "--json"]) == 0
        docs[beside] = json.loads(capsys.readouterr().out)
        docs[beside].pop("seconds", None)
    assert [g["largest_batch"] for g in docs["1"]["gpus"]] == [g["largest_batch"] for g in docs["0"]["gpus"]]
    assert docs["1"] == docs["0"]
    sm80 = {b for b, cap in made["0"] if cap == (8, 0) and b != 8}
    assert sm80 and not sm80 & {b for b, cap in made["1"] if cap == (8, 0)}
    assert {b for b, cap in made["1"] if cap == (7, 0)} == {b for b, cap in made["0"] if cap == (7, 0)}
