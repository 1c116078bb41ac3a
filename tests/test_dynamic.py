"""Dynamic analysis: unmodified training scripts run with fake CUDA in a bounded child process."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import uuid

# The training loops these tests trace: [test] dependencies (pyproject), imported, never skipped.
import accelerate  # noqa: F401
import bitsandbytes  # noqa: F401
import pytest
from procs import procs_with
import pytorch_lightning  # noqa: F401
import torch  # noqa: F401

from bnb_state import adam_8bit_state_bytes
from vest_slurm.estimate import steady
from vest_slurm.dynamic.runner import Limits, estimate_command
from vest_slurm.errors import EstimateError, WorkloadError
from vest_slurm.estimate.estimator import estimate
from vest_slurm.dynamic.launch import parse_train_command
from vest_slurm.estimate.profiles import get_profile
from vest_slurm.estimate.workload import parse_workload_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "scripts", "examples")
SCRIPTS = os.path.join(ROOT, "tests", "data", "scripts")
A100 = get_profile("a100-40gb")

# (training command in scripts/examples, the same workload declared with #VEST options)
EQUIVALENT = [
    ("python train_imagenet.py --arch resnet18 --batch-size 16 --image-size 112 --optimizer sgd --amp bf16",
     "--model torchvision:resnet18 --batch-size 16 --input 3x112x112 --optimizer sgd-momentum --precision amp-bf16 "
     "--cudnn-benchmark on"),   # the script sets torch.backends.cudnn.benchmark = True
    ("python train_imagenet.py --arch resnet18 --batch-size 16 --image-size 112 --optimizer adam --amp fp16",
     "--model torchvision:resnet18 --batch-size 16 --input 3x112x112 --optimizer adam --precision amp-fp16 "
     "--cudnn-benchmark on"),
    ("python train_lm.py --n-layer 2 --n-embd 256 --n-head 4 --seq-len 128 --batch-size 4 --amp bf16",
     "--model hf:GPT2LMHeadModel --model-args {\"n_layer\":2,\"n_embd\":256,\"n_head\":4,\"n_positions\":1024} "
     "--input seq128 --batch-size 4 --precision amp-bf16 --optimizer adamw"),
    ("python train_own_model.py --width 16 --image-size 64 --batch-size 8",
     "--model train_own_model.py:build_model --model-args {\"width\":16} --input 3x64x64 --batch-size 8 "
     "--optimizer sgd-momentum --loss mse"),
]


def breakdown(e):
    return dict(e.breakdown)


@pytest.mark.parametrize("command,declared", EQUIVALENT, ids=["imagenet-sgd-bf16", "imagenet-adam-fp16", "lm", "own-model"])
def test_dynamic_equals_declarative(command, declared, monkeypatch):
    monkeypatch.chdir(EXAMPLES)
    (dyn,), run = estimate_command(parse_train_command(command), [A100], cwd=EXAMPLES)
    (dec,) = estimate(parse_workload_args(declared.split()), [A100])
    d, c = breakdown(dyn), breakdown(dec)
    for part in ("parameters", "gradients", "optimizer_state"):
        assert d[part] == c[part], (part, d[part], c[part])
    assert abs(dyn.peak_bytes - dec.peak_bytes) <= 0.02 * dec.peak_bytes, (dyn.peak_bytes, dec.peak_bytes)
    assert abs(dyn.required_bytes - dec.required_bytes) <= 0.02 * dec.required_bytes
    # a script's own torch.backends.cudnn.benchmark decides the timing workspaces, as the option does
    assert ("cudnn_benchmark_workspace_max" in d) == ("cudnn_benchmark_workspace_max" in c)
    assert run.steps == 3
    # each optimizer step closes an iteration; the last one repeats cleanly (steady.py)
    ends = run.trace.step_ends
    assert len(ends) == 3 and list(ends) == sorted(ends) and ends[-1] <= len(run.trace.events)
    assert steady.extend(run.trace.events, ends)[1] >= steady.PATIENCE


def estimate_script(name, *args, limits=Limits(), env=None):
    cmd = parse_train_command(["python", name, *args])
    if env:
        cmd = cmd.__class__(**{**cmd.__dict__, "env": tuple(env.items())})
    return estimate_command(cmd, [A100], limits=limits, cwd=SCRIPTS)


def test_script_that_fails_by_itself_names_file_and_line():
    with pytest.raises(EstimateError) as e:
        estimate_script("fails_by_itself.py")
    msg = str(e.value)
    assert "the script failed" in msg and "KeyError" in msg and "learning_rate" in msg
    assert "fails_by_itself.py:5" in msg
    assert e.value.kind == "script-error" and e.value.where.endswith("fails_by_itself.py:5")
    kept = msg.split("the run's output is kept in ")[1].split()[0]   # the log outlives the temp dir
    with open(kept) as f:
        assert "KeyError" in f.read()
    os.unlink(kept)


def test_script_without_optimizer_step():
    with pytest.raises(EstimateError) as e:
        estimate_script("no_step.py")
    assert "without a training step" in str(e.value) and "optimizer.step()" in str(e.value)
    assert e.value.kind == "script-error"


def test_data_dependent_work_names_file_and_line():
    with pytest.raises(EstimateError) as e:
        estimate_script("data_dependent.py")
    msg = str(e.value)
    assert "data-dependent" in msg and "data_dependent.py:7" in msg and "#VEST --model" in msg
    assert e.value.kind == "data-dependent"


def test_time_limit():
    """A run that reaches the time limit before a training step fails with the limit; one that
    reaches it after a step (a long sampling between steps) ends with the steps traced, flagged."""
    with pytest.raises(EstimateError) as e:
        estimate_script("sleeps.py", limits=Limits(timeout_s=20))
    assert "time limit" in str(e.value) and "20 s" in str(e.value)
    (est,), run = estimate_script("sleeps.py", "--after-a-step", limits=Limits(timeout_s=20))
    assert run.steps == 1 and dict(est.breakdown)["parameters"] == 4 * (4 * 4 + 4)
    flag = next(f for f in run.flags if f.startswith("the run reached the time limit (20 s) after 1 training step"))
    assert "shorter sampling or evaluation" in flag and "[dynamic] timeout_s" in flag   # the user's way, the site's


def test_memory_limit():
    with pytest.raises(EstimateError) as e:
        estimate_script("hogs_memory.py", limits=Limits(memory_bytes=2 * 2**30))
    assert "memory limit" in str(e.value) and "2.0 GiB" in str(e.value) and "checkpoint" not in str(e.value)
    # a checkpoint read for real took the memory: said so, and the declarative form is the way out
    with pytest.raises(EstimateError) as e:
        estimate_script("hogs_memory.py", "--checkpoint", limits=Limits(memory_bytes=2 * 2**30))
    assert e.value.kind == "limit" and "checkpoint files of 0.6 GiB (weights.pt (0.6 GiB))" in e.value.what
    assert "hf:./DIR" in e.value.fix


def test_sandbox_no_network_no_writes_outside_no_process_left(tmp_path):
    # a listener the script will try to reach: it must never see a connection
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    accepted = []

    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                accepted.append(srv.accept())
                return
            except socket.timeout:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    outside = tmp_path / "outside"
    outside.mkdir()
    marker = f"vest-test-{uuid.uuid4().hex}"
    before = set(os.listdir(SCRIPTS))
    env = {"VEST_TEST_PORT": str(port), "VEST_TEST_MARKER": marker, "VEST_TEST_OUTSIDE": str(outside)}
    (est,), run = estimate_script("probes_sandbox.py", env=env)
    assert run.steps == 3 and est.peak_bytes > 0
    stop.set()
    t.join()
    assert not accepted, "the estimate's child reached the network"
    assert list(outside.iterdir()) == [], "the child wrote outside its temp dir"
    assert set(os.listdir(SCRIPTS)) == before
    assert str(outside / "leak.txt") in run.redirected_writes
    assert procs_with(marker) == [], "a process of the estimate outlived it"
    stop.set()
    t.join()
    srv.close()


def test_tiny_script_logs_and_checkpoints_are_redirected():
    before = set(os.listdir(SCRIPTS))
    (est,), run = estimate_script("tiny_train.py")
    assert run.steps == 3 and run.batch_hint == 32
    assert set(os.listdir(SCRIPTS)) == before      # train.log and ckpt.pt went to the temp dir
    assert any(p.endswith("train.log") for p in run.redirected_writes)


def test_a_script_that_ends_by_itself_keeps_its_parameters_in_the_breakdown():
    """A script that ends after one step, before the steps the estimate asks for, frees its model
    and optimizer as it exits: the breakdown's parameters and optimizer state are those alive at
    the end of its last step (before: 0 and 0, though the JSON's names are a contract)."""
    params = 4 * (64 * 256 + 256 + 256 * 10 + 10)
    for args in ((), ("--steps", "1")):
        (est,), run = estimate_script("tiny_train.py", *args)
        b = dict(est.breakdown)
        assert run.steps == (1 if args else 3)
        assert b["parameters"] == params and b["optimizer_state"] == 2 * params


def test_vest_estimate_command_line_imports_no_torch_beside_the_script():
    """`vest estimate -- CMD`: the script runs (and imports torch) in its own process; the estimate's
    process replays its trace and names its optimizer without torch (before, naming the optimizer
    imported torch after the script had ended: 3 s of wall time on every script estimate)."""
    import json

    code = ("import sys, io, contextlib\nfrom vest_slurm.cli import main\n"
            "sys.argv = ['vest', 'estimate', '--gpu', 'a100-40gb', '--json', '--', 'python', 'tiny_train.py']\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try:\n        main()\n    except SystemExit as e:\n        assert not e.code, e.code\n"
            "print(out.getvalue())\nprint('torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=SCRIPTS, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, VEST_CACHE_DIR="off"))
    assert r.returncode == 0, r.stderr
    doc, imported = r.stdout.rsplit("\n", 2)[0], r.stdout.split()[-1]
    assert '"required_mib"' in doc and json.loads(doc)["workload"]["optimizer"] == "adam"
    assert imported == "False"


def test_vest_estimate_of_a_command_runs_under_the_sites_dynamic_limits(tmp_path):
    """`vest estimate -- CMD` with a site config runs the script under the site's [dynamic] limits,
    as vsbatch and vest check do (it ran under the defaults, and the limit error's advice, to ask the
    site, did nothing); --steps still wins."""
    import json

    site = tmp_path / "site.toml"
    site.write_text(open(TESTBED).read() + "\n[dynamic]\ntimeout_s = 300\nmemory_mib = 4096\nsteps = 2\n")

    def steps(*extra):
        r = subprocess.run([sys.executable, "-m", "vest_slurm.cli", "estimate", "--site-config", str(site), "--json",
                            *extra, "--", "python", "tiny_train.py"], cwd=SCRIPTS, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["workload"]["steps"]

    assert steps() == 2 and steps("--steps", "3") == 3


# ---- vsbatch and vest check on job scripts without #VEST lines ---------------------------------------

TESTBED = os.path.join(ROOT, "site-config", "testbed.toml")


def _job(tmp_path, name, command, *sbatch):
    import shutil

    for f in ("train_lm.py", "train_own_model.py"):
        shutil.copy(os.path.join(EXAMPLES, f), tmp_path / f)
    p = tmp_path / name
    p.write_text("\n".join(["#!/bin/bash", *(f"#SBATCH {o}" for o in sbatch), "srun " + command, ""]))
    return p


def test_vest_check_runs_the_training_command(tmp_path):
    job = _job(tmp_path, "own.sbatch", "python train_own_model.py --width 16 --image-size 64 --batch-size 8",
               "--gres=gpu:1")
    r = subprocess.run([sys.executable, "-m", "vest_slurm.cli", "check", "--site-config", TESTBED, "--json", job.name],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    import json

    doc = json.loads(r.stdout)
    assert "train_own_model.py" in doc["workload"]["model"] and doc["workload"]["batch_size"] == 8
    assert [g["gpu"] for g in doc["gpus"]] == ["v100", "a100", "h100"] and all(g["fits"] for g in doc["gpus"])
    assert doc["placement"]["action"] == "submit" and doc["placement"]["partition"] == "v100"


@pytest.mark.slurm
def test_vsbatch_places_a_script_by_its_training_command(slurm, tmp_path):
    """No #VEST line: the training command is run with fake CUDA; an fp32 GPT-2 that needs more than a
    V100's 16 GB goes to the A100 partition (held, so the test node never runs it)."""
    import json

    from vest_slurm.slurm.cluster import SlurmCLI

    job = _job(tmp_path, "lm.sbatch", "python train_lm.py --n-layer 12 --n-embd 768 --n-head 12 --seq-len 1024 "
               "--batch-size 8 --steps 10", "--gres=gpu:1", "--hold", "--time=5")
    r = subprocess.run(["vsbatch", "--site-config", TESTBED, "--json", job.name], cwd=tmp_path, env=slurm.env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert "running it with fake CUDA" in r.stderr
    assert d["action"] == "submit" and d["partition"] == "a100" and d["gres"] == "gpu:a100:1"
    assert d["estimates"]["v100"]["peak_mib"] > 16220
    rec = SlurmCLI(env=slurm.env).job(d["job_id"])
    assert rec is not None and rec.partition == "a100" and rec.tres_per_node == "gres:gpu:a100:1"
    subprocess.run(["scancel", str(d["job_id"])], env=slurm.env, timeout=10)


def test_loops_of_forwards_that_gpu_values_end_are_flagged_or_refused():
    """A loop of forward passes tested on GPU values (a fixed-point solve, a convergence break) ran
    as many times as stand-ins made it, the same in every step, with no flag: once (-51% on a
    DEQ-style repro) or to its cap (+153%). Each is flagged with the loop's line; a loop tested on
    values copied from the host is the job's own (no flag); one the stand-ins never end (an adaptive
    integrator whose steps are never accepted) is refused as data-dependent at the time limit,
    naming the loop, not "ask for a higher limit"."""
    for flag, line in (("--while", 18), ("--break", 27)):
        (est,), run = estimate_script("steered_loop_train.py", flag)
        assert run.steps == 3
        assert any(f"steered_loop_train.py:{line}" in f and "decided how many times it ran" in f for f in run.flags), \
            run.flags
    (est,), run = estimate_script("steered_loop_train.py", "--known")
    assert run.steps == 3 and not any("decided how many times" in f for f in run.flags), run.flags
    with pytest.raises(EstimateError) as e:
        estimate_script("steered_loop_train.py", "--adaptive", limits=Limits(timeout_s=20))
    assert e.value.kind == "data-dependent" and "steered_loop_train.py:39" in e.value.what, e.value.what
    assert "fixed count" in e.value.fix
    # torch.equal / allclose of GPU tensors: a NaN check of a tensor against itself passes, an
    # assert on allclose passes as a healthy run's does (they were refused as data-dependent)
    (est,), run = estimate_script("steered_loop_train.py")
    assert run.steps == 3


def test_older_amp_api_compile_and_value_reads():
    (est,), run = estimate_script("old_amp_api.py")
    assert run.steps == 3 and run.batch_hint == 8 and est.peak_bytes > 0


def test_torchrun_ddp_script_one_rank_of_the_world():
    """torchrun --nproc_per_node 2: rank 0 runs with a fake process group of world size 2; DDP's
    gradient buckets come from the script's own DDP, and NCCL's buffers are added per GPU."""
    cmd = parse_train_command("torchrun --nproc_per_node 2 ddp_train.py")
    (est,), run = estimate_command(cmd, [A100], cwd=SCRIPTS)
    b = dict(est.breakdown)
    assert run.steps == 3 and run.batch_hint == 16
    assert any(e.module == "ddp_buckets" for e in run.trace.events)
    assert b["nccl"] > 0
    params = (64 * 512 + 512 + 512 * 10 + 10) * 4
    assert b["parameters"] == params and b["optimizer_state"] == 2 * params


def test_object_collectives_run_on_the_fake_group():
    """gather_object, broadcast_object_list and scatter_object_list (torch.distributed.checkpoint's
    coordinator: the ranks' save plans gathered, the global one scattered): pickled into device
    tensors that carry no values here, they unpickled garbage and the script was blamed. Each
    rank holds what a healthy run's rank holds, every rank running the same script."""
    cmd = parse_train_command("torchrun --nproc_per_node 2 object_collectives_train.py")
    (est,), run = estimate_command(cmd, [A100], cwd=SCRIPTS)
    assert run.steps == 3 and dict(est.breakdown)["parameters"] == 4 * (64 * 64 + 64)


def test_a_gloo_group_beside_nccl_for_host_work_is_a_group_of_the_fake_world():
    """dist.new_group(backend="gloo") beside NCCL's (detectron2's comm.py, Lightning's
    rank_zero_first): barriers, object gathers and host reductions on it run, and get_backend names
    it gloo; a real gloo group met vest's fake store and crashed the child (exit 139). The estimate
    is the DDP one's: the side group holds nothing on the GPU."""
    for extra in ("", " --subgroups"):
        cmd = parse_train_command("torchrun --nproc_per_node 2 gloo_side_group_train.py" + extra)
        (est,), run = estimate_command(cmd, [A100], cwd=SCRIPTS)
        b = dict(est.breakdown)
        params = (64 * 512 + 512 + 512 * 10 + 10) * 4
        assert run.steps == 3 and b["parameters"] == params and b["optimizer_state"] == 2 * params, extra
        assert b["nccl"] > 0


def test_a_launcher_that_starts_torchrun_itself_is_estimated_as_that_launch():
    """A command that starts the training's launcher itself (``tune run --nproc_per_node 2 recipe``
    calls torch.distributed.run's run() in its process; LLaMA-Factory's CLI runs torchrun as a
    child): it was refused ("tried to start a process"). The estimate is that launch's, the same as
    the torchrun command run directly (in the launcher's working directory, with the variables it
    set), with a flag that names it."""
    (ref,), direct = estimate_command(parse_train_command("torchrun --nproc_per_node 2 ddp_train.py"), [A100], cwd=SCRIPTS)
    for how in ("inprocess", "child", "shell"):
        cmd = parse_train_command(f"python own_launcher.py --how {how} ddp_train.py --hidden 512")
        (est,), run = estimate_command(cmd, [A100], cwd=SCRIPTS)
        assert run.steps == 3 and dict(est.breakdown) == dict(ref.breakdown), how
        said = [f for f in run.flags if "started its training as" in f]
        assert len(said) == 1 and re.search(r"torch\.distributed\.run .*--nproc_per_node[= ]2 ", said[0]), run.flags
    # a launcher asked for a launch that fails: the launch's own error, named at its script
    with pytest.raises(EstimateError) as e:
        estimate_command(parse_train_command("python own_launcher.py --how child fails_by_itself.py"), [A100], cwd=SCRIPTS)
    assert e.value.kind == "script-error" and e.value.where.endswith("fails_by_itself.py:5")


def test_collectives_batched_in_a_coalescing_manager_run_on_the_fake_group():
    """dist._coalescing_manager (Megatron-LM's gradient buffers and distributed optimizer, DeepSpeed
    ZeRO) batches its collectives into c10d's coalesced ops, which had no fake kernel: the run
    stopped ("UnsupportedOperatorException: c10d.allreduce_coalesced_"). They write in place and
    allocate nothing, so the estimate is that of the tensors the script made."""
    cmd = parse_train_command("torchrun --nproc_per_node 2 coalesced_sync_train.py")
    (est,), run = estimate_command(cmd, [A100], cwd=SCRIPTS)
    params = (512 * 512 + 512 + 512 * 16 + 16) * 4
    assert run.steps == 3 and dict(est.breakdown)["parameters"] == params


def test_ddp_communication_hooks():
    """DDP's register_comm_hook (accelerate's comm_hook): the fp16 compression hook allreduces a
    half-precision copy of the bucket, held until the backward's end (one per step; the peak is
    the optimizer's, unchanged); PowerSGD is accepted and the estimate flagged (its buffers are not
    modelled). Before: AttributeError on the stand-in, blamed on the script."""
    def run(*extra):
        cmd = parse_train_command(["torchrun", "--nproc_per_node", "2", "ddp_train.py", "--hidden", "2048", *extra])
        (est,), r = estimate_command(cmd, [A100], cwd=SCRIPTS)
        return dict(est.breakdown), r

    plain, _ = run()
    fp16, r16 = run("--comm-hook", "fp16")
    numel = 64 * 2048 + 2048 + 2048 * 10 + 10
    assert r16.steps == 3 and r16.flags == ()
    copies = [i for i, e in enumerate(r16.trace.events) if e.action == "alloc" and e.size_bytes == 2 * numel]
    assert len(copies) == 3 and fp16["live_tensor_peak"] == plain["live_tensor_peak"]
    freed = {e.block for e in r16.trace.events if e.action == "free"}
    assert all(r16.trace.events[i].block in freed for i in copies)
    _, rp = run("--comm-hook", "powersgd")
    assert rp.steps == 3 and any("DDP communication hook powerSGD_hook" in f for f in rp.flags)


def test_building_a_huge_model_costs_no_host_memory():
    """8.6e9 parameters: 34 GB if they were real; the run stays under a 2 GiB memory limit."""
    (est,), run = estimate_script("huge_model.py", limits=Limits(memory_bytes=2 * 2**30))
    params = 2 * 65536 * 65536 * 4
    assert dict(est.breakdown)["parameters"] == params
    assert run.peak_rss_bytes < 2 * 2**30 and est.peak_bytes > 2 * params


NEEDS_NATIVE_BF16 = """import torch
if not torch.cuda.is_bf16_supported(including_emulation=False):
    raise RuntimeError("this job needs native bfloat16: an A100 or newer")
model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(torch.randn(8, 64, device="cuda")).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def _vsbatch_dry_run(tmp_path, job):
    import json

    r = subprocess.run(["vsbatch", "--site-config", TESTBED, "--dry-run", "--json", job.name], cwd=tmp_path,
                       env={**os.environ, "SLURM_CONF": str(tmp_path / "none.conf")},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_vsbatch_dry_run_skips_the_gpu_class_a_script_cannot_run_on(tmp_path):
    """A script that stops on a GPU without native bf16 (the testbed's V100, sm70): vsbatch places
    on the A100 and says why."""
    (tmp_path / "native_bf16.py").write_text(NEEDS_NATIVE_BF16)
    d = _vsbatch_dry_run(tmp_path, _job(tmp_path, "bf16.sbatch", "python native_bf16.py", "--gres=gpu:1"))
    assert d["action"] == "submit" and d["partition"] == "a100"
    assert "v100" not in d["estimates"] and any("v100" in w and "native bfloat16" in w for w in d["warnings"])


def test_bf16_autocast_runs_on_a_v100_as_pytorch_emulates_it(tmp_path):
    """torch.cuda.is_bf16_supported() is true on a V100 (bf16 is emulated there), so a bf16
    autocast script runs on it and is estimated there too; but emulated bf16 is slow, so vsbatch
    places it on the A100 while it fits there, and on the V100 only when asked, with a warning."""
    job = _job(tmp_path, "lm.sbatch", "python train_lm.py --n-layer 1 --n-embd 64 --n-head 2 --seq-len 32 "
               "--batch-size 2 --amp bf16", "--gres=gpu:1")
    d = _vsbatch_dry_run(tmp_path, job)
    assert {"v100", "a100"} <= set(d["estimates"]) and not any("cannot run" in w for w in d["warnings"])
    assert d["action"] == "submit" and d["partition"] == "a100" and "at full speed" in d["reasons"][0]
    fp16 = _job(tmp_path, "fp16.sbatch", "python train_lm.py --n-layer 1 --n-embd 64 --n-head 2 --seq-len 32 "
                "--batch-size 2 --amp fp16", "--gres=gpu:1")
    assert _vsbatch_dry_run(tmp_path, fp16)["partition"] == "v100"   # the smallest, where fp16 is fast
    # declared bf16, on the V100 the user chose: kept, with a warning that it runs emulated there
    declared = tmp_path / "declared.sbatch"
    declared.write_text("#!/bin/bash\n#SBATCH --gres=gpu:1\n#SBATCH --partition=v100\n#VEST --model "
                        "torchvision:resnet18 --batch-size 2 --input 3x64x64 --precision amp-bf16\nsrun python train.py\n")
    d = _vsbatch_dry_run(tmp_path, declared)
    assert d["partition"] == "v100" and any(w.startswith("v100: bf16 runs emulated") for w in d["warnings"])


def _same_as_declared(dyn, declared):
    (dec,) = estimate(parse_workload_args(declared.split()), [A100])
    d, c = breakdown(dyn), breakdown(dec)
    for part in ("parameters", "gradients", "optimizer_state"):
        assert d[part] == c[part] and c[part] > 0, (part, d[part], c[part])
    # These jobs are small (~300 MiB in the allocator): the script's own order of small allocations
    # can put the replay a 20 MiB segment (the large pool's unit under 10 MiB) or two away from
    # the declared loop's, more than 2% of their peak.
    tolerance = max(0.02 * dec.peak_bytes, 2 * 20 * 2**20)
    assert abs(dyn.peak_bytes - dec.peak_bytes) <= tolerance, (dyn.peak_bytes, dec.peak_bytes)


def test_optimizer_built_before_the_model_moves():
    """Fake parameters are new objects after .to('cuda'); the optimizer is pointed at them, so its
    gradients and state count as on a GPU (before the fix both were 0)."""
    (dyn,), run = estimate_script("optimizer_before_move.py", "--batch-size", "16")
    _same_as_declared(dyn, "--model torchvision:resnet18 --batch-size 16 --input 3x112x112 --optimizer adam")
    assert run.steps == 3


def test_accelerate_prepare_loop():
    (dyn,), run = estimate_script("accelerate_train.py", "--batch-size", "16", "--mixed-precision", "bf16")
    _same_as_declared(dyn, "--model torchvision:resnet18 --batch-size 16 --input 3x112x112 --optimizer adamw "
                           "--precision amp-bf16")
    assert run.steps == 3


def test_lightning_trainer_loop():
    (dyn,), run = estimate_script("lightning_train.py", "--batch-size", "16")
    _same_as_declared(dyn, "--model torchvision:resnet18 --batch-size 16 --input 3x112x112 --optimizer adam "
                           "--precision amp-bf16")
    assert run.steps == 3


def test_deep_copied_model_holds_a_second_set_of_weights():
    """copy.deepcopy of a fake-CUDA model (an EMA) clones its weights on the GPU: the same loop
    with the copy holds resnet18's weights (and BN buffers) once more."""
    (with_ema,), _ = estimate_script("ema_train.py", "--batch-size", "16")
    (without,), _ = estimate_script("ema_train.py", "--batch-size", "16", "--no-ema")
    weights = dict(without.breakdown)["parameters"]
    assert weights > 40 * 2**20
    # tensors alone (the allocator adds whole segments)
    extra = dict(with_ema.breakdown)["live_tensor_peak"] - dict(without.breakdown)["live_tensor_peak"]
    assert weights <= extra <= 1.01 * weights, (extra, weights)


def test_peft_lora_script_frozen_base_and_batch_from_keyword_inputs():
    """A LoRA job: gradients and AdamW states for the adapters only, the frozen base's weights
    resident; the batch is read from a model called with keyword arguments only."""
    (est,), run = estimate_script("lora_train.py")
    b = dict(est.breakdown)
    # Llama: embedding + untied head 2 x 1000 x 64, per layer q,o 64x64, k,v 64x32, MLP 3 x 64x128,
    # 2 RMSNorms of 64, and the final norm; LoRA r=4 on q (64->64) and v (64->32): A 4x64, B 64x4 / 32x4
    base = 2 * 1000 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    adapters = 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)
    assert run.steps == 3 and run.batch_hint == 6
    rotary = 2 * 8   # buffers: inv_freq and original_inv_freq, head_dim / 2 each
    assert b["parameters"] == 4 * (base + adapters + rotary)
    assert b["gradients"] == 4 * adapters and b["optimizer_state"] == 2 * 4 * adapters


def test_bitsandbytes_8bit_adamw_script():
    """A script's own bnb.optim.AdamW8bit: its 8-bit states (uint8 pairs and block absmax for tensors
    of 4,096 elements and more, fp32 below), as the declarative --optimizer adamw-8bit traces them."""
    (est,), run = estimate_script("bnb_train.py")
    sizes = [128 * 64, 64, 64 * 10, 10]
    assert run.steps == 3 and run.batch_hint == 16
    assert dict(est.breakdown)["optimizer_state"] == adam_8bit_state_bytes(sizes)


@pytest.mark.parametrize("eight_bit", [False, True])
def test_hf_trainer_script(eight_bit):
    """transformers' Trainer: its own loop, accelerate underneath, bf16 autocast; the model's weights
    and optimizer states exact (AdamW's; or, with optim="adamw_bnb_8bit" and gradient checkpointing,
    bitsandbytes' 8-bit ones), the batch from its keyword-only call."""
    before = set(os.listdir(SCRIPTS))
    (est,), run = estimate_script("hf_trainer_train.py", *(["--8bit"] if eight_bit else []))
    assert set(os.listdir(SCRIPTS)) == before   # its output_dir went to the temp dir
    b = dict(est.breakdown)
    # embedding and head 1000 x 64; per layer q, o 64x64, k, v 32x64, MLP 3 x 64x128, 2 norms; final norm
    sizes = [1000 * 64] * 2 + [64 * 64, 32 * 64, 32 * 64, 64 * 64, 64 * 128, 64 * 128, 64 * 128, 64, 64] * 2 + [64]
    buffers = 4 * 2 * 8   # rotary inv_freq and original_inv_freq
    assert run.steps == 3 and run.batch_hint == 6
    assert b["parameters"] == 4 * sum(sizes) + buffers
    if eight_bit:
        # the Trainer keeps nn.Embedding weights in 32-bit states (GlobalOptimManager override)
        states = adam_8bit_state_bytes(sizes[1:], fp32_sizes=sizes[:1])
    else:
        states = 2 * 4 * sum(sizes)
    assert b["optimizer_state"] == states


ASKS_THE_NAME = """import torch
from torch import nn
name = torch.cuda.get_device_name()   # a script may pick its settings by the GPU: a question per class
model = nn.Linear(64, 10).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    opt.zero_grad()
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
"""


def test_a_script_runs_once_for_the_gpu_classes_that_answer_its_questions_alike(tmp_path, monkeypatch):
    """trace_command runs the script on the newest class first; another class whose GPUs answer
    every GPU-dependent question that run asked alike (trace.holds_on) takes its trace; a script
    that read the device's name runs on each class."""
    import vest_slurm.dynamic.runner as runner

    runs = []
    real = runner.run_dynamic

    def counting(cmd, profile, *a, **k):
        runs.append(profile.capability)
        return real(cmd, profile, *a, **k)

    monkeypatch.setattr(runner, "run_dynamic", counting)
    V100 = get_profile("v100-16gb")
    _, summaries, run = runner.trace_command(parse_train_command(["python", "tiny_train.py"]), [V100, A100],
                                             cwd=SCRIPTS)
    assert runs == [(8, 0)] and summaries[True] is summaries[False]
    assert run.trace.gpu_asked == ()   # an fp32 MLP asks nothing of the GPU
    runs.clear()
    (tmp_path / "asks.py").write_text(ASKS_THE_NAME)
    _, summaries, run = runner.trace_command(parse_train_command(["python", "asks.py"]), [V100, A100],
                                             cwd=str(tmp_path))
    assert runs == [(8, 0), (7, 0)] and summaries[True] is not summaries[False]
    assert ("device_name", None, None) in run.trace.gpu_asked


def _estimate_in(folder, *command):
    return estimate_command(parse_train_command(list(command)), [A100], cwd=str(folder))


def test_a_module_the_python_lacks_is_the_users_environment_named_with_that_python(tmp_path):
    (tmp_path / "train.py").write_text("import torch\nimport vest_no_such_package_xyz\n")
    with pytest.raises(EstimateError) as e:
        _estimate_in(tmp_path, "python", "train.py")
    msg = str(e.value)
    assert "imports 'vest_no_such_package_xyz'" in msg and sys.executable in msg and "train.py:2" in msg
    assert e.value.kind == "script-error" and "pip install" in e.value.fix and "environment the job activates" in e.value.fix
    assert "fix the script" not in msg


def test_a_name_the_installed_version_lacks_names_that_version_and_the_scripts_pin(tmp_path):
    from importlib import metadata

    (tmp_path / "requirements.txt").write_text("torch>=1.13\ntoml==0.9.0   # the version it was written for\n")
    (tmp_path / "train.py").write_text("import torch\nfrom toml import vest_no_such_name\n")
    with pytest.raises(EstimateError) as e:
        _estimate_in(tmp_path, "python", "train.py")
    msg = str(e.value)
    assert f"imports 'vest_no_such_name' from toml" in msg and f"toml {metadata.version('toml')}" in msg
    assert "requirements.txt asks for toml==0.9.0" in msg and e.value.kind == "script-error"


def test_a_name_exported_only_with_an_optional_dependency_names_that_dependency(tmp_path):
    """accelerate.utils exports DummyOptim only `if is_deepspeed_available()`: the name is missing
    because deepspeed is, not because of accelerate's version. Both ways libraries guard an
    integration: the test of an if (the guarded module imports; the test names the package) and an
    import whose ImportError is ignored (the guarded module's own import says what is missing)."""
    pkg = tmp_path / "vest_optlib"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import importlib.util\n"
        "def is_vest_fancy_dep_available():\n"
        "    return importlib.util.find_spec('vest_fancy_dep') is not None\n"
        "from .core import plain\n"
        "if is_vest_fancy_dep_available():\n"
        "    from .fancy import FancyOptim\n"
        "try:\n"
        "    from .other import OtherThing\n"
        "except ImportError:\n"
        "    pass\n")
    (pkg / "core.py").write_text("plain = 1\n")
    (pkg / "fancy.py").write_text("class FancyOptim:\n    pass\n")
    (pkg / "other.py").write_text("import vest_other_dep_xyz\nclass OtherThing:\n    pass\n")
    (tmp_path / "train.py").write_text("import torch\nfrom vest_optlib import plain, FancyOptim\n")
    with pytest.raises(EstimateError) as e:
        _estimate_in(tmp_path, "python", "train.py")
    msg = str(e.value)
    assert "exports only under a condition (`if is_vest_fancy_dep_available()`" in msg, msg
    assert "vest_optlib/__init__.py:5" in msg and "vest_fancy_dep, which it needs for that, is not installed" in msg
    assert "install vest_fancy_dep" in e.value.fix and e.value.kind == "script-error"
    assert "does not have" not in msg and "make the script work with" not in e.value.fix
    (tmp_path / "train.py").write_text("import torch\nfrom vest_optlib import OtherThing\n")
    with pytest.raises(EstimateError) as e:
        _estimate_in(tmp_path, "python", "train.py")
    msg = str(e.value)
    assert "(`an import whose ImportError is ignored`" in msg and "vest_optlib/__init__.py:7" in msg, msg
    assert "vest_other_dep_xyz, which it needs for that, is not installed" in msg


JIT_SCRIPTED = """import torch, torch.nn as nn

@torch.jit.script
def hard_sigmoid_bwd(x, g):
    return g * torch.ones_like(x) * ((x >= -3.0) & (x <= 3.0)) / 6.0 + torch.zeros(x.shape, device=x.device)

class HardSigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x + 3).clamp(min=0, max=6) / 6

    @staticmethod
    def backward(ctx, g):
        return hard_sigmoid_bwd(ctx.saved_tensors[0], g)

model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    x = torch.randn(64, 512, device="cuda")
    loss = model[1](HardSigmoid.apply(model[0](x))).sum()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_torchscript_functions_calling_torch_factories_compile_and_run_on_the_device(tmp_path):
    """``@torch.jit.script`` code calling torch.ones_like / torch.zeros (timm < 1.0's activations,
    scripted at `import timm`): the stand-ins in those functions' places (pin_memory dropped) were
    not TorchScript builtins, and scripting failed, blamed on the script. The scripted backward's
    tensors are the device's."""
    def events(source):
        (tmp_path / "train.py").write_text(source)
        _, run = _estimate_in(tmp_path, "python", "train.py")
        assert run.batch_hint == 64
        return [(e.action, e.size_bytes, e.phase) for e in run.trace.events]
    scripted = events(JIT_SCRIPTED)
    assert scripted == events(JIT_SCRIPTED.replace("@torch.jit.script\n", ""))   # as run eagerly
    assert sum(1 for a, size, phase in scripted if a == "alloc" and size == 64 * 1024 * 4 and phase == "backward") >= 15


CHECKS_ON_DEVICE_VALUES = """import torch, torch.nn as nn

def xyxy(b):
    cx, cy, w, h = b.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)

def check(p):
    assert (p[:, 2:] >= p[:, :2]).all()
    assert not torch.isnan(p).any() and (p <= 2).all(), f"bad boxes {p.shape}"
    if not (p >= -1).all():
        raise ValueError(f"boxes below -1: {p.min()}")

head = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)).cuda()
opt = torch.optim.AdamW(head.parameters())
for step in range(4):
    p = xyxy(head(torch.randn(64, 256, device="cuda")).sigmoid())
    check(p)
    if (p > 0.5).all():   # a branch of the program, no check: the stand-in (False) as before
        p = torch.cat([p, torch.zeros(4096, 4, device="cuda")])
    loss = p.abs().sum()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_checks_a_healthy_run_passes_pass_on_stand_in_values_other_branches_do_not(tmp_path):
    """``assert (x2 >= x1).all()`` on the model's output (DETR's box checks) read the stand-in
    False and was refused as data-dependent: a check that raises on a broken run is passed, as a
    healthy run passes it (assert, assert not, a chained and, `if bad: raise`). A branch that does
    not raise keeps the stand-in (its body, a 4096-row concatenation, is not traced)."""
    (tmp_path / "train.py").write_text(CHECKS_ON_DEVICE_VALUES)
    _, run = _estimate_in(tmp_path, "python", "train.py")
    assert run.batch_hint == 64
    sizes = {e.size_bytes for e in run.trace.events if e.action == "alloc"}
    assert (64 + 4096) * 4 * 4 not in sizes


EXTENSION_C = r"""#include <Python.h>
/* a custom kernel's binding: it checks it was given a CUDA tensor, as TORCH_CHECK(x.is_cuda()) does
   in C++ (where a fake tensor is no CUDA tensor), then would launch on its data */
static PyObject* fused_bias_act(PyObject* self, PyObject* args) {
    PyErr_SetString(PyExc_RuntimeError, "fused_bias_act: CUDA tensor expected");
    return NULL;
}
static PyMethodDef methods[] = {{"fused_bias_act", fused_bias_act, METH_VARARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "vest_fused_ext", NULL, -1, methods};
PyMODINIT_FUNC PyInit_vest_fused_ext(void) { return PyModule_Create(&module); }
"""

EXTENSION_SCRIPT = """import importlib.util, torch, torch.nn as nn
spec = importlib.util.spec_from_file_location("vest_fused_ext", "ext/vest_fused_ext.so")
ext = importlib.util.module_from_spec(spec)   # as cpp_extension.load does: not in sys.modules
spec.loader.exec_module(ext)

class FusedAct(nn.Module):
    def forward(self, x):
        return ext.fused_bias_act(x) if x.is_cuda else x.relu()

model = nn.Sequential(nn.Linear(64, 64), FusedAct()).cuda()
model(torch.randn(8, 64, device="cuda")).sum().backward()
"""


def test_custom_cuda_kernels_are_vests_limit_named_with_what_to_do(tmp_path):
    """A compiled extension's function given the GPU's tensors (StyleGAN2's fused_act, every
    repository's own kernels: its C++ checks x.is_cuda() or takes data_ptr()), and a CUDA extension
    built at run time whose build fails here: both were "the script failed ... fix the script".
    They run on a GPU node; vest cannot run them on fake tensors: said as vest's limit, naming the
    extension, with what the user can do instead."""
    import sysconfig

    (tmp_path / "ext").mkdir()
    (tmp_path / "ext" / "fused.c").write_text(EXTENSION_C)
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    subprocess.run([*cc, "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", "-o",
                    str(tmp_path / "ext" / "vest_fused_ext.so"), str(tmp_path / "ext" / "fused.c")], check=True)
    (tmp_path / "train.py").write_text(EXTENSION_SCRIPT)
    with pytest.raises(EstimateError) as e:
        _estimate_in(tmp_path, "python", "train.py")
    msg = str(e.value)
    assert "vest cannot run custom CUDA kernels (at vest_fused_ext.fused_bias_act) at train.py:8" in msg, msg
    assert e.value.kind == "vest-unsupported" and "vest monitor" in e.value.fix and "fix the script" not in msg
    (tmp_path / "train.py").write_text("import torch\nfrom torch.utils.cpp_extension import load\n"
                                       "fused = load(name='fused_act', sources=['fused_act.cpp'])\n")
    (tmp_path / "fused_act.cpp").write_text("int broken(;\n")
    with pytest.raises(EstimateError) as e:
        _estimate_in(tmp_path, "python", "train.py")
    msg = str(e.value)
    assert "(at torch.utils.cpp_extension.load) at train.py:3" in msg and "whose build failed here" in msg, msg
    assert e.value.kind == "vest-unsupported"


def test_an_error_of_host_data_is_the_scripts_not_vests(tmp_path):
    """An index out of range in the script's host data (a malformed graph data set: torch_geometric's
    batch[row]) raised inside the fake mode's real run of host ops, and was said as vest's gap."""
    (tmp_path / "train.py").write_text(
        "import torch\nnode_graph = torch.tensor([0, 0, 1])\nedges = torch.tensor([0, 1, 3])\n"
        "graph_of_edge = node_graph[edges]\nmodel = torch.nn.Linear(8, 2).cuda()\n")
    with pytest.raises(EstimateError) as e:
        _estimate_in(tmp_path, "python", "train.py")
    assert e.value.kind == "script-error" and "the script failed at train.py:4: IndexError" in str(e.value), str(e.value)


def test_a_version_check_that_fails_names_the_installed_version_not_the_script(tmp_path):
    """``assert timm.__version__ == "0.3.2"`` (MAE's main_pretrain.py): the environment's version is
    another than the script's, as with a name the installed version lacks; not "fix the script"."""
    from importlib import metadata

    (tmp_path / "train.py").write_text("import torch\nimport toml as t\nassert t.__version__ == '0.0.1'\n")
    with pytest.raises(EstimateError) as e:
        _estimate_in(tmp_path, "python", "train.py")
    msg = str(e.value)
    assert f"checks the version of toml at train.py:3" in msg and f"toml {metadata.version('toml')}" in msg, msg
    assert "fix the script" not in msg and "environment the job activates" in e.value.fix


def test_a_command_run_by_another_python_says_to_run_vest_from_it(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    (tmp_path / "train.py").write_text("import vest_no_such_package_xyz\n")
    venv_python = str(tmp_path / "venv" / "bin" / "python")
    with pytest.raises(EstimateError) as e:
        _estimate_in(tmp_path, venv_python, "train.py")
    # a venv without torch: the script ran in vest's Python, and the fix says why not in the venv's
    assert f"another Python ({venv_python}, which has no torch that imports)" in e.value.fix
    assert "install vest-slurm there" in e.value.fix


def test_other_python_tells_a_link_to_this_python_from_a_venv(tmp_path):
    from vest_slurm.estimate.cudnn_ws import other_python

    link = tmp_path / "python"
    link.symlink_to(os.path.realpath(sys.executable))   # another name for the base interpreter
    # this Python where it is not a venv's; where it is, the link runs the base environment
    assert other_python(str(link)) == (None if sys.prefix == sys.base_prefix else str(link))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    venv_python = str(tmp_path / "venv" / "bin" / "python")   # a link to the base interpreter, yet a venv
    assert other_python(venv_python) == venv_python


def test_a_launcher_behind_a_version_managers_shim_runs_in_the_python_it_resolves_to(tmp_path):
    """``torchrun`` on PATH as pyenv's shim (a bash script ending in ``exec pyenv exec "$program"``):
    its Python is the one the manager resolves it to (``pyenv which torchrun``), not vest's own,
    which ran the job's command with other packages, silently. Another shell wrapper: its Python
    is not known here, and the estimate says so."""
    from vest_slurm.dynamic.launch import parse_train_command
    from vest_slurm.dynamic.runner import script_python
    from vest_slurm.estimate.cudnn_ws import other_python

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    venv_python = str(tmp_path / "venv" / "bin" / "python")
    real = tmp_path / "venv" / "bin" / "torchrun"
    real.write_text(f"#!{venv_python}\nimport sys\n")
    manager, shims = tmp_path / "manager", tmp_path / "shims"
    manager.write_text(f'#!/bin/sh\n[ "$1" = which ] && echo {tmp_path}/venv/bin/$2\n')
    shims.mkdir()
    (shims / "torchrun").write_text('#!/usr/bin/env bash\nset -e\nprogram="${0##*/}"\n'
                                    f'exec "{manager}" exec "$program" "$@"\n')
    wrappers = tmp_path / "wrappers"
    wrappers.mkdir()
    (wrappers / "torchrun").write_text('#!/bin/bash\nexec python -m torch.distributed.run "$@"\n')
    for f in (real, manager, shims / "torchrun", wrappers / "torchrun"):
        f.chmod(0o755)
    path = f"{shims}{os.pathsep}{os.environ['PATH']}"
    assert other_python("torchrun", path, str(tmp_path)) == venv_python
    path = f"{wrappers}{os.pathsep}{os.environ['PATH']}"
    python, theirs, why = script_python(parse_train_command([f"PATH={path}", "torchrun", "train.py"]), str(tmp_path))
    assert python == sys.executable and theirs == str(wrappers / "torchrun") and "shell script" in why


_TINY_TRAIN = """import torch
from torch import nn
{imports}
model = nn.Sequential(nn.Linear(64, {width}), nn.ReLU(), nn.Linear({width}, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    x = torch.randn(32, 64, device="cuda")
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def _venv(path, system_site_packages: bool, files: dict | None = None) -> str:
    """A real venv (its own environment), with ``files`` written into its site-packages."""
    argv = [sys.executable, "-m", "venv", "--without-pip", str(path)] + (["--system-site-packages"] if system_site_packages else [])
    subprocess.run(argv, check=True)
    site = path / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    for name, text in (files or {}).items():
        (site / name).write_text(text)
    return str(path / "bin" / "python")


def test_the_script_runs_in_the_jobs_own_python_with_its_packages(tmp_path):
    from vest_slurm.estimate.trace import JOB_PYTHON_NOTE

    # a package only the job's venv has (vest's Python lacks it: that run would fail)
    python = _venv(tmp_path / "venv", True, {"jobonly_width.py": "WIDTH = 4096\n"})
    (tmp_path / "train.py").write_text(_TINY_TRAIN.format(imports="from jobonly_width import WIDTH", width="WIDTH"))
    (est,), run = _estimate_in(tmp_path, python, "train.py")
    assert any(n.startswith(f"{JOB_PYTHON_NOTE} ({python}, torch {torch.__version__})") for n in run.trace.notes)
    assert run.flags == () and run.steps == 3
    # the job's package decided the model: 64x4096 + 4096x10 parameters, fp32
    assert dict(est.breakdown)["parameters"] == (64 * 4096 + 4096 + 4096 * 10 + 10) * 4
    with pytest.raises(EstimateError, match="imports 'jobonly_width'"):
        _estimate_in(tmp_path, "python", "train.py")   # vest's own Python has no such package


def test_a_job_python_vest_cannot_run_in_is_said_and_the_estimate_flagged(tmp_path):
    (tmp_path / "train.py").write_text(_TINY_TRAIN.format(imports="", width=128))
    # no torch at all in the job's venv: the script runs in vest's Python, flagged
    bare = _venv(tmp_path / "bare", False)
    (_,), run = _estimate_in(tmp_path, bare, "train.py")
    assert any(f"the job's Python ({bare}) has no torch that imports" in f and "vest's Python" in f for f in run.flags)
    # a torch there, but vest's fake CUDA does not import under it (as under a torch too old or too new
    # for it): run again in vest's Python, flagged with why
    breaks = ("import sys\nclass _No:\n    def find_spec(self, name, path=None, target=None):\n"
              "        if name == 'vest_slurm.estimate._fakecuda':\n            raise ImportError('not under this torch')\n"
              "sys.meta_path.insert(0, _No())\n")
    odd = _venv(tmp_path / "odd", True, {"sitecustomize.py": breaks})
    (_,), run = _estimate_in(tmp_path, odd, "train.py")
    assert any(f"the job's Python ({odd}) did not run vest's fake CUDA" in f for f in run.flags), run.flags


_SPAWN_TRAIN = """import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn

def main_worker(gpu, ngpus):
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", world_size=ngpus, rank=gpu)
    torch.cuda.set_device(gpu)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(256, 2048), nn.ReLU(),
                                                              nn.Linear(2048, 10)).cuda(gpu), device_ids=[gpu])
    opt = torch.optim.Adam(model.parameters())
    for _ in range(5):
        x = torch.randn(64, 256, device=gpu)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

if __name__ == "__main__":
    ngpus = torch.cuda.device_count()
    {launch}
"""


def test_a_script_that_spawns_its_ranks_runs_rank_0_here(tmp_path):
    """mp.spawn(main_worker, nprocs=GPUs): rank 0 runs in the estimate's process, as if the script
    had called main_worker(0, ...) itself (a real spawn starts Pythons without the fake CUDA)."""
    for name, launch in (("spawn.py", "mp.spawn(main_worker, nprocs=ngpus, args=(ngpus,))"),
                         ("start.py", "mp.start_processes(main_worker, args=(ngpus,), nprocs=ngpus, join=False).join()"),
                         ("direct.py", "main_worker(0, ngpus)")):
        (tmp_path / name).write_text(_SPAWN_TRAIN.replace("{launch}", launch))
    runs = {name: estimate_command(parse_train_command(["python", name]), [A100], num_gpus=2, cwd=str(tmp_path))
            for name in ("spawn.py", "start.py", "direct.py")}
    (direct,), _ = runs["direct.py"]
    for name in ("spawn.py", "start.py"):
        (est,), run = runs[name]
        assert run.steps == 3 and est.peak_bytes == direct.peak_bytes, name
        assert dict(est.breakdown) == dict(direct.breakdown), name


def test_srun_gives_the_script_its_first_tasks_slurm_variables(tmp_path):
    """Scripts written for Slurm take rank and world from srun's variables; the estimate runs rank
    0 as srun starts it. The model's width here is 64 x SLURM_NTASKS, its parameters say what it read."""
    (tmp_path / "train.py").write_text(
        "import os, torch, torch.distributed as dist\nfrom torch import nn\n"
        "rank, world, local = int(os.environ['SLURM_PROCID']), int(os.environ['SLURM_NTASKS']), int(os.environ['SLURM_LOCALID'])\n"
        "assert rank == 0 and local == 0 and os.environ['SLURM_NODELIST']\n"
        "nodes = int(os.environ['SLURM_NNODES'])\n"
        "dist.init_process_group('nccl', rank=rank, world_size=world, init_method='tcp://127.0.0.1:29518')\n"
        "torch.cuda.set_device(local)\n"
        "model = nn.parallel.DistributedDataParallel(nn.Linear(16, 64 * world + nodes).cuda(), device_ids=[local])\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(5):\n"
        "    model(torch.randn(8, 16, device='cuda')).sum().backward()\n"
        "    opt.step()\n    opt.zero_grad()\n")
    for srun, gpus, width in ((["srun"], 4, 64 * 4 + 1),                                   # one task per GPU
                              (["srun", "-n", "8", "--ntasks-per-node", "4"], 8, 64 * 8 + 2),
                              (["srun", "--ntasks-per-node=2", "-N", "3"], 6, 64 * 6 + 3)):
        (est,), run = estimate_command(parse_train_command(srun + ["python", "train.py"]), [A100], num_gpus=gpus,
                                       cwd=str(tmp_path))
        assert dict(est.breakdown)["parameters"] == (16 * width + width) * 4, srun
    # without srun nothing sets them: the script sees the user's own environment, where they are not
    with pytest.raises(EstimateError, match="SLURM_PROCID"):
        estimate_command(parse_train_command(["python", "train.py"]), [A100], num_gpus=4, cwd=str(tmp_path))


def test_fabric_run_launches_its_devices_with_its_settings():
    """`fabric run --devices 2 --precision bf16-mixed`: two ranks (DDP's buckets, NCCL), bf16 autocast,
    as the script's Fabric() reads them from the launcher (it was "not a Python training command")."""
    cmd = parse_train_command("fabric run --devices 2 --precision bf16-mixed fabric_train.py")
    (est,), run = estimate_command(cmd, [get_profile("a100-40gb")], cwd=SCRIPTS)
    assert run.steps == 3 and run.batch_hint == 32
    assert dict(run.observed)["precision"] == "amp-bf16"
    assert any(e.module == "ddp_buckets" for e in run.trace.events)
    assert dict(est.breakdown)["nccl"] > 0


def test_a_packages_console_script_runs_as_the_python_file_it_is(tmp_path):
    """A console script (pip's wrapper of an entry point: ``yolo train ...``, ``litgpt finetune``)
    is a Python file on PATH: it runs as one, with the Python its first line names; a shell shim of
    the same name earlier on PATH (pyenv's) is passed over. In a job script it is the training
    command only where no Python file or module is run and it is no setup tool (pip, wandb, ...)."""
    from vest_slurm.dynamic.launch import find_train_command

    shims, bin_ = tmp_path / "shims", tmp_path / "bin"
    shims.mkdir()
    bin_.mkdir()
    (shims / "tinytrain").write_text('#!/usr/bin/env bash\nexec pyenv exec "$0" "$@"\n')
    (bin_ / "tiny_entry.py").write_text(
        "import runpy\n\ndef main():\n"
        f"    runpy.run_path({os.path.join(SCRIPTS, 'tiny_train.py')!r}, run_name='__main__')\n")
    (bin_ / "tinytrain").write_text(f"#!{sys.executable}\nimport sys\nfrom tiny_entry import main\n"
                                    "if __name__ == '__main__':\n    sys.exit(main())\n")
    path = f"PATH={shims}{os.pathsep}{bin_}"
    cmd = parse_train_command(f"{path} tinytrain --steps 2")
    assert cmd.script == str(bin_ / "tinytrain") and cmd.program == sys.executable and cmd.args == ("--steps", "2")
    (est,), run = estimate_command(cmd, [A100], cwd=str(tmp_path))
    assert run.steps == 2 and dict(est.breakdown)["parameters"] == 4 * (64 * 256 + 256 + 256 * 10 + 10)
    job = [f"{path} pip install -r requirements.txt", f"{path} tinytrain --steps 2"]
    assert find_train_command(job).script == str(bin_ / "tinytrain")
    assert find_train_command(job + ["python train.py"]).script == "train.py"
    with pytest.raises(WorkloadError, match="not a Python training command"):
        parse_train_command(f"{path} nosuchtool --x")


def test_a_scripts_optimizer_is_named_by_the_settings_that_decide_its_state():
    """The workload block (and the per-rank FSDP model) names a script's optimizer by --optimizer's
    table: the entry of its class whose state-deciding settings it has (momentum, amsgrad, centered),
    the most specific; None where two fit equally or the class is not torch's (an "Adam" of another
    package may keep other state)."""
    import torch

    from vest_slurm.dynamic.fake_dist import describe_optimizer
    from vest_slurm.estimate.workload import optimizer_name

    p = [torch.nn.Parameter(torch.zeros(2))]
    named = {name: optimizer_name(describe_optimizer(o)) for name, o in {
        "sgd": torch.optim.SGD(p, lr=0.1), "sgd-momentum": torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adamw-amsgrad": torch.optim.AdamW(p, amsgrad=True), "adam": torch.optim.Adam(p),
        "rmsprop-centered": torch.optim.RMSprop(p, centered=True), "both": torch.optim.RMSprop(p, momentum=0.9, centered=True),
        "adafactor": torch.optim.Adafactor(p)}.items()}
    assert named.pop("both") is None
    assert named == {k: k for k in named}
    assert optimizer_name({"class": "Adam", "module": "someones.optim"}) is None
    assert optimizer_name({"class": "AdamW8bit", "module": "bitsandbytes.optim.adamw"}) == "adamw-8bit"


def test_fp32_master_weights_the_script_fills_gradients_of_are_not_taken_for_frozen():
    """Master weights kept by hand (Megatron --bf16, apex O2, fairseq's FP16Optimizer): the optimizer
    holds detached fp32 copies (requires_grad=False) whose gradients the script fills each step.
    They are trained, not frozen: the flag said unfreezing them would need 61 MiB more."""
    (est,), run = estimate_script("master_weights_train.py")
    assert run.steps == 3 and not [f for f in run.flags if "frozen" in f], run.flags
    master = 4 * (1024 * 1024 + 1024) * 4
    assert dict(est.breakdown)["optimizer_state"] == 2 * master


def test_parameters_frozen_in_an_optimizer_are_flagged_with_what_unfreezing_adds():
    """A script that trains in stages (backbone frozen, unfrozen after some epochs) is traced in its
    first stage: the optimizer holds the frozen parameters, whose gradients and Adam state a later
    stage adds; the estimate says so with the size (before: the first stage's figure, unflagged).
    An optimizer over the trainable parameters alone (a permanent freeze, LoRA) is not flagged."""
    frozen = (256 * 1024 + 1024) + (1024 * 1024 + 1024)   # the backbone's elements, fp32
    (est,), run = estimate_script("staged_finetune_train.py")
    note = [f for f in run.flags if "frozen" in f]
    assert len(note) == 1 and "holds 4 parameter tensor(s)" in note[0], run.flags
    assert f"({frozen * 4 / 2**20:,.0f} MiB)" in note[0] and f"about {frozen * 4 * 3 / 2**20:,.0f} MiB more" in note[0]
    assert dict(est.breakdown)["optimizer_state"] == 2 * 4 * (1024 * 10 + 10)   # the head's, as traced
    (_, ), alone = estimate_script("staged_finetune_train.py", "--head-only-optimizer")
    assert not [f for f in alone.flags if "frozen" in f]
    # bf16 weights: torch's Adam keeps its states in the parameters' dtype (zeros_like), so the
    # stage adds 3x the weights' bytes there too, not gradients plus fp32 states (5x)
    (_, ), half = estimate_script("staged_finetune_train.py", "--bf16")
    note = [f for f in half.flags if "frozen" in f]
    assert len(note) == 1 and f"about {frozen * 2 * 3 / 2**20:,.0f} MiB more" in note[0], note
    # a frozen parameter fixed by design (random Fourier features, 32 floats): what unfreezing it
    # would add is below the allocator's smallest segment; no flag
    (_, ), fourier = estimate_script("fourier_features_train.py")
    assert not fourier.flags, fourier.flags
    (_, ), unfrozen = estimate_script("staged_finetune_train.py", "--unfreeze-at", "0")
    assert not [f for f in unfrozen.flags if "frozen" in f]
    # frozen for good and kept by the script (a momentum encoder): not a stage to come
    (_, ), momentum = estimate_script("staged_finetune_train.py", "--unfreeze-at", "99", "--momentum")
    assert not [f for f in momentum.flags if "frozen" in f]


def test_the_run_waits_for_every_optimizer_to_step_and_says_when_one_never_did():
    """A critic stepped n_critic = 5 times per generator step: stopped at the first 3 steps (the
    critic's), the generator's Adam state and gradients were missing without a word. The run goes on
    until the generator has stepped; one that steps later than WAIT_FOR_OPTIMIZERS times the steps
    is flagged with its size."""
    from vest_slurm.dynamic.standins import WAIT_FOR_OPTIMIZERS

    g = (64 * 512 + 512) + (512 * 1024 + 1024)
    d = (1024 * 128 + 128) + (128 + 1)
    (est,), run = estimate_script("critic_steps_train.py")
    assert run.steps == 6 and dict(est.breakdown)["optimizer_state"] == 2 * 4 * (g + d)
    assert not [f for f in run.flags if "did not step" in f]
    late = 3 * WAIT_FOR_OPTIMIZERS + 1
    (est,), run = estimate_script("critic_steps_train.py", "--n-critic", str(late))
    assert run.steps == 3 * WAIT_FOR_OPTIMIZERS and dict(est.breakdown)["optimizer_state"] == 2 * 4 * d
    note = [f for f in run.flags if "did not step" in f]
    assert len(note) == 1 and f"over {g * 4 / 2**20:,.0f} MiB of parameters" in note[0] and "(Adam" in note[0]


def test_backward_passes_before_any_optimizer_are_a_phase_of_their_own():
    """Gradients estimated at batch 2 before the optimizer is made, then training at batch 64 with two
    micro-batches per step: the workload is the training's (batch 64, accumulation 2), not the first
    forward's batch with every earlier backward counted as accumulation (before: batch 2, 6, and a
    flag that the estimate was for batch 2)."""
    import json

    r = subprocess.run([sys.executable, "-m", "vest_slurm.cli", "estimate", "--gpu", "a100-40gb", "--json", "--",
                        "python", "pre_phase_train.py", "--batch-size", "64"], cwd=SCRIPTS, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, VEST_CACHE_DIR="off"))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["workload"]["batch_size"], doc["workload"]["grad_accum"]) == (64, 2)
    assert not [f for f in doc.get("flags") or () if "batch" in f], doc.get("flags")


def test_the_run_goes_on_to_the_epochs_end_where_the_script_evaluates():
    """After its traced steps the run ends the training loader's epoch and goes on: the evaluation
    at batch 256 under no_grad (the first conv's output alone 32 MiB) is in the estimate, as it is in
    the job's peak; the next epoch's training forward ends the run. Before: the run stopped at the
    third step and the estimate was the training's (about 1 MiB of tensors), unflagged. Where the
    epoch's end fails here, the traced steps stand and the estimate says what was not traced."""
    from vest_slurm.dynamic.standins import DRAIN_BATCHES

    conv1 = 256 * 32 * 32 * 32 * 4
    (est,), run = estimate_script("epoch_end_eval_train.py")
    b = dict(est.breakdown)
    assert run.steps == 3 and b["live_tensor_peak"] >= conv1
    assert b["live_tensor_peak_steps"] < conv1 / 8   # the training's own, beside (batch 4)
    assert not [f for f in run.flags if "end of the epoch" in f]
    evals = [e for e in run.trace.events if e.action == "alloc" and e.size_bytes == conv1]
    assert 2 <= len(evals) <= 2 * DRAIN_BATCHES   # conv and ReLU outputs; 8 batches cut to the first ones
    (est,), run = estimate_script("epoch_end_eval_train.py", "--prefetch")   # the batch fetched ahead: trained
    assert run.steps == 3 and dict(est.breakdown)["live_tensor_peak"] >= conv1   # (at the epoch's end)
    (est,), run = estimate_script("epoch_end_eval_train.py", "--eval-fails")
    note = [f for f in run.flags if "end of the epoch" in f]
    assert len(note) == 1 and "the evaluation's metric failed" in note[0] and "epoch_end_eval_train.py:" in note[0]
    assert dict(est.breakdown)["live_tensor_peak"] >= conv1
