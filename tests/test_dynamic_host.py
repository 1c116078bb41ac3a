"""Dynamic analysis, host code real and GPU fake: each class of script the first version failed
on (issue 23), with a script written in that style (tests/data/scripts)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from vest_slurm.dynamic.launch import parse_train_command
from vest_slurm.dynamic.runner import estimate_command
from vest_slurm.errors import EstimateError
from vest_slurm.estimate.profiles import get_profile
from vest_slurm.estimate.trace import CUDNN_RNN_NOTE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "data", "scripts")
A100 = get_profile("a100-40gb")


def estimate_script(name, *args):
    return estimate_command(parse_train_command(["python", name, *args]), [A100], cwd=SCRIPTS)


def test_host_pipeline_real_values_formatting_pinning_and_the_overlay():
    """Token offsets from torch.randint slice a memory-mapped file the script wrote itself (the
    script asserts real consecutive tokens, shape (B, T)); pinned batches; f"{loss:.4f}" and an
    AverageMeter's "{:6.2f}".format; a checkpoint saved through a temp file, os.replace, os.utime,
    shutil.move and checked with os.path.exists / os.listdir; a log appended and read back; host
    objects torch.save'd into the directory the run made, and loaded back."""
    before = set(os.listdir(SCRIPTS))
    (est,), run = estimate_script("lm_memmap_train.py", "--batch-size", "6", "--block-size", "32")
    assert run.steps == 3 and run.batch_hint == 6 and not run.trace.step_ends == ()
    assert set(os.listdir(SCRIPTS)) == before
    assert any(p.endswith(os.path.join("data", "train.bin")) for p in run.redirected_writes)
    # the model's weights: embeddings, one encoder layer (attention, 2 linears, 2 norms), head
    d, V, T = 64, 96, 32
    layer = (3 * d * d + 3 * d) + (d * d + d) + (d * 128 + 128) + (128 * d + d) + 4 * d
    params = 4 * (V * d + T * d + layer + d * V)
    b = dict(est.breakdown)
    assert b["parameters"] == params and b["optimizer_state"] == 2 * params
    assert any(r.startswith("item at ") and "lm_memmap_train.py" in r for r in run.reads)
    # the workload block says what the script did
    assert dict(run.observed)["zero_grad"] == "after-step" and dict(run.observed)["precision"] == "fp32"


def test_checkpoint_copies_links_and_modes_go_to_the_scripts_own_copy():
    """A checkpoint duplicated as savers do (os.link, shutil.copy2 and copy, whose copystat and
    copymode chmod, utime and read the xattrs of the new file; a relative symlink read back with
    os.readlink), each loaded back by the script: before, copy2 failed on the real path
    (FileNotFoundError, the script blamed) and copy was refused as a chmod outside the temp dir.
    Nothing is written into the script's directory."""
    before = set(os.listdir(SCRIPTS))
    (est,), run = estimate_script("checkpoint_copies_train.py")
    assert run.steps == 3 and set(os.listdir(SCRIPTS)) == before
    assert any(p.endswith(os.path.join("ckpt_out", "best.pth")) for p in run.redirected_writes)


def test_a_trainers_housekeeping_runs_and_real_directories_stay():
    """An EMA deepcopy of a model with a plain host tensor attribute (before: the copy ran under the
    fake mode and failed, blamed on the script); a run folder made, shutil.rmtree'd and made again
    (before: refused as a removal outside the temp dir); unlink(missing_ok=True) of a file that never
    existed (refused too). shutil.rmtree of a real directory the run did not make is still refused,
    and the directory stays."""
    before = set(os.listdir(SCRIPTS))
    (est,), run = estimate_script("housekeeping_train.py")
    assert run.steps == 3 and set(os.listdir(SCRIPTS)) == before
    real = os.path.join(SCRIPTS, "data")   # (not under /tmp: the sandbox's /tmp is its own)
    kept = sorted(os.listdir(real))
    with pytest.raises(EstimateError, match="tried shutil.rmtree on .* outside the estimate's temp dir"):
        estimate_script("housekeeping_train.py", "--real", real)
    assert sorted(os.listdir(real)) == kept


def test_files_an_earlier_run_left_are_updated_in_the_overlay():
    """A lock file an earlier run left, opened read-write by filelock (before: "Read-only file
    system", blamed on vest), a log appended to and read back whole, a file updated in place
    ("r+"): each is copied into the overlay on its first update (copy-on-write), the real files
    untouched. os.statvfs of a directory the run made, and os.chdir into it, find it there."""
    real = {n: open(os.path.join(SCRIPTS, "data", n), "rb").read() for n in ("previous.log", "cache.lock")}
    before = set(os.listdir(SCRIPTS))
    (est,), run = estimate_script("file_updates_train.py")
    assert run.steps == 3 and set(os.listdir(SCRIPTS)) == before
    assert {n: open(os.path.join(SCRIPTS, "data", n), "rb").read() for n in real} == real


def test_datasets_preprocessing_workers_run_in_the_one_process():
    """datasets' map / filter with num_proc (transformers' examples, --preprocessing_num_workers)
    run in the estimate's process, as DataLoader's workers do, with the same result (the script
    checks it): before, refused as a script starting processes (os.fork)."""
    (est,), run = estimate_script("datasets_workers_train.py")
    assert run.steps == 3 and run.batch_hint == 8


def test_lazy_modules_are_made_at_their_first_forward_where_they_were_moved():
    """nn.Lazy* modules moved with .cuda() before their shapes are known, made by a dummy forward,
    then trained: their weights are on the (fake) GPU, counted as parameters, with AdamW's two
    states each. Before: "the raw Tensor object is already associated to a python object of type
    FakeTensor" at the module's construction, blamed on vest."""
    (est,), run = estimate_script("lazy_modules_train.py")
    params = 4 * ((3 * 9 * 16 + 16) + 2 * 16 + (16 * 30 * 30 * 10 + 10))
    buffers = 4 * 2 * 16 + 8   # BatchNorm's running mean and variance, its int64 batch count
    b = dict(est.breakdown)
    assert run.steps == 3 and b["parameters"] == params + buffers and b["optimizer_state"] == 2 * params


def test_the_workload_block_says_the_script_checkpointed_its_activations():
    """A script that reruns its blocks in backward (torch.utils.checkpoint) is said to in the
    workload block (and the spec that stands for it), not the command line's default 'off'; so is
    the optimizer it stepped (AdamW; none for hand-written updates), not the default Adam; and the
    micro-batches of a step as the script accumulated them."""
    from vest_slurm.dynamic.runner import script_spec

    (_,), run = estimate_script("checkpointed_train.py")
    assert dict(run.observed)["gradient_checkpointing"] == "on"
    spec = script_spec(parse_train_command(["python", "checkpointed_train.py"]), run, 1, "")
    assert spec.gradient_checkpointing == "on" and spec.optimizer == "adamw"   # the script's, not the default adam
    # the reentrant form's backward inside each block's is the same pass: 2 micro-batches, not 10
    (_,), nested = estimate_script("checkpointed_train.py", "--reentrant", "--accumulate", "2")
    assert dict(nested.observed)["grad_accum"] == 2 and dict(nested.observed)["gradient_checkpointing"] == "on"
    (_,), plain = estimate_script("lazy_modules_train.py")
    assert dict(plain.observed)["gradient_checkpointing"] == "off"
    (_,), manual = estimate_script("manual_sgd.py")
    assert script_spec(parse_train_command(["python", "manual_sgd.py"]), manual, 1, "").optimizer.startswith("none")


def test_optimizer_steps_taken_in_backward_are_one_step_per_backward():
    """An optimizer per parameter stepped from its gradient hook (PyTorch's "optimizer step in
    backward" recipe): the backward is one training step, however many optimizers stepped in it.
    Before, each of them ended a step, the run stopped inside the first backward after three, and
    the optimizer state of the other parameters was never made (1/4 of it here, unflagged)."""
    (est,), run = estimate_script("optimizer_in_backward_train.py")
    params = 4 * 6 * (256 * 256 + 256)
    b = dict(est.breakdown)
    assert run.steps == 3 and b["parameters"] == params and b["optimizer_state"] == 2 * params
    assert b["gradients"] < params / 2   # freed as each step takes them, never all alive


def test_sync_batch_norm_runs_as_on_the_gpu():
    """nn.SyncBatchNorm under torchrun (--sync-bn): its CUDA-only kernels (batch_norm_stats, the
    gather of the ranks' statistics, the elementwise passes and backward reductions) have fake
    kernels, and the mask over the gathered counts keeps every rank of the fake group: before,
    "Found no NVIDIA driver", then a refusal as data-dependent. Its weights and running stats are
    BatchNorm's, and its activations too: the statistics it adds are a few per-channel vectors."""
    def run(*extra):
        cmd = parse_train_command(["torchrun", "--nproc_per_node", "2", "sync_bn_train.py", *extra])
        (est,), r = estimate_command(cmd, [A100], cwd=SCRIPTS)
        return dict(est.breakdown), r

    sync, run_sync = run()
    plain, _ = run("--plain")
    assert run_sync.steps == 3 and sync["parameters"] == plain["parameters"]
    assert 0 <= sync["live_tensor_peak"] - plain["live_tensor_peak"] < 2**16   # bytes


def test_batch_is_the_models_not_a_transform_modules():
    """torchvision v2 transforms are nn.Modules called on one host image (3 x H x W): the batch is
    the model's (8), not the transform input's first dimension (3)."""
    (est,), run = estimate_script("image_transforms_train.py", "-b", "8")
    assert run.steps == 3 and run.batch_hint == 8 and run.flags == ()
    assert dict(run.observed)["zero_grad"] == "before-backward"


def test_sequence_first_batch_is_the_stated_one():
    (est,), run = estimate_script("seq_first_lstm.py", "--batch-size", "4", "--bptt", "20")
    # no batch flag; the one flag says cuDNN's RNN (what the GPU runs) was not what was traced
    assert run.batch_hint == 4 and run.flags == (CUDNN_RNN_NOTE,)


@pytest.mark.parametrize("style", [[], ["--data"]], ids=["p-=", "p.data.add_"])
def test_hand_written_sgd_stops_after_n_updates(style):
    (est,), run = estimate_script("manual_sgd.py", *style)
    assert run.steps == 3 and "parameter updates" in run.stopped_by
    assert len(run.trace.step_ends) == 3
    assert dict(est.breakdown)["parameters"] == 4 * (64 * 128 + 128 + 128 * 10 + 10)


def test_forward_passes_under_grad_stop_too():
    (est,), run = estimate_script("forward_only_grad.py")
    assert run.steps == 3 and "forward passes" in run.stopped_by and est.peak_bytes > 0


def test_model_input_shaped_by_a_stand_in_is_refused():
    """lengths.max().item() on the device, lengths the model's predictions decide, is a stand-in:
    the padded input it shapes is not the real run's; the estimate is refused, naming the line the
    value was read at. (A length drawn with torch.randint on the device is a sampled draw instead:
    test_shapes_drawn_from_the_devices_random_generator_are_sampled_and_flagged.)"""
    with pytest.raises(EstimateError) as e:
        estimate_script("standin_shape.py")
    assert e.value.kind == "data-dependent" and "standin_shape.py:13" in e.value.what
    assert e.value.where.endswith("standin_shape.py:13")


def test_zero_size_model_input_is_refused():
    with pytest.raises(EstimateError) as e:
        estimate_script("empty_batch.py")
    assert e.value.kind == "data-dependent" and "(12, 0)" in e.value.what


def test_cuda_api_without_stand_in_blames_vest_and_json_failure_object():
    """A CUDA call with no stand-in: vest cannot yet run it (not "fix your script"), with the API,
    the script's file:line and the #VEST workaround; --json prints one object on stdout, and
    VEST_TRACEBACK=1 the stack on stderr."""
    r = subprocess.run([sys.executable, "-m", "vest_slurm.cli", "estimate", "--gpu", "a100-40gb", "--json", "--",
                        "python", "cuda_api_without_standin.py"], cwd=SCRIPTS, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "VEST_TRACEBACK": "1"})
    assert r.returncode == 5, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"error", "kind", "where", "fix"}
    assert doc["kind"] == "vest-unsupported" and doc["where"].endswith("cuda_api_without_standin.py:7")
    assert "torch.cuda.current_blas_handle" in doc["error"] and "vest cannot yet run" in doc["error"]
    assert "#VEST" in doc["fix"] and "not in the script" in doc["fix"]
    assert "Traceback (most recent call last)" in r.stderr and "current_blas_handle" in r.stderr
    kept = doc["error"].split("the run's output is kept in ")[1].split()[0]
    assert os.path.exists(kept)
    os.unlink(kept)


def test_torch_func_transforms_are_vests_gap_not_the_scripts(tmp_path):
    """A model trained functionally under torch.func.grad (new weights each step, no optimizer, no
    backward call, no in-place update) takes no step vest counts: vest must act, not the script.
    (Before, grad's wrappers of the fake tensors were taken for host tensors and reached the
    driver.) Per-sample gradients with vmap(grad(...)) feeding an optimizer step are estimated."""
    (tmp_path / "t.py").write_text(
        "import torch\nfrom torch.func import functional_call, grad\n"
        "m = torch.nn.Linear(64, 1).cuda()\np = {k: v.detach() for k, v in m.named_parameters()}\n"
        "for _ in range(3):\n"
        "    x = torch.randn(32, 64, device='cuda')\n"
        "    g = grad(lambda p: functional_call(m, p, (x,)).square().mean())(p)\n"
        "    p = {k: p[k] - 0.1 * g[k] for k in p}\n")
    with pytest.raises(EstimateError) as e:
        estimate_command(parse_train_command("python t.py"), [get_profile("a100-40gb")], cwd=str(tmp_path))
    assert e.value.kind == "vest-unsupported" and "torch.func" in str(e.value), str(e.value)
    (tmp_path / "per_sample.py").write_text(
        "import torch, torch.nn.functional as F\nfrom torch.func import functional_call, vmap, grad\n"
        "m = torch.nn.Linear(64, 10).cuda()\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "def loss(p, x, y):\n"
        "    return F.nll_loss(functional_call(m, p, (x[None],)).log_softmax(1), y[None])\n"
        "for _ in range(3):\n"
        "    x, y = torch.randn(32, 64, device='cuda'), torch.randint(10, (32,), device='cuda')\n"
        "    g = vmap(grad(loss), in_dims=(None, 0, 0))(dict(m.named_parameters()), x, y)\n"
        "    for n, p in m.named_parameters():\n"
        "        p.grad = g[n].mean(0)\n"
        "    opt.step()\n")
    (est,), run = estimate_command(parse_train_command("python per_sample.py"), [get_profile("a100-40gb")],
                                  cwd=str(tmp_path))
    assert run.steps == 3 and dict(est.breakdown)["parameters"] == 4 * (64 * 10 + 10)


def test_a_script_that_sizes_its_batch_to_the_gpu_runs_out_where_the_gpu_would():
    """A batch-size finder (accelerate's find_executable_batch_size style: retry with half the batch on
    CUDA out-of-memory): the fake GPU raises out-of-memory past each type's room for tensors, so on an
    A100-40GB the loop halves its batch and fits, flagged, while an H100-80GB runs the starting batch
    (a run per room). The same loop that catches nothing is estimated at its batch: it does not fit."""
    a100, h100 = get_profile("a100-40gb"), get_profile("h100-80gb")
    est, run = estimate_command(parse_train_command("python batch_finder_train.py"), [h100, a100], cwd=SCRIPTS)
    by = {e.gpu: e for e in est}
    assert by["a100-40gb"].fits and by["a100-40gb"].peak_bytes <= a100.usable_bytes
    assert by["h100-80gb"].fits and by["h100-80gb"].peak_bytes > a100.usable_bytes   # the starting batch
    assert any("caught CUDA out-of-memory" in f for f in run.flags)
    assert run.batch_hint == 98304   # the retry's batch: the attempt that ran out is not the batch shown
    est, run = estimate_command(parse_train_command("python batch_finder_train.py --no-finder"), [h100, a100],
                                cwd=SCRIPTS)
    by = {e.gpu: e for e in est}
    # the starting batch on both (their context floors and cuBLAS workspaces aside)
    assert not by["a100-40gb"].fits and abs(by["a100-40gb"].peak_bytes - by["h100-80gb"].peak_bytes) < 0.01 * \
        by["h100-80gb"].peak_bytes
    assert not any("out-of-memory" in f for f in run.flags)


def test_a_batch_finder_that_fits_the_first_gpu_class_runs_again_on_a_smaller_one():
    """The finder's starting batch fits an A100-80GB, not a T4: the T4's class gets a run of its
    own, which halves its batch until it fits, and the estimate is flagged for the T4 (before, the
    T4 took the A100's run at the starting batch: 'does not fit', no flag). The T4's requirement is
    its settled run's: the attempts that ran out are not asked of it. torch.cuda.empty_cache()
    between attempts is marked in the trace and releases the replay's cached segments."""
    a100, t4 = get_profile("a100-80gb"), get_profile("t4-16gb")
    est, run = estimate_command(parse_train_command("python batch_finder_train.py --batch-size 131072"), [a100, t4],
                                cwd=SCRIPTS)
    by = {e.gpu: e for e in est}
    assert by["a100-80gb"].fits and by["t4-16gb"].fits
    assert any(f.startswith("on t4-16gb: the script caught CUDA out-of-memory") for f in run.flags)
    assert by["t4-16gb"].required_bytes < by["a100-80gb"].required_bytes
    # the caching allocator runs along with the T4's run: it ran out where reserved memory found no
    # room, so the replay of that run never reserves more than the T4 has
    assert dict(by["t4-16gb"].breakdown)["allocator_peak_reserved"] + t4.context_mib * 2**20 <= t4.usable_bytes


def test_an_optimizer_step_that_branches_on_gpu_values_is_flagged(tmp_path):
    """LBFGS decides its iterations and whether it keeps each update in its history (``ys > 1e-10``)
    from values on the GPU: stand-ins decide those branches here, so the estimate is flagged naming
    the optimizer. An Adam step reads no value: no flag."""
    body = ("import torch\nm = torch.nn.Linear(256, 256).cuda()\nopt = torch.optim.{opt}(m.parameters(){kw})\n"
            "x = torch.randn(64, 256, device='cuda')\n"
            "def closure():\n    opt.zero_grad()\n    loss = m(x).square().mean()\n    loss.backward()\n    return loss\n"
            "for _ in range(5):\n    opt.step(closure)\n")
    (tmp_path / "lbfgs.py").write_text(body.format(opt="LBFGS", kw=", history_size=5, max_iter=3"))
    (tmp_path / "adam.py").write_text(body.format(opt="Adam", kw=""))
    _, run = estimate_command(parse_train_command("python lbfgs.py"), [get_profile("a100-40gb")], cwd=str(tmp_path))
    assert any("LBFGS optimizer's step branched on values" in f and "history_size" in f for f in run.flags), run.flags
    assert dict(run.observed)["grad_accum"] == 1   # the closure's re-evaluations are the step's own
    _, run = estimate_command(parse_train_command("python adam.py"), [get_profile("a100-40gb")], cwd=str(tmp_path))
    assert not any("step branched" in f for f in run.flags), run.flags


def test_the_memory_visualizer_recipe_runs_and_its_early_dump_is_named(tmp_path):
    """PyTorch's memory-viz recipe: _record_memory_history is the allocator's host-side bookkeeping (a
    no-op here: it stopped the run, 'Found no NVIDIA driver'); a snapshot dumped before the run's
    third step is vest's gap, named (the segments exist only after the replay), and the steps
    traced before it stand."""
    body = ("import torch\ntorch.cuda.memory._record_memory_history(max_entries=100000)\n"
            "m = torch.nn.Linear(256, 256).cuda()\nopt = torch.optim.Adam(m.parameters())\n"
            "for i in range(5):\n    m(torch.randn(64, 256, device='cuda')).sum().backward()\n    opt.step()\n"
            "    {dump}\n")
    (tmp_path / "rec.py").write_text(body.format(dump="pass"))
    (tmp_path / "dump.py").write_text(body.format(dump="torch.cuda.memory._dump_snapshot('s.pickle')"))
    (e,), _ = estimate_command(parse_train_command("python rec.py"), [get_profile("a100-40gb")], cwd=str(tmp_path))
    assert dict(e.breakdown)["parameters"] == 4 * (256 * 256 + 256)
    # (between two training steps: the step traced stands, and the flag names the API)
    (e,), run = estimate_command(parse_train_command("python dump.py"), [get_profile("a100-40gb")], cwd=str(tmp_path))
    said = [f for f in run.flags if "between its steps" in f]
    assert run.steps == 1 and len(said) == 1 and "torch.cuda.memory._dump_snapshot" in said[0], run.flags


def test_stated_batch_that_differs_is_flagged_in_table_and_json():
    """The command states --batch-size 64, the model sees 8 (a script that splits its batch): the
    estimate is for 8, flagged in the table and in the JSON's workload block."""
    from vest_slurm.dynamic.runner import batch_and_flags, script_spec
    from vest_slurm.estimate.report import estimate_json, estimate_table

    cmd = parse_train_command("python image_transforms_train.py --batch-size 64")
    batch, flags = batch_and_flags(cmd, {"batch_hint": 8, "first_input_shape": [8, 3, 32, 32]})
    assert batch == 8 and len(flags) == 1 and "batch of 64" in flags[0]
    assert batch_and_flags(cmd, {"batch_hint": 20, "first_input_shape": [20, 64, 32]})[0] == 64   # sequence-first
    # a global batch divided over the job's 8 GPUs (mp.spawn trainers: MoCo, the ImageNet example): said so
    batch, (flag,) = batch_and_flags(cmd, {"batch_hint": 8, "first_input_shape": [8, 3, 32, 32]}, world=8)
    assert batch == 8 and "the command's 64 over the job's 8 GPUs" in flag
    # both at once: sequence-first input of a global batch divided over the GPUs (Transformer-XL's
    # and GNMT's DDP training): the per-GPU batch, not the sequence, and not "8 inputs per sample"
    batch, (flag,) = batch_and_flags(cmd, {"batch_hint": 512, "first_input_shape": [512, 8]}, world=8)
    assert batch == 8 and "sequence-first" in flag and "the command's 64 over the job's 8 GPUs" in flag
    # two inputs per sample in one call (DPO's chosen and rejected, SimCLR's views): still flagged, said why
    batch, (flag,) = batch_and_flags(cmd, {"batch_hint": 128, "first_input_shape": [128, 3, 32, 32]})
    assert batch == 128 and "2 x the command's 64" in flag and "paired preferences" in flag
    (est,), run = estimate_script("image_transforms_train.py", "-b", "8")
    spec = script_spec(cmd, run.__class__(**{**run.__dict__, "flags": flags}), 1, "")
    assert "FLAGGED: the model saw a batch of 8" in estimate_table(spec, [est])
    doc = json.loads(estimate_json(spec, [est]))
    assert doc["workload"]["flags"] == list(flags) and doc["workload"]["zero_grad"] == "before-backward"


def test_data_parallel_over_the_jobs_one_gpu():
    """nn.DataParallel over one GPU calls its module (its scatter would need a real GPU)."""
    (est,), run = estimate_script("data_parallel_train.py")
    params = 4 * (64 * 256 + 256 + 256 * 10 + 10)
    b = dict(est.breakdown)
    assert run.steps == 3 and run.batch_hint == 32
    assert b["parameters"] == params and b["optimizer_state"] == params
    # over the 2 GPUs of a job: vest's gap (the real class's replicas failed in CUDA copies, blamed
    # on the script), with the declarative form that models it
    with pytest.raises(EstimateError) as e:
        estimate_command(parse_train_command(["python", "data_parallel_train.py"]), [A100], num_gpus=2, cwd=SCRIPTS)
    assert e.value.kind == "vest-unsupported" and "--parallelism dp --num-gpus 2" in e.value.what


def test_host_tools_run_python_training_children_are_refused():
    """Libraries start host tools and, when refused, take another path without a word (LightningCLI
    built no model arguments at all when jsonargparse's `python -c` query of sys.path was refused):
    under bubblewrap a host tool runs for real; a Python child running a file is refused."""
    import vest_slurm.dynamic.bwrap as bwrap

    bwrap.reset_probe()
    path, why = bwrap.available()
    assert path, f"bubblewrap must run on the test machine (scripts/install.sh installs it): {why}"
    (est,), run = estimate_script("host_tools_train.py")
    assert run.steps == 3 and est.peak_bytes > 0


def test_a_librarys_own_host_query_in_a_python_child_runs():
    """py-cpuinfo asks for the CPU in a child process (``python cpuinfo.py --json``), which MosaicML
    composer's Trainer and DeepSpeed's op builders call: a file of an installed package that names
    no torch does no GPU work, and runs confined (it was refused, and every composer Trainer with
    it); a package's file that names torch stays refused. (The packages are tests/data's
    site-packages: a folder under /tmp is not the sandbox's /tmp.)"""
    site = os.path.join(os.path.dirname(SCRIPTS), "site-packages")
    (est,), run = estimate_script("host_tools_train.py", "--site-packages", site)
    assert run.steps == 3


def test_a_command_that_sets_its_own_pythonpath(monkeypatch):
    """`PYTHONPATH=.. python train.py` (minGPT's projects): the child still imports vest_slurm from
    this checkout, whatever the command's PYTHONPATH and however vest_slurm was installed."""
    import vest_slurm

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(vest_slurm.__file__)))
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or ".") != checkout] + [checkout])
    cmd = parse_train_command("PYTHONPATH=.. python tiny_train.py")
    (est,), run = estimate_command(cmd, [A100], cwd=SCRIPTS)
    assert run.steps == 3 and est.peak_bytes > 0


def test_weights_in_the_users_model_cache_load_offline(tmp_path, monkeypatch):
    """The user's torch.hub / Hugging Face hub caches are where the job finds its pretrained weights;
    the estimate reads them too (it moved TORCH_HOME into its empty temp dir, and the load reached
    for the network)."""
    import torch

    ckpt = tmp_path / "torch" / "hub" / "checkpoints"
    ckpt.mkdir(parents=True)
    torch.save(torch.nn.Linear(32, 8).state_dict(), ckpt / "linear-32-8.pth")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    (est,), run = estimate_script("cached_weights_train.py")
    assert run.steps == 3 and dict(est.breakdown)["parameters"] == 4 * (32 * 8 + 8)


def _tiny_llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def test_transformers_hub_kernels_are_off_and_the_estimate_says_so(tmp_path):
    """transformers >= 5 kernelizes what from_pretrained loads with kernels fetched from the Hub
    (the kernels package is its dependency); offline that load fails. The estimate traces PyTorch's
    own layers and flags it, with what the job can set to match."""
    import importlib.util

    from vest_slurm.estimate.trace import HUB_KERNELS_NOTE

    shutil.copy(os.path.join(SCRIPTS, "hub_model_train.py"), tmp_path)
    _tiny_llama(tmp_path / "ckpt")   # in the job's folder (the estimate's sandbox shows that one, not all of /tmp)
    (est,), run = estimate_command(parse_train_command(["python", "hub_model_train.py", "ckpt"]), [A100], cwd=str(tmp_path))
    assert run.steps == 3 and run.batch_hint == 4
    assert (HUB_KERNELS_NOTE in run.flags) == (importlib.util.find_spec("kernels") is not None), run.flags
    # a script that only imports transformers (a library it uses does) and trains its own network: no note
    (tmp_path / "own.py").write_text("import torch, transformers.modeling_utils\nm = torch.nn.Linear(8, 8).cuda()\n"
                                     "opt = torch.optim.SGD(m.parameters(), lr=0.1)\nfor _ in range(4):\n"
                                     "    m(torch.randn(2, 8, device='cuda')).sum().backward()\n    opt.step()\n")
    _, run = estimate_command(parse_train_command("python own.py"), [A100], cwd=str(tmp_path))
    assert HUB_KERNELS_NOTE not in run.flags, run.flags
    # a transformers model built from its constructor (minimind's habit): never kernelized, no note
    (tmp_path / "built.py").write_text("import torch\nfrom transformers import LlamaConfig, LlamaForCausalLM\n"
                                       "m = LlamaForCausalLM(LlamaConfig.from_pretrained('ckpt')).cuda()\n"
                                       "opt = torch.optim.SGD(m.parameters(), lr=0.1)\nfor _ in range(4):\n"
                                       "    ids = torch.randint(0, 1000, (2, 16), device='cuda')\n"
                                       "    m(input_ids=ids, labels=ids).loss.backward()\n    opt.step()\n")
    _, run = estimate_command(parse_train_command("python built.py"), [A100], cwd=str(tmp_path))
    assert run.steps == 3 and HUB_KERNELS_NOTE not in run.flags, run.flags


def test_a_hub_file_not_in_the_cache_is_refused_as_offline_not_blamed_on_the_script(tmp_path, monkeypatch):
    """A model named by its Hub id and not in the user's cache: the job would download it, the
    estimate runs offline. Refused as a limit, with the fetch to make, not "the script failed"."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(EstimateError) as err:
        estimate_script("hub_model_train.py", "some-org/some-model")
    e = err.value
    assert e.kind == "limit" and "Hugging Face Hub" in str(e) and "hub_model_train.py:10" in str(e), str(e)
    assert "hf download some-org/some-model" in e.fix and "the script failed" not in str(e)


def test_a_hub_metric_not_in_the_modules_cache_is_refused_as_offline(tmp_path, monkeypatch):
    """evaluate.load("accuracy") (every transformers example's evaluation) with the metric not in the
    user's modules cache: evaluate says the module "doesn't exist on the Hugging Face Hub either",
    offline; it was "fix the script". And the user's modules cache is the one the run reads."""
    from vest_slurm.dynamic.runner import _model_caches

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert _model_caches(dict(os.environ))["HF_MODULES_CACHE"] == str(tmp_path / "hf" / "modules")
    (tmp_path / "train.py").write_text("import evaluate\nmetric = evaluate.load('accuracy')\n")
    with pytest.raises(EstimateError) as err:
        estimate_command(parse_train_command("python train.py"), [A100], cwd=str(tmp_path))
    e = err.value
    assert e.kind == "limit" and "Hugging Face Hub" in str(e) and "train.py:2" in str(e), str(e)


def test_torch_hub_weights_not_in_the_cache_say_which_cache_to_fill(tmp_path, monkeypatch):
    """torchvision's pretrained backbone (DETR's) downloads through torch.hub: refused as offline,
    naming the cache the estimate looked in ($TORCH_HOME/hub) and how to fill it; not the bare
    "make network access optional"."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    (tmp_path / "train.py").write_text(
        "import torch\n"
        "state = torch.hub.load_state_dict_from_url('https://download.pytorch.org/models/vest-none-0000.pth')\n")
    with pytest.raises(EstimateError) as err:
        estimate_command(parse_train_command("python train.py"), [A100], cwd=str(tmp_path))
    e = err.value
    assert e.kind == "limit" and f"not in your cache ({tmp_path / 'torch-home' / 'hub'}) at train.py:2" in str(e), str(e)
    assert "TORCH_HOME the job uses" in e.fix and "make network access" not in e.fix
    # a file of the script's own, fetched with torch.hub's download function (YOLOv5's font): that
    # file and where it goes, not the torch.hub cache
    url, font = "https://example.invalid/Arial.ttf", str(tmp_path / "config" / "Arial.ttf")
    (tmp_path / "train.py").write_text(f"import torch\ntorch.hub.download_url_to_file({url!r}, {font!r})\n")
    with pytest.raises(EstimateError) as err:
        estimate_command(parse_train_command("python train.py"), [A100], cwd=str(tmp_path))
    e = err.value
    assert e.kind == "limit" and f"downloads {url} to {font} at train.py:2" in str(e), str(e)
    assert "torch.hub.download_url_to_file" in e.fix and "TORCH_HOME" not in e.fix


def test_checkpoints_written_and_read_back_round_trip_on_fake_tensors():
    """torch.save / torch.load (to the host, and back onto the GPU after an atomic os.replace),
    safetensors' save_file / load_file: what the script saved comes back with its shapes, devices
    and values of real host data (the script asserts them). The resume onto the GPU allocates the
    checkpoint's tensors there, as the real load does."""
    (est,), run = estimate_script("checkpoint_roundtrip_train.py")
    assert run.steps == 3 and run.batch_hint == 32
    sizes = [512 * 256, 512, 10 * 512, 10]
    assert dict(est.breakdown)["parameters"] == 4 * sum(sizes)
    allocs = [e.size_bytes for e in run.trace.events if e.action == "alloc"]
    # weights 4 + AdamW states 2 x 4: each once, then once more each when the resume loads them
    assert sum(1 for n in allocs if n == 4 * 512 * 256) >= 3 + 3, allocs


def test_save_pretrained_then_from_pretrained_keeps_tied_weights():
    """transformers' save_pretrained finds tied weights by storage pointer: fake tensors have
    distinct pointers as a GPU's do (all were 0, every weight one tied group: "shared tensors"
    error), and from_pretrained reads the safetensors file back from where the write went."""
    (est,), run = estimate_script("checkpoint_roundtrip_train.py", "--hf")
    assert run.steps == 3 and run.batch_hint == 4


def test_a_tensor_on_the_device_says_so_however_the_script_asks():
    """``is_cuda``, ``is_cpu``, ``get_device()``, ``type()`` of fake CUDA tensors answered as on the
    GPU (they read the C++ tensor, which answered as the host: the script's asserts failed and its
    GPU-only branch was skipped); ``.type(torch.cuda.FloatTensor)`` moves a host batch to the GPU
    (it reached for the driver); the GRU's weights flattened into cuDNN's one buffer."""
    (est,), run = estimate_script("device_checks_train.py")
    assert run.steps == 3 and run.batch_hint == 16
    allocs = [e for e in run.trace.events if e.action == "alloc"]
    assert any(e.size_bytes == 4 * (1 << 20) for e in allocs)   # the branch taken on the GPU
    gru = 3 * 64 * (32 + 64) + 2 * 3 * 64
    assert any(e.size_bytes == 4 * gru for e in allocs)          # cuDNN's flat weight buffer
    assert dict(est.breakdown)["parameters"] == 4 * (gru + 64 * 10 + 10)


def test_host_built_index_and_mask_on_the_device_give_the_real_shapes_and_values():
    """Labels, a training mask and a permutation built on the host and moved to the GPU (a graph
    script's): ``labels.max().item()``, ``int(mask.sum())``, ``mask.nonzero()`` and the model's
    input ``features[mask]`` are the real run's (the script asserts them), not stand-ins; only the
    accuracy computed from the model's outputs is a stand-in read."""
    (est,), run = estimate_script("host_index_train.py")
    assert run.steps == 3 and run.batch_hint == 180 and run.flags == ()
    assert [r for r in run.reads if r.startswith("item at ")] and all(
        r.split(":")[-1] in ("31", "32") for r in run.reads if "host_index_train.py" in r), run.reads
    d = dict(est.breakdown)
    assert d["parameters"] == 4 * (16 * 32 + 32 + 32 * 5 + 5)   # 5 classes: the real labels' max + 1
    assert any(e.size_bytes == 180 * 16 * 4 for e in run.trace.events)   # features[mask], as allocated on the GPU


def test_token_masks_from_the_collator_score_the_labelled_positions():
    """TRL-style: the collator's -100 padding moved to the GPU; ``hidden[mask]`` and the token count
    ``mask.sum().item()`` are the real ones (25 labelled positions of 4 sequences)."""
    (est,), run = estimate_script("token_mask_train.py")
    assert run.steps == 3 and run.batch_hint == 4 and run.flags == ()
    assert any(e.size_bytes == 25 * 128 * 4 for e in run.trace.events)   # the scored logits: 25 x vocab


def test_a_mask_computed_from_the_models_outputs_is_bounded_and_flagged():
    """The same boolean indexing on a mask the model's predictions decide: no host value to read.
    A mask over the batch's 64 rows is taken as all selected, the most it can select: the second
    model sees the whole batch, and the estimate says it is an upper bound at the script's line."""
    (est,), run = estimate_script("model_mask_train.py")
    said = [f for f in run.flags if "every element was taken as selected" in f]
    assert len(said) == 1 and "model_mask_train.py:17" in said[0], run.flags
    steps = [e for e in run.trace.events if e.action == "alloc" and e.phase != "setup"]
    assert any(e.size_bytes == 64 * 16 * 4 for e in steps)   # x[hard]: all 64 rows of 16 features


def test_weights_moved_to_the_device_in_worker_threads():
    """transformers 5.x loads a checkpoint's tensors in a ThreadPoolExecutor (``tensor.to(device)``
    in each worker): the script's threads run under the fake CUDA mode too, their allocations
    recorded (before, the worker reached for the absent driver: 'Found no NVIDIA driver')."""
    (est,), run = estimate_script("thread_to_cuda.py")
    assert run.steps == 3
    weights = 4 * (256 * 1024 + 256)
    setup = sorted(e.size_bytes for e in run.trace.events if e.action == "alloc" and e.phase == "setup")
    # the two tensors the workers moved, and the first batch (4 x 1024) copied before the first forward
    assert setup == [4 * 256, 4 * 4 * 1024, 4 * 256 * 1024]
    assert dict(est.breakdown)["gradients"] == weights


def _saved_files(folder):
    """What saved_data_train.py reads: a data set, its metadata, weights with a tied pair."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 6, (500,), generator=g)
    labels[3] = 6
    torch.save({"images": torch.randint(0, 256, (500, 16, 16, 3), dtype=torch.uint8, generator=g),
                "labels": labels}, os.path.join(folder, "data.pt"))
    torch.save({"classes": 7, "mean": torch.tensor([0.25, 0.5, 0.75])}, os.path.join(folder, "meta.pt"))
    embed = torch.randn(3 * 16 * 16, 256)
    torch.save({"embed": embed, "head": embed}, os.path.join(folder, "pretrained.pt"))


def test_files_torch_saved_before_the_run_are_read_where_map_location_puts_them(tmp_path):
    """A data set, metadata and pretrained weights another job saved with torch.save (a zip archive,
    not a checkpoint of this run's fake tensors). Under the fake mode torch's own load read no
    bytes and gave plain meta tensors: the host file had no values, and what it loaded onto the
    GPU was no allocation at all (nor a fake tensor: T.Normalize's ``(std == 0).any()`` failed).
    Now the host file is real, each storage mapped to the GPU is one allocation of its size
    (shared by its views), and the labels loaded there keep their values."""
    _saved_files(tmp_path)
    shutil.copy(os.path.join(SCRIPTS, "saved_data_train.py"), tmp_path)
    (est,), run = estimate_command(parse_train_command(["python", "saved_data_train.py"]), [A100], cwd=str(tmp_path))
    assert run.steps == 3 and run.batch_hint == 50 and run.flags == (), run.flags   # the model's batch, not Normalize's
    setup = [e.size_bytes for e in run.trace.events if e.action == "alloc" and e.phase == "setup"]
    assert setup.count(500 * 16 * 16 * 3) == 1 and setup.count(500 * 8) == 1, setup   # the data set, once
    loaded = [e for e in run.trace.events if e.action == "alloc" and e.size_bytes == 4 * 768 * 256 and e.category != "parameter"]
    assert len(loaded) == 1, setup   # the tied weights: one storage, one allocation
    assert dict(est.breakdown)["parameters"] == 2 * (768 * 256 + 256 + 256 * 7 + 7)   # 7 classes, real labels


def test_shapes_drawn_from_the_devices_random_generator_are_sampled_and_flagged():
    """A random mask drawn on the GPU (torch.rand(..., device="cuda") < 0.15) selects the scored
    positions, a torch.randint on the device the kept samples: the shapes follow the draw. Such a
    draw gets a sampled shadow drawn on the host (the script checks it is of the right
    distribution, and that its own host random stream is untouched): the estimate is made, with the
    scored logits' shape a draw, and flagged as such. Before, the boolean indexing refused it."""
    (est,), run = estimate_script("device_random_mask_train.py")
    assert run.steps == 3 and run.batch_hint == 8
    assert len(run.flags) == 1 and "sampled on the host" in run.flags[0], run.flags
    assert "rand at device_random_mask_train.py:15" in run.flags[0] and "nonzero at device_random_mask_train.py:21" in run.flags[0], run.flags
    scored = [e.size_bytes for e in run.trace.events if e.action == "alloc" and e.size_bytes % (4 * 500) == 0
              and 0.05 * 8 * 128 < e.size_bytes / (4 * 500) < 0.3 * 8 * 128]
    assert scored, "the (n, V) logits of the positions drawn"


def test_fused_optimizer_steps_without_a_meta_kernel_run_on_fake_tensors():
    """torch gives ``_fused_sgd_``, ``_fused_adagrad_`` and Adam's tensor-lr fused step no Meta
    kernel, so a fake tensor fell back to the real CUDA kernel ("Found no NVIDIA driver"). They
    update in place and allocate nothing; their state is the optimizers' own: momentum 1x,
    Adagrad's sum 1x, Adam's moments 2x the parameters (and the steps' scalars)."""
    (est,), run = estimate_script("fused_optimizers_train.py")
    assert run.steps == 3
    p = 4 * (256 * 256 + 256)
    b = dict(est.breakdown)
    assert b["parameters"] == 3 * p
    assert 4 * p <= b["optimizer_state"] <= 4 * p + 4096, b["optimizer_state"]


@pytest.mark.parametrize("style", [[], ["--manual"]], ids=["optimizer", "hand-written"])
def test_a_model_kept_on_the_host_is_refused_as_using_no_gpu(style):
    """A model never moved to the GPU (pytorch/examples' regression, a forgotten .to(device)):
    its backward runs on the host (autograd's zeros stay host tensors), its steps are counted by
    either stop, no CUDA library workspace is taken for its host matmuls, and the answer is that
    the job would hold an idle GPU, the script's to act on, not an estimate of the bare context."""
    with pytest.raises(EstimateError) as e:
        estimate_script("host_only_train.py", *style)
    assert e.value.kind == "no-gpu", e.value
    assert "does not use the GPU" in e.value.what and "did not move to the GPU" in e.value.what
    assert re.search(r"the model \(Sequential\) ran \d+ training steps", e.value.what), e.value.what
    assert ("parameter updates" in e.value.what) == bool(style)
    assert "without --gres" in e.value.fix


def test_a_script_that_trains_on_the_host_before_the_gpu_is_estimated_on_the_gpu():
    """Steps on the host with nothing on the GPU (a tutorial's CPU sections, a check on a few
    batches) are followed, not traced: the run goes on to the GPU's steps (it stopped after three
    host steps and said the script would leave its GPU idle). A script that stays on the host past
    standins.HOST_STEPS is taken to train there."""
    from vest_slurm.dynamic.standins import HOST_STEPS

    (est,), run = estimate_script("host_first_train.py", "--host-steps", "20")
    params = 4 * (64 * 1024 + 1024 + 1024 * 10 + 10)
    assert run.steps == 3 and dict(est.breakdown)["parameters"] == params
    with pytest.raises(EstimateError) as e:
        estimate_script("host_first_train.py", "--host-steps", str(HOST_STEPS + 10))
    assert e.value.kind == "no-gpu" and f"ran {HOST_STEPS} training steps" in e.value.what


def test_a_model_on_the_host_beside_a_tensor_on_the_gpu_is_flagged():
    (est,), run = estimate_script("host_only_train.py", "--gpu-metric")
    assert run.steps == 3
    assert any(f.startswith("the model trains on the host") for f in run.flags), run.flags
    b = dict(est.breakdown)
    assert b["parameters"] == 0 and b["live_tensor_peak"] < 1024, b


@pytest.mark.parametrize("device", ["--cuda", "--cpu"])
def test_processes_given_the_model_are_vests_gap_not_the_scripts(device):
    """model.share_memory() is a no-op for CUDA tensors (it reached the host's shared-memory call
    and failed); processes started with the model (Hogwild) would share it and each hold its own
    context and step memory, which one trace is not: vest's gap, naming the API."""
    with pytest.raises(EstimateError) as e:
        estimate_script("hogwild_train.py", device)
    assert e.value.kind == "vest-unsupported", e.value
    assert "multiprocessing.Process.start" in e.value.what and e.value.where.endswith("hogwild_train.py:27")
    assert ("CUDA IPC" in e.value.what) == (device == "--cuda")


def test_a_frozen_network_run_under_grad_does_not_end_the_run_before_the_backward():
    """A perceptual loss's frozen network runs under grad four times before the first backward;
    its passes are not the steps of a forward-only run (they stopped the run with no backward:
    gradients and Adam's states 0, the backward's activations missing, silently)."""
    (est,), run = estimate_script("perceptual_loss_train.py")
    assert run.steps == 3 and run.stopped_by == "optimizer steps", run.stopped_by
    trained = 4 * (3 * 16 * 9 + 16 + 16 * 3 * 9 + 3)
    b = dict(est.breakdown)
    assert b["gradients"] == trained and b["optimizer_state"] == 2 * trained, b


def test_in_place_random_fills_and_masked_select_of_unshadowed_data_are_sampled():
    """Crop centres drawn in place (``empty(...).random_()``) get a sampled shadow as factories'
    draws do; masked_select of the image data (no shadow: floats) by a mask that has one takes
    its output shape from the mask. The estimate is flagged with both places. The batch is the
    training forward's (16), not the no_grad setup pass's (128)."""
    (est,), run = estimate_script("random_crop_train.py")
    assert run.steps == 3 and run.batch_hint == 16, run.batch_hint
    assert len(run.flags) == 1 and "random_ at random_crop_train.py:15" in run.flags[0], run.flags
    assert "masked_select at random_crop_train.py:20" in run.flags[0], run.flags
    cropped = 256 * 3 * 32 * 32 * 2   # the masked_select's output, fp16
    assert any(e.action == "alloc" and e.size_bytes == cropped for e in run.trace.events)


def test_weights_made_on_the_device_count_as_parameters():
    """Weights created on the GPU (device="cuda", a torch.device context, set_default_device; a
    device_map), never moved by .to(): on the fake GPU (under a torch.device context they were
    fake host weights, copied to the GPU at each use, their Adam states on the host: missing from
    the estimate), and counted as parameters in the breakdown (they were "other": parameters 0 for
    every Hugging Face model loaded with a device_map, trl's sft among them)."""
    (est,), run = estimate_script("device_built_train.py")
    b = dict(est.breakdown)
    params = 4 * (256 * 512 + 512 + 512 * 10 + 10 + 10 * 10 + 10)
    assert b["parameters"] == params and b["optimizer_state"] == 2 * params, b


def test_flex_attention_runs_fused_when_compiled_and_unfused_eagerly():
    """FlexAttention is a higher-order operator: its rule is looked up by the mode's exact type, and
    vest's fake mode had none ("no rule registered", blamed on the script). Under torch.compile it is
    the fused kernel (its outputs: memory linear in the sequence); eagerly torch's own unfused
    implementation builds the B x H x S x S score matrix (quadratic), as torch warns it does."""
    live = {}
    for seq in (256, 512):
        for compiled in (False, True):
            (est,), run = estimate_script("flex_attention_train.py", "--seq", str(seq), *(["--compile"] if compiled else []))
            assert run.steps == 3
            live[seq, compiled] = run.trace.live_peak_bytes()
    scores = 2 * 4 * 256 * 256 * 4   # B x H x S x S, fp32, at seq 256
    assert live[256, False] - live[256, True] >= scores
    assert live[512, True] < 2.2 * live[256, True]      # fused: the outputs, linear in S
    assert live[512, False] > 3.0 * live[256, False]    # unfused: the score matrix, quadratic in S


def test_nvidia_smi_answers_as_the_gpu_type_estimated():
    """nvidia-smi run by the script (its table, --query-gpu, -L through a shell) answers for the GPU
    type being estimated (it was FileNotFoundError, blamed on the script): a script that sizes its
    batch from the memory it reports gets 8 on a 40 GB A100 and 64 on an 80 GB H100."""
    import vest_slurm.dynamic.bwrap as bwrap

    assert bwrap.available()[0], "bubblewrap runs here (scripts/install.sh): without it no program may start"
    cmd = parse_train_command(["python", "nvidia_smi_train.py"])
    for profile, batch in ((A100, 8), (get_profile("h100-80gb"), 64)):
        (est,), run = estimate_command(cmd, [profile], cwd=SCRIPTS)
        assert run.steps == 3 and run.batch_hint == batch


def test_lightnings_lazy_loader_fills_the_models_weights(tmp_path):
    """_lazy_load opens the file in C++ (torch.PyTorchFileReader(path): now through the run's
    overlay) and reads each tensor inside param.copy_, with the run's function modes off: the host
    tensor over the file's storage came out fake and set_ refused it ('Error(s) in loading
    state_dict', blamed on the script); now it is real, and the weights copied onto the GPU."""
    from torch import nn

    shutil.copy(os.path.join(SCRIPTS, "lazy_load_train.py"), tmp_path)
    torch.save(nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8)).state_dict(), tmp_path / "pretrained.pth")
    (est,), run = estimate_command(parse_train_command("python lazy_load_train.py"), [A100], cwd=str(tmp_path))
    assert run.steps == 3
    params = 4 * (256 * 256 + 256 + 256 * 8 + 8)
    assert dict(est.breakdown)["parameters"] == params and dict(est.breakdown)["optimizer_state"] == 2 * params


def test_the_workload_block_says_how_many_micro_batches_make_a_step():
    """Gradient accumulation (backward passes under DDP's no_sync, then one step): the workload block
    says 2, as the script did (it said 1, the command-line default, whatever the script did)."""
    from vest_slurm.dynamic.runner import script_spec

    cmd = parse_train_command("torchrun --nproc_per_node 1 ddp_train.py --accumulate 2")
    _, run = estimate_command(cmd, [A100], cwd=SCRIPTS)
    assert dict(run.observed)["grad_accum"] == 2 and script_spec(cmd, run, 1, "").grad_accum == 2


def test_intermediates_a_compiled_call_frees_are_flagged(tmp_path):
    """torch.compile'd code runs eagerly here: what its calls allocate and free before returning (a
    dense outer product a fused kernel would never write) is in the estimate, and flagged with its
    size when it is more than the estimate's accuracy; the same code not compiled is not flagged."""
    body = ("import torch\nm = torch.nn.Linear(512, 512).cuda()\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "def spread(h):\n    return (h[:, :, None] * h[:, None, :]).sum(-1)\n"
            "{wrap}"
            "for _ in range(4):\n    spread(m(torch.randn(64, 512, device='cuda'))).sum().backward()\n"
            "    opt.step()\n    opt.zero_grad()\n")
    (tmp_path / "compiled.py").write_text(body.format(wrap="spread = torch.compile(spread)\n"))
    (tmp_path / "eager.py").write_text(body.format(wrap=""))
    _, run = estimate_command(parse_train_command("python compiled.py"), [A100], cwd=str(tmp_path))
    (flag,) = [f for f in run.flags if "torch.compile'd code ran eagerly" in f]
    assert "64 MiB of intermediates" in flag, flag   # 64 x 512 x 512 fp32, freed inside the call
    _, run = estimate_command(parse_train_command("python eager.py"), [A100], cwd=str(tmp_path))
    assert not any("torch.compile'd" in f for f in run.flags), run.flags


def test_fsdps_sharded_grad_scaler_has_a_stand_in(tmp_path):
    """FSDP1 in fp16 (accelerate's FSDP plugin, Lightning's FSDP precision) scales its loss with
    ShardedGradScaler, a GradScaler subclass: it reached for private methods of the real class that
    the GradScaler stand-in has not ('no attribute _lazy_init_scale_growth_tracker', blamed on the
    script). Now it has its own stand-in, with its signature, and the run trains."""
    (tmp_path / "t.py").write_text(
        "import torch\nfrom torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n"
        "m = torch.nn.Linear(64, 64).cuda()\nopt = torch.optim.AdamW(m.parameters())\n"
        "scaler = ShardedGradScaler(init_scale=2.0**10, growth_interval=100)\n"
        "for _ in range(4):\n    with torch.autocast('cuda', dtype=torch.float16):\n"
        "        loss = m(torch.randn(8, 64, device='cuda')).float().pow(2).mean()\n"
        "    scaler.scale(loss).backward()\n    scaler.unscale_(opt)\n    scaler.step(opt)\n    scaler.update()\n"
        "    opt.zero_grad()\n")
    (est,), run = estimate_command(parse_train_command("python t.py"), [A100], cwd=str(tmp_path))
    assert run.steps == 3 and dict(run.observed)["precision"] == "amp-fp16"


def test_flops_counted_on_a_meta_copy_before_training():
    """A backward on the meta device (Fabric's measure_flops, litgpt's pretrain) makes host scalars
    in its formulas (cross-entropy's ``where(target != ignore_index, target, 0)``): they stay off the
    GPU, as the weights nearest the node are meta tensors (before: moved to the fake GPU, "meta and
    cuda:0", and every `litgpt pretrain` refused). The meta pass allocates nothing; the real model's
    steps are the estimate, Adam's state and all."""
    (est,), run = estimate_script("meta_flops_train.py")
    params = 1000 * 256 + (256 * 1000 + 1000)
    b = dict(est.breakdown)
    assert run.steps == 3 and b["parameters"] == 4 * params and b["optimizer_state"] == 2 * 4 * params


def test_a_host_model_with_a_backward_and_no_step_is_said_not_to_use_the_gpu():
    """A model kept on the host, one backward and no optimizer: nothing reached the GPU, which is
    what to say (no-gpu), not that no forward pass ran under grad (script-error)."""
    with pytest.raises(EstimateError) as e:
        estimate_script("host_backward_only.py")
    assert e.value.kind == "no-gpu" and "(Sequential) ran with its weights on the host" in str(e.value)


def test_a_spawned_worker_writes_into_the_overlay_and_one_using_the_gpu_is_vests_limit():
    """multiprocessing's spawn starts its child through _posixsubprocess (no audit event): the child
    ran outside the file overlay, its write into the job's directory failed, and the script was
    blamed. It now runs under the same sandbox: what it writes the parent reads. A worker that puts
    a tensor on the GPU (vest fakes the GPU in the script's own process only) is vest's limit."""
    before = set(os.listdir(SCRIPTS))
    (est,), run = estimate_script("spawn_prep_train.py")
    assert run.steps == 3 and set(os.listdir(SCRIPTS)) == before
    with pytest.raises(EstimateError) as e:
        estimate_script("spawn_prep_train.py", "--child-uses-gpu")
    assert e.value.kind == "vest-unsupported" and "started with multiprocessing used the GPU" in str(e.value)


def test_removing_a_file_that_is_not_there_is_file_not_found_as_on_the_node(tmp_path):
    """`Path(stale).unlink(missing_ok=True)` of a file that is not there: FileNotFoundError, which
    missing_ok passes; under bubblewrap's read-only mount the call said EROFS and the run failed
    (ultralytics' cleanup of a partial download), the script blamed for network use."""
    (tmp_path / "train.py").write_text(
        "import os, pathlib, torch\n"
        "pathlib.Path(__file__).with_name('stale.lock').unlink(missing_ok=True)\n"
        "try:\n    os.remove('gone.part')\nexcept FileNotFoundError:\n    pass\n"
        "m = torch.nn.Linear(64, 64).cuda()\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(4):\n    m(torch.randn(8, 64, device='cuda')).sum().backward()\n    opt.step()\n"
        "    opt.zero_grad()\n")
    (est,), run = estimate_command(parse_train_command("python train.py"), [A100], cwd=str(tmp_path))
    assert run.steps == 3


def test_a_manager_started_by_spawn_pickles_the_pool_class():
    """A Manager started with spawn pickles its registry, multiprocessing.pool.Pool among it: vest's
    thread-pool stand-in for fork pools was a class local to a function, which does not pickle, and
    the script was blamed (lingua)."""
    (est,), run = estimate_script("manager_spawn_train.py")
    assert run.steps == 3


def test_forkserver_workers_are_processes_not_network_use():
    """multiprocessing's forkserver (SubprocVecEnv's default on Linux) hands each worker its pipes
    by sendmsg on a connected UNIX socket: that is no network use (it was refused as such)."""
    (est,), run = estimate_script("forkserver_env_train.py")
    assert run.steps == 3 and est.peak_bytes > 0


def test_a_tensor_made_from_device_scalars_reads_them_as_stand_ins():
    """torch.tensor([meter.sum, meter.count], device=...) where the sum is a 0-d device tensor: the
    C++ constructor reads each element with Python dispatch off, which reached the real GPU ("Found no
    NVIDIA driver", refused as vest's gap); it reads the value the fake mode would give, listed."""
    (est,), run = estimate_script("meter_reduce_train.py")
    assert run.steps == 3


def test_a_native_write_past_the_overlay_is_vests_gap_not_the_scripts():
    """Compiled code (Arrow's parquet writer, C++) opens its path itself, past the Python-level
    overlay, and misses the folder the script made there: on the node the save succeeds, so the
    failure is vest's to say (before: "the script failed", fix the script). (tokenizers' Rust save,
    the first such writer seen, now goes through the overlay: the test below.)"""
    with pytest.raises(EstimateError) as e:
        estimate_script("native_save_train.py")
    assert e.value.kind == "vest-unsupported" and "past vest's file overlay" in str(e.value)
    assert e.value.where.endswith("native_save_train.py:18")


def test_a_file_the_script_wrote_read_back_by_compiled_code_is_vests_gap():
    """A log image written with Python, read back by compiled code that opens the path itself
    (YOLOv5's logger: cv2.imread, which returns None for a file it does not find): the file is in
    the overlay only, so the reader failed here where it succeeds on the node, and the script was
    blamed. It is vest's gap, naming the file."""
    before = set(os.listdir(SCRIPTS))
    with pytest.raises(EstimateError) as e:
        estimate_script("overlay_native_read_train.py")
    assert e.value.kind == "vest-unsupported" and "past vest's file overlay" in str(e.value)
    assert os.path.join(SCRIPTS, "train_images.bin") in str(e.value) and set(os.listdir(SCRIPTS)) == before


def test_a_thread_inside_a_file_call_does_not_let_another_past_the_overlay():
    """The overlay's guard against its own recursion was one flag for the process: while a logger's
    thread sat inside a file call, the training thread's makedirs went to the real path, read-only
    here (diffusers' save_pretrained beside accelerate's TensorBoard writer). It is per thread."""
    before = set(os.listdir(SCRIPTS))
    (est,), run = estimate_script("thread_io_train.py")
    assert run.steps == 3 and set(os.listdir(SCRIPTS)) == before
    assert any(p.endswith(os.path.join("run_out", "step1.txt")) for p in run.redirected_writes)


def test_work_a_training_loop_does_every_k_steps_past_the_traced_ones_is_said():
    """`if step % eval_every == 0: evaluate()` inside the training loop, with the period past the
    traced steps: the evaluation (batch 4,096) is not in the trace, so the estimate says which
    branch was not reached, in the script's own module (periodic_loop.py) or in the script; its
    logging on a period and a branch behind a switch that is off are not said. With a period
    the steps reach, the evaluation is traced and nothing is said."""
    eval_out = 4096 * 1024 * 4   # the evaluation's hidden layer
    (est,), run = estimate_script("periodic_eval_train.py")
    said = [f for f in run.flags if "not reached" in f]
    assert len(said) == 1 and "periodic_loop.py:32" in said[0] and "calls evaluate" in said[0]
    assert dict(est.breakdown)["live_tensor_peak"] < eval_out
    (est,), run = estimate_script("periodic_eval_train.py", "--here")
    said = [f for f in run.flags if "not reached" in f]
    assert len(said) == 1 and "periodic_eval_train.py:45" in said[0] and "`if it % args.eval_every == 0:`" in said[0]
    (est,), run = estimate_script("periodic_eval_train.py", "--sample")   # the switch on: its period said too
    said = [f for f in run.flags if "not reached" in f]
    assert len(said) == 1 and "periodic_loop.py:32" in said[0] and "periodic_loop.py:35" in said[0]
    (est,), run = estimate_script("periodic_eval_train.py", "--eval-every", "2")
    assert not [f for f in run.flags if "not reached" in f]
    assert dict(est.breakdown)["live_tensor_peak"] >= eval_out


def test_weights_from_a_checkpoint_and_weights_built_here_are_assigned_into_each_other():
    """`param.data = value` between a weight read from a file (a real host tensor) and one a
    module built here (fake): transformers' resize_token_embeddings after from_pretrained
    (`old.weight.data = new.weight.data`), then the rows averaged on the host; and a tensor of a
    safetensors file assigned into a built layer by hand. Both were "vest cannot yet run this"."""
    params = lambda vocab: 4 * (2 * vocab * 64 + 64 * 64 + 64)   # fp32: embedding, Linear(64, 64), head
    (est,), run = estimate_script("resize_embeddings_train.py")   # 1,000 rows grown by 24
    assert dict(est.breakdown)["parameters"] == params(1024) and run.steps == 3
    (est,), run = estimate_script("resize_embeddings_train.py", "--by-hand")
    assert dict(est.breakdown)["parameters"] == params(1000) and dict(est.breakdown)["optimizer_state"] == 2 * params(1000)


def test_device_memory_that_grows_with_the_steps_is_said():
    """Outputs kept on the GPU every step (a metric at the epoch's end): the live tensors at the
    step ends grow by 2 MiB a step (512 x 1024 float32), so the estimate of the first steps is
    FLAGGED; kept on the host, nothing grows and nothing is said."""
    (est,), run = estimate_script("kept_outputs_train.py")
    said = [f for f in run.flags if "grew" in f]
    assert len(said) == 1 and "a loss kept with its graph" in said[0]
    ends = run.trace.live_at_step_ends()
    assert [b - a for a, b in zip(ends[-3:], ends[-2:])] == [512 * 1024 * 4] * 2
    (est,), run = estimate_script("kept_outputs_train.py", "--keep", "host")
    assert not [f for f in run.flags if "grew" in f]
    # a GAN's discriminator and generator steps end holding different tensors: compared with each
    # other (the step ends alternate) they looked like growth; each optimizer's are compared alone
    (est,), gan = estimate_script("gan_two_optimizers_train.py")
    ends = gan.trace.live_at_step_ends()
    assert ends[0] != ends[1] and not [f for f in gan.flags if "grew" in f], (ends, gan.flags)
    # multi-scale inputs: the step ends rise (each holds its step's batch, larger each step), but
    # each batch is freed by the next step; nothing is kept, nothing is said
    (est,), ms = estimate_script("multiscale_held_batch_train.py")
    ends = ms.trace.live_at_step_ends()
    assert ends[-1] - ends[-2] >= 0.01 * ends[-1] and ends[-2] - ends[-3] >= 0.01 * ends[-1], ends
    assert not [f for f in ms.flags if "grew" in f], ms.flags


def test_a_check_on_a_value_read_from_the_gpu_passes_as_on_a_healthy_run():
    """An assert on GPU values (a stand-in here) passes, as it does on any healthy run (it was
    refused as data-dependent); the same assert on host values (real) fails as the script's own
    error."""
    (est,), run = estimate_script("value_assert_train.py")
    assert run.steps == 3
    with pytest.raises(EstimateError) as e:
        estimate_script("value_assert_train.py", "--host")
    assert e.value.kind == "script-error" and "malformed boxes" in e.value.what
    # run as `python -O`, as a job may: its asserts are gone there and here (PYTHONOPTIMIZE)
    (est,), run = estimate_command(parse_train_command(["python", "-O", "value_assert_train.py", "--host"]), [A100],
                                   cwd=SCRIPTS)
    assert run.steps == 3


def test_a_fork_pool_of_host_work_runs_in_threads():
    """multiprocessing.Pool() (fork) scanning label files with numpy before training: its tasks run
    in threads of the script's process (the same API); a fork was refused as a process starting.
    The classes it found (4: 0-3) size the model."""
    (est,), run = estimate_script("fork_pool_scan_train.py")
    assert run.steps == 3 and dict(est.breakdown)["parameters"] == 4 * (4 * 3 * 3 * 3 + 4)
    # the class itself (`from multiprocessing.pool import Pool`) and a ProcessPoolExecutor, likewise
    (est,), run = estimate_script("fork_pool_class_train.py")
    assert run.steps == 3 and dict(est.breakdown)["parameters"] == 4 * (128 * 10 + 10)


def test_an_op_that_fails_on_real_tensors_too_is_the_scripts_error():
    """`correct[:k].view(-1)` of a transposed tensor raises on any device; the fake tensors raise
    their own error from torch's references, which was taken for vest's gap ("it would run on a
    GPU"). The op is rerun on real host tensors of the same sizes and strides: it fails there too,
    so the script must act. The fixed form (reshape) is estimated."""
    from vest_slurm.dynamic.bootstrap import fails_for_real

    with pytest.raises(EstimateError) as e:
        estimate_script("topk_view_train.py")
    assert e.value.kind == "script-error" and "topk_view_train.py:17" in e.value.where
    # in torch's own words on real tensors (the fake kernel's "Cannot view a tensor ..." differs)
    assert "RuntimeError: view size is not compatible" in e.value.what and "Use .reshape" in e.value.what
    (est,), run = estimate_script("topk_view_train.py", "--reshape")
    assert run.steps == 3
    assert fails_for_real(ValueError("no fake op in this traceback")) is False


def test_whole_number_float_masks_keep_their_values_at_any_size():
    """SimCLR's label masks are made with .float() on the host (0/1) and select by boolean indexing
    on the GPU: over 4,096 elements (batch 64 x 2 views: 16,384) their values were dropped like a
    batch of features', and the run refused as data-dependent. Whole-number floats keep them."""
    (est,), run = estimate_script("contrastive_masks_train.py")
    assert run.steps == 3 and not run.reads   # no value read as a stand-in
    (est,), run = estimate_script("contrastive_masks_train.py", "--batch-size", "256")
    assert run.steps == 3


def test_values_gathered_from_the_other_ranks_are_this_ranks():
    """all_gather of host data (sizes, pickled objects: DETR's all_gather) on the fake process
    group moved no values, and unpickling the gathered bytes failed (blamed on the script). Each
    rank's slot now holds this rank's values, as every rank runs the same script: the batch they
    decide is 100."""
    for args in ((), ("--object",)):
        (est,), run = estimate_command(parse_train_command(["torchrun", "--nproc_per_node", "2", "gather_objects_train.py",
                                                            *args]), [A100], cwd=SCRIPTS)
        assert run.steps == 3 and run.batch_hint == 100, args


def test_training_inputs_that_change_shape_between_steps_are_said():
    """A size drawn per batch (multi-scale training): the traced steps saw some of the sizes, the
    job's peak follows the largest it will draw, so the estimate says the shapes changed; with one
    size for every batch, nothing is said."""
    (est,), run = estimate_script("multiscale_train.py")
    said = [f for f in run.flags if "changed shape" in f]
    assert len(said) == 1 and "(8, 3, " in said[0]
    (est,), run = estimate_script("multiscale_train.py", "--fixed")
    assert not [f for f in run.flags if "changed shape" in f]


def test_a_share_of_the_gpu_the_script_caps_itself_at_is_said():
    """torch.cuda.set_per_process_memory_fraction(0.5): the job runs out at half the GPU's memory,
    which placement on the GPU's size would not see; the estimate says so, with the line."""
    (est,), run = estimate_script("memory_fraction_train.py")
    said = [f for f in run.flags if "caps its GPU memory at 0.5" in f]
    assert len(said) == 1 and "memory_fraction_train.py:7" in said[0]


def test_a_stop_the_script_catches_is_said_not_estimated_as_its_fallback():
    """vest's own stop (a shape the data decides) raised inside the script's try/except: an AMP
    self-test that then reports failure (the script trains in float32, which on a GPU it would not)
    is FLAGGED with where vest stopped and where the script caught it; a catch-all around the whole
    training that then ends without a step is refused as data-dependent at the line that stopped,
    not blamed on the script's arguments. What the self-test made is not kept alive by the stop."""
    (est,), run = estimate_script("swallowed_stop_train.py", "--mode", "amp-check")
    assert run.steps == 3
    said = [f for f in run.flags if "try/except around" in f]
    assert len(said) == 1 and "swallowed_stop_train.py:22" in said[0] and "(in amp_works)" in said[0], run.flags
    # what the failed self-test made (its 32 MiB of candidates) is freed when it returns, as on a GPU:
    # the training holds what it holds without the check (the stop's frames were kept to the end)
    (_,), plain = estimate_script("swallowed_stop_train.py", "--mode", "no-check")
    assert run.trace.live_at_step_ends() == plain.trace.live_at_step_ends()
    with pytest.raises(EstimateError) as e:
        estimate_script("swallowed_stop_train.py", "--mode", "catch-all")
    assert e.value.kind == "data-dependent" and e.value.where.endswith("swallowed_stop_train.py:41"), e.value
    assert "caught that and went on" in e.value.what and "without a training step" in e.value.what


def test_a_local_port_bound_to_find_a_free_one_is_not_network_use():
    """`socket.bind(("", 0))` to pick MASTER_PORT (the DDP helpers' idiom) takes a port of this
    machine and sends nothing: it runs (it was refused as network use). Connections stay refused
    (test_dynamic.py's sandbox test)."""
    (est,), run = estimate_script("free_port_train.py")
    assert run.steps == 3 and any(e.module == "ddp_buckets" for e in run.trace.events)


def test_an_epochs_end_with_no_dataloader_to_end_is_traced_or_said():
    """An evaluation at each epoch's end, at a batch 8x the training one. Batches read one ahead by
    a generator that drained its DataLoader by the epoch's last step (timm's PrefetchLoader): the run
    goes on past the traced steps to the next training step, and the evaluation is in the estimate
    (it ended at the steps before, no word). Batches sliced from tensors in memory: the epoch is
    longer than the steps, its end is not reached, and the estimate says where it is."""
    (est,), run = estimate_script("epoch_end_sliced_train.py", "--mode", "prefetch")
    steps_peak = run.trace.live_peak_bytes(run.trace.step_ends[-1])
    held_out = 64 * 32 * 64 * 64 * 4   # one of the evaluation's activations (batch 64, 32 channels)
    assert run.steps == 3 and run.trace.live_peak_bytes() >= steps_peak + held_out
    assert not [f for f in run.flags if "was not reached" in f], run.flags
    (est,), run = estimate_script("epoch_end_sliced_train.py", "--mode", "sliced")
    said = [f for f in run.flags if "end of the training loop's iteration" in f]
    assert len(said) == 1 and "epoch_end_sliced_train.py:47" in said[0] and "line 43" in said[0], run.flags


def test_a_period_in_the_else_arm_of_a_switch_that_was_on_is_not_said():
    """Gradient accumulation written in both arms of `if args.amp:` (ConvNeXt's and DeiT's
    engine.py): with AMP on, the else arm never runs, so its `if (it + 1) % accum == 0:` is not a
    missed period (it was said, with the advice to shorten it)."""
    for args in (("--amp",), ()):
        (est,), run = estimate_script("amp_switch_accum_train.py", *args)
        assert run.steps == 3 and not [f for f in run.flags if "not reached" in f], (args, run.flags)


def test_inputs_of_a_model_called_with_keywords_that_change_shape_are_said():
    """`model(input_ids=..., labels=...)` (transformers', TRL's loops) with each batch padded to its
    longest: global hooks see no positional input at the top, so the shapes were not compared and the
    estimate was for the first lengths, with no word. The token embedding's input says them."""
    (est,), run = estimate_script("padded_lm_kwargs_train.py")
    said = [f for f in run.flags if "changed shape" in f]
    assert len(said) == 1 and "(4, 48), (4, 96), (4, 64)" in said[0], run.flags
    (est,), run = estimate_script("padded_lm_kwargs_train.py", "--fixed")
    assert not [f for f in run.flags if "changed shape" in f]


def test_a_kernel_the_script_compiles_for_the_gpu_is_vests_gap():
    """torch.cuda._compile_kernel (NVRTC, then the CUDA driver) in a script: it runs on any GPU
    node; here no driver loads (OSError: libcuda.so.1), which is vest's limit, not the script's."""
    with pytest.raises(EstimateError) as e:
        estimate_script("runtime_kernel_train.py")
    assert e.value.kind == "vest-unsupported" and e.value.where.endswith("runtime_kernel_train.py:6"), e.value


def test_a_preflight_forward_that_builds_no_graph_does_not_say_the_batch():
    """A batch-1 inference through a wrapper that turns grad off inside its own forward (YOLOv5's
    AMP check through AutoShape), called under grad: it built no graph, so it is setup, and the
    training forward says the batch (it said 1 and flagged the command's 16)."""
    (est,), run = estimate_script("wrapped_precheck_train.py")
    assert run.steps == 3 and run.batch_hint == 16 and not [f for f in run.flags if "saw a batch" in f], run.flags


def test_files_written_through_fileio_go_to_the_overlay():
    """io.FileIO opened for writing (blobfile's local writer subclasses it) was refused as a write
    outside the temp dir; it goes to the overlay as open() does, the script reads it back, and
    open()'s own files are still io.FileIO to isinstance. Nothing is written into the script's dir."""
    before = set(os.listdir(SCRIPTS))
    (est,), run = estimate_script("fileio_checkpoint_train.py")
    assert run.steps == 3 and set(os.listdir(SCRIPTS)) == before
    assert any(p.endswith(os.path.join("fileio_ckpt", "model000000.pt")) for p in run.redirected_writes)


def test_a_loader_read_by_next_in_a_generator_is_not_ended_by_a_stop_iteration():
    """YOLOv5's InfiniteDataLoader reads its iterator with next() inside its __iter__ generator:
    the StopIteration that ends an epoch early became "generator raised StopIteration" (PEP 479),
    said as the script's failure at the epoch's end. Such a loader's epoch is left to run; the next
    training step ends the run, and the evaluation at the epoch's end, not reached, is said."""
    (est,), run = estimate_script("generator_loader_train.py")
    assert run.steps == 3 and not [f for f in run.flags if "StopIteration" in f], run.flags
    said = [f for f in run.flags if "end of the training loop's iteration" in f]
    assert len(said) == 1 and "generator_loader_train.py:42" in said[0] and "line 38" in said[0], run.flags


def test_an_sqlite_database_the_script_writes_goes_to_the_overlay():
    """sqlite3.connect("metrics.db"): SQLite's C code opens the file itself, past the Python-level
    overlay (under bubblewrap the read-only file system failed it, said as the script's error).
    It opens the overlay's copy; the script reads back what it wrote; nothing lands in its dir."""
    before = set(os.listdir(SCRIPTS))
    (est,), run = estimate_script("sqlite_metrics_train.py")
    assert run.steps == 3 and set(os.listdir(SCRIPTS)) == before
    assert any(p.endswith("metrics.db") for p in run.redirected_writes)


def test_a_preference_step_with_adapters_and_checkpointed_blocks_is_traced_as_the_job_runs_it():
    """TRL's DPO with peft, in small: (1) the sampler's permutation, drawn from the loop's own seeded
    generator, is the job's (a draw of a few numbers on the host took vest's fixed-seed generator, so
    other batches were traced than the job's first ones); (2) peft's disable_adapter sets
    requires_grad_ on the adapter weights between micro-batches, which ended a step as a hand-written
    update, after half an accumulation; (3) a non-reentrant checkpoint's recomputation stops early
    by raising, which skipped the forward hooks that close module calls, so every later call of the
    model was taken for an inner one and its padded lengths were not compared: no flag."""
    g = torch.Generator()
    g.manual_seed(42)
    order = torch.randperm(32, generator=g).tolist()
    longest = [max(16 + 7 * j for j in order[i:i + 4]) for i in range(0, 24, 4)]   # 3 steps of 2 micro-batches
    (est,), run = estimate_script("preference_lora_train.py")
    assert run.steps == 3 and run.stopped_by == "optimizer steps", run.stopped_by
    assert dict(run.observed)["grad_accum"] == 2
    said = [f for f in run.flags if "changed shape" in f]
    assert len(said) == 1 and said[0].startswith("the PolicyLM model's"), run.flags
    assert ", ".join(str((4, n)) for n in list(dict.fromkeys(longest))[:4]) in said[0], (longest, said)
    assert f"the largest (4, {max(longest)})" in said[0], (longest, said)


def test_the_host_generator_draws_as_the_jobs_after_a_model_built_on_the_host():
    """A model initialised on the host keeps fake weights, whose fills drew nothing where the job's
    draw from the host's generator: the DataLoader's shuffle (seeded from that generator) then gave
    another order, and other padded lengths were traced than the job's first batches. The fills are
    drawn into real scratch tensors, so the order is the job's (read here from the script run on the
    host, with no GPU)."""
    lengths = subprocess.run([sys.executable, "shuffled_padded_train.py", "--print-lengths"], cwd=SCRIPTS,
                             capture_output=True, text=True, check=True).stdout.split()
    (est,), run = estimate_script("shuffled_padded_train.py")
    assert run.steps == 3
    said = [f for f in run.flags if "changed shape" in f]
    first = list(dict.fromkeys(lengths[:3]))
    assert len(said) == 1 and f"steps ({', '.join(f'(4, {n})' for n in first)}" in said[0], (lengths, said)


def test_bitsandbytes_4bit_weights_are_quantized_on_the_fake_gpu():
    """QLoRA: bitsandbytes' Params4bit wraps each weight with torch.Tensor._make_subclass, which
    failed on a fake weight ("already associated to a python object of type FakeTensor"): every
    4-bit or 8-bit load was refused. The wrapper is now a fake tensor of the library's class, its
    .cuda() quantizes through bitsandbytes' own ops (fake kernels), and the weights take their
    packed size: half a byte per weight and the quantisation statistics, not four bytes."""
    (est,), run = estimate_script("bnb_qlora_train.py")
    assert run.steps == 3
    b = dict(est.breakdown)
    weights = 2 * 1024 * 4096
    adapters = 4 * 16 * (1024 + 4096) * 2
    packed = weights // 2 + adapters
    assert packed <= b["parameters"] <= packed + weights // 16, (b["parameters"], packed)   # (statistics: < 1 byte per 16 weights)
    assert b["gradients"] == adapters and b["optimizer_state"] == 2 * adapters, b


def test_quantized_weights_moved_again_keep_their_class():
    """A trainer moves a QLoRA model that .cuda() already quantized (accelerate's prepare, trl's SFT
    with --load_in_4bit, litgpt's --quantize bnb.nf4 through Fabric): Params4bit.to() returns a new
    Params4bit, which vest wrapped in another Parameter, and torch refused ("detach() returns ...
    FakeTensor"). The library's own parameter now takes the old one's place, as on a GPU."""
    (est,), run = estimate_script("bnb_moved_again_train.py")
    (once,), _ = estimate_script("bnb_qlora_train.py")
    assert run.steps == 3
    b, b1 = dict(est.breakdown), dict(once.breakdown)
    adapters = 4 * 16 * (1024 + 4096) * 2
    assert b["parameters"] < 2 * 1024 * 4096 and b["gradients"] == adapters and b["optimizer_state"] == 2 * adapters, b
    assert b["parameters"] <= b1["parameters"]   # (bnb_qlora_train.py's statistics are double-quantized)


def test_a_parameter_rebuilt_with_its_own_class_stays_a_parameter():
    """type(p)(data, requires_grad=...) (accelerate's set_module_tensor_to_device and
    init_empty_weights, through which every diffusers from_pretrained loads): a fake parameter's
    class is FakeTensor, whose constructor wanted a fake mode, so each diffusers training script
    failed at its first load. The call makes a parameter, as it does with nn.Parameter's class."""
    (est,), run = estimate_script("param_rebuild_train.py")
    params = 4 * (256 * 512 + 512 + 512 * 256 + 256)
    b = dict(est.breakdown)
    assert run.steps == 3 and b["parameters"] == params and b["optimizer_state"] == 2 * params, b


def test_passes_under_grad_before_an_optimizer_steps_are_no_training_steps():
    """A DQN fills its replay buffer choosing actions with the Q-network under grad, its Adam made
    before: those passes were taken for a forward-only training (2N + 1 passes, no backward), and
    the estimate had no gradients, no optimizer state, batch 1 (CleanRL's dqn.py: -74%, no flag).
    An optimizer holding the model's weights steps later: the run goes on to its steps."""
    (est,), run = estimate_script("warmup_forwards_train.py")
    params = 4 * (128 * 512 + 512 + 512 * 512 + 512 + 512 * 4 + 4)
    b = dict(est.breakdown)
    assert run.steps == 3 and run.stopped_by == "optimizer steps" and run.batch_hint == 32, (run.stopped_by, run.batch_hint)
    assert b["gradients"] == params and b["optimizer_state"] == 2 * params, b


def test_torch_distributions_validation_reads_a_healthy_runs_answer():
    """torch.distributions checks its parameters and samples (validate_args, on by default) with
    `if not torch._is_all_true(constraint.check(value)): raise ValueError`: the read of a fake
    tensor answered False, so every PPO/A2C/SAC script was refused. A validation reads true."""
    (est,), run = estimate_script("policy_gradient_train.py")
    assert run.steps == 3 and run.batch_hint == 512


def test_generate_ends_at_its_max_length():
    """transformers' generate ends its decoding loop on bool(unfinished.max() == 0), where
    unfinished = ones & ~(criteria | ...): a read of a fake tensor answered False, so the loop ran
    to the time limit. The max length's criterion is a known fill, and x | True is True whatever
    the EOS check: the values known without data end the loop at the max length."""
    (est,), run = estimate_script("generate_then_train.py")
    assert run.steps == 3 and not [f for f in run.flags if "time limit" in f], run.flags


@pytest.mark.parametrize("args", [(), ("--lists",)])
def test_a_ctc_loss_takes_its_shape_from_the_target_lengths(args):
    """CTC's log_alpha is (batch, T, 2 * max(target_lengths) + 1): a shape the lengths' values
    decide, so FakeTensorMode stopped on it and every CTC script (wav2vec2, OCR) was refused as
    data-dependent, though the lengths are the script's own host data. They are read; the backward
    makes the gradient and a log_beta as LossCTC.cu does."""
    (est,), run = estimate_script("ctc_train.py", *args)
    alpha = 4 * 8 * 200 * (2 * 40 + 1)
    sizes = [e.size_bytes for e in run.trace.events if e.action == "alloc"]
    assert run.steps == 3 and sizes.count(alpha) >= 2 * 3, sizes.count(alpha)   # log_alpha and log_beta each step


def test_a_tokenizer_saved_by_its_compiled_code_goes_to_the_overlay():
    """tokenizers' Tokenizer.save (Rust, under every save_pretrained and Trainer.save_model) wrote
    past the overlay into a folder the script made, which exists in the overlay only: the save
    failed, the flag quoted it as the script's error, and the evaluation after it, the job's peak,
    went untraced. Its paths go through the overlay; nothing lands in the script's folder."""
    before = set(os.listdir(SCRIPTS))
    (est,), run = estimate_script("tokenizer_save_train.py")
    assert set(os.listdir(SCRIPTS)) == before and not [f for f in run.flags if "stopped there" in f], run.flags
    assert run.trace.live_peak_bytes() >= 2 * 16384 * 1024 * 4   # the evaluation's input and output
    assert any(p.endswith(os.path.join("tok_out", "tokenizer.json")) for p in run.redirected_writes)


def test_draws_on_the_host_in_a_constructor_are_the_jobs_not_sampled():
    """A model's constructor runs where its tensors stay fake (no host memory for weights): a random
    fill there (``torch.empty(1).uniform_()``, a random crop in a mock forward pass) got a value
    drawn from vest's own seeds and was flagged as the GPU's random draw deciding shapes. It is a
    host draw: its value now comes from the script's generator, as in the job. The layer width the
    script draws is the job's (read from the script run on the host), and nothing is flagged."""
    width = int(subprocess.run([sys.executable, "constructor_mock_pass_train.py", "--print-width"], cwd=SCRIPTS,
                               capture_output=True, text=True, check=True).stdout)
    (est,), run = estimate_script("constructor_mock_pass_train.py")
    assert run.steps == 3 and not run.flags, run.flags
    params = (3 * 8 * 9 + 8) + (8 * 32 * 32 * width + width) + (width * 10 + 10)
    assert dict(est.breakdown)["parameters"] == 4 * params, width


def test_lightnings_own_launcher_runs_rank_0_here_and_starts_no_other_rank():
    """Fabric(devices=2).launch() run as ``python train.py`` re-runs the script for rank 1 with
    subprocess.Popen, which the run refuses (its GPU work would be missing): the estimate was
    refused. Rank 0 now runs here, rank 1 is not started (it runs the same step on its own GPU, as
    an mp.spawn rank does), and the process group of 2 is the fake one: DDP's buckets and NCCL."""
    cmd = parse_train_command(["python", "fabric_two_devices_train.py"])
    (est,), run = estimate_command(cmd, [A100], num_gpus=2, cwd=SCRIPTS)
    assert run.steps == 3
    b = dict(est.breakdown)
    params = 4 * (1024 * 4096 + 4096 + 4096 * 1024 + 1024)
    assert b["parameters"] == params and b["optimizer_state"] == 2 * params and b["nccl"] > 0, b


def test_a_script_asking_for_more_gpus_than_it_was_given_says_to_give_the_jobs_count():
    """The same script estimated as one GPU (no --num-gpus): Lightning finds one device and raises;
    that is not the script's fault but the estimate's GPU count, and the message says so."""
    with pytest.raises(EstimateError) as e:
        estimate_script("fabric_two_devices_train.py")
    assert "asks for more GPUs than the 1 it ran with here" in str(e.value), str(e.value)
    assert "--num-gpus" in e.value.fix and "fix the script" not in e.value.fix


def test_a_small_mask_over_sampled_tokens_is_bounded_and_flagged():
    """Boolean indexing on tokens the model sampled (trl's GRPO finds each row's first EOS so): no
    host data decides the mask, and the run was refused as data-dependent. A mask of a few elements
    per sequence is taken as all selected, the most it can select, and the estimate says so; here
    it is what the same step written with torch.where needs, to the MiB."""
    (est,), run = estimate_script("sampled_mask_train.py")
    (where, ), plain = estimate_script("sampled_mask_train.py", "--where")
    assert run.steps == 3 and not plain.flags
    said = [f for f in run.flags if "every element was taken as selected" in f]
    assert len(said) == 1 and "sampled_mask_train.py:23" in said[0], run.flags
    live, live_where = dict(est.breakdown)["live_tensor_peak"], dict(where.breakdown)["live_tensor_peak"]
    assert abs(live - live_where) < 1 << 20, (live, live_where)


MANUAL_PRECISION = """import torch, torch.nn as nn, torch.nn.functional as F

class Linear(nn.Linear):   # fp32 masters, computed in the input's dtype (nanochat's)
    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype))

class Net(nn.Module):
    def __init__(self, half):
        super().__init__()
        self.norm = nn.LayerNorm(256)                           # kept fp32, first of the weights
        self.emb = nn.Embedding(1000, 256)
        self.body = nn.Sequential(Linear(256, 1024), nn.GELU(), Linear(1024, 256))
        if half:   # improved-diffusion's convert_to_fp16: the torso in half, its norms fp32
            self.body.half()
        self.half_ = half

    def forward(self, idx):
        h = self.norm(self.emb(idx).float())
        return self.body(h.half() if self.half_ else h.bfloat16()).float().sum()

net = Net(MODE == "half").cuda()
opt = torch.optim.AdamW(net.parameters())
for _ in range(4):
    loss = net(torch.randint(0, 1000, (8, 64), device="cuda"))
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.parametrize("mode, precision", [("cast", "amp-bf16"), ("half", "fp16")])
def test_the_workload_says_the_precision_the_script_computes_in(tmp_path, mode, precision):
    """The precision in the workload block was the first parameter's dtype: nanochat's fp32
    masters cast to bf16 in each Linear (its compute bf16, no autocast) read "fp32", as did
    improved-diffusion's fp16 torso behind an fp32 norm. Now the dtype of most weight bytes, and
    for fp32 weights the dtype the first Linear computes in (fp32 masters, half compute: amp's)."""
    (tmp_path / "train.py").write_text(f"MODE = {mode!r}\n" + MANUAL_PRECISION)
    _, run = estimate_command(parse_train_command(["python", "train.py"]), [A100], cwd=str(tmp_path))
    assert dict(run.observed)["precision"] == precision


ZERO_GRAD_PLACES = """import sys, torch, torch.nn as nn
where = sys.argv[1]
model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10)).cuda()
opt = torch.optim.AdamW(model.parameters())
x, y = torch.randn(64, 512, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
for step in range(5):
    if where == "top":
        opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    if where == "model":
        model.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    with torch.no_grad():   # an evaluation after each step
        model.eval(); acc = (model(x).argmax(1) == y).float().mean(); model.train()
"""


@pytest.mark.parametrize("where, said", [("top", "after-step"), ("model", "before-backward")])
def test_zero_grad_is_placed_by_the_training_forwards_only_and_seen_on_the_model_too(tmp_path, where, said):
    """optimizer.zero_grad() at the loop's top after a no-grad evaluation (gcn.py) read
    "before-backward" (the evaluation's forward counted); makemore's model.zero_grad(set_to_none=True)
    between forward and backward was not seen at all ("after-step")."""
    (tmp_path / "train.py").write_text(ZERO_GRAD_PLACES)
    _, run = estimate_command(parse_train_command(["python", "train.py", where]), [A100], cwd=str(tmp_path))
    assert dict(run.observed)["zero_grad"] == said


FRAMEWORK = """import torch

def fit(model, monitor):
    logged = {}
    for _ in range(4):
        loss = model(torch.randn(8, 16, device="cuda")).square().mean()
        loss.backward()
        logged["loss"] = float(loss)   # a logged value: read to the host (a stand-in here)
    if monitor not in logged:
        raise KeyError(f"could not find the monitored key {monitor!r} in {sorted(logged)}")
"""


def test_a_value_read_then_failed_on_is_data_dependent_a_frameworks_own_error_is_the_scripts(tmp_path):
    """An error was taken as data-dependent where any line under the script's innermost line read
    a value: every read a framework makes inside `trainer.fit()` maps to that one line, so a
    misconfigured callback (Lightning's ModelCheckpoint(monitor=) typo) was said as vest's lack of
    data. The raising line itself must have read it, in the script or in the library."""
    lib = tmp_path / "lib" / "site-packages"
    lib.mkdir(parents=True)
    (lib / "vest_fakeframework.py").write_text(FRAMEWORK)
    (tmp_path / "train.py").write_text(
        "import sys, torch\nsys.path.insert(0, 'lib/site-packages')\nimport vest_fakeframework\n"
        "model = torch.nn.Linear(16, 4).cuda()\nvest_fakeframework.fit(model, 'val_acc')\n")
    with pytest.raises(EstimateError) as e:
        estimate_command(parse_train_command("python train.py"), [A100], cwd=str(tmp_path))
    assert e.value.kind == "script-error" and "could not find the monitored key" in str(e.value), str(e.value)
    (tmp_path / "train.py").write_text(
        "import torch\nmodel = torch.nn.Linear(16, 4).cuda()\nx = torch.randn(8, 16, device='cuda')\n"
        "keep = torch.zeros(int(model(x).sum().item()) - 5, 16, device='cuda')\n")
    with pytest.raises(EstimateError) as e:
        estimate_command(parse_train_command("python train.py"), [A100], cwd=str(tmp_path))
    assert e.value.kind == "data-dependent" and "train.py:4" in str(e.value), str(e.value)


DEFAULT_DEVICE = """import torch, torch.nn as nn
if MODE == "device":
    torch.set_default_device("cuda")
else:   # nerf-pytorch's run_nerf.py, research code of its time
    torch.set_default_tensor_type("torch.cuda.FloatTensor")
model = nn.Sequential(nn.Linear(63, 256), nn.ReLU(), nn.Linear(256, 4))
opt = torch.optim.Adam(model.parameters())
for _ in range(4):
    x = torch.rand(1024, 63)                   # no device: the default's
    target = torch.Tensor([0.5])               # the legacy constructor: the default type's device
    loss = ((model(x) - target) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.parametrize("mode", ["device", "tensor_type"])
def test_a_default_cuda_device_makes_factories_and_legacy_constructors_fake_cuda(tmp_path, mode):
    """torch.set_default_device("cuda") and the legacy set_default_tensor_type("torch.cuda.FloatTensor"):
    the default device's context sits at the bottom of torch's mode stack, below the fake GPU's,
    which took `torch.rand(1024, 63)` for host work and ran it for real ("Found no NVIDIA driver",
    vest's gap); the legacy type was not taken at all."""
    (tmp_path / "train.py").write_text(f"MODE = {mode!r}\n" + DEFAULT_DEVICE)
    (est,), run = estimate_command(parse_train_command("python train.py"), [A100], cwd=str(tmp_path))
    params = 4 * (63 * 256 + 256 + 256 * 4 + 4)
    b = dict(est.breakdown)
    assert b["parameters"] == params and b["optimizer_state"] == 2 * params, b
    assert run.batch_hint == 1024 and run.trace.live_peak_bytes() >= params * 3 + 1024 * 63 * 4


@pytest.mark.parametrize("cl", [True, False])
def test_the_workload_says_whether_the_script_trains_channels_last(tmp_path, cl):
    """timm's --channels-last (the model's convolutions in channels-last): the workload block said
    channels_last false whatever the script did."""
    (tmp_path / "train.py").write_text(
        "import torch, torch.nn as nn\n"
        "m = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4)).cuda()\n"
        f"if {cl}:\n    m = m.to(memory_format=torch.channels_last)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(4):\n"
        "    x = torch.randn(8, 3, 32, 32, device='cuda').contiguous(memory_format=torch.channels_last)\n"
        "    m(x).sum().backward(); opt.step(); opt.zero_grad()\n")
    _, run = estimate_command(parse_train_command("python train.py"), [A100], cwd=str(tmp_path))
    assert dict(run.observed)["channels_last"] is cl


def test_unsigned_token_buffers_copied_to_the_gpu(tmp_path):
    """llm.c's and modded-nanogpt's `.bin` loaders keep their tokens in uint16 on the host and copy
    them to the GPU with a cast: the span of a large host tensor's values was taken with aminmax,
    which has no CPU kernel for uint16 ("vest cannot yet run this")."""
    (tmp_path / "train.py").write_text(
        "import torch, torch.nn as nn\n"
        "tokens = torch.randint(0, 50000, (4097,), dtype=torch.int32).to(torch.uint16)\n"
        "model = nn.Sequential(nn.Embedding(50304, 64), nn.Linear(64, 50304)).cuda()\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        "for step in range(4):\n"
        "    x = tokens[:-1].to(device='cuda', dtype=torch.int32, non_blocking=True).view(4, 1024)\n"
        "    y = tokens[1:].to(device='cuda', dtype=torch.int64, non_blocking=True).view(4, 1024)\n"
        "    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())\n"
        "    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)\n")
    (est,), run = estimate_command(parse_train_command("python train.py"), [A100], cwd=str(tmp_path))
    assert run.steps == 3 and run.batch_hint == 4


def test_the_api_named_is_never_vests_own_hook():
    """A failure inside vest's hook under a C call of the script (Tensor.to) was said "at
    __torch_function__", vest's own name: no API is named there."""
    from vest_slurm.dynamic.bootstrap import _api_called

    hook = compile("def __torch_function__():\n    raise NotImplementedError('x')\n", "/opt/vest_slurm/estimate/_fakecuda.py", "exec")
    lib = compile("def load_state():\n    raise OSError('y')\n", "/opt/lib/site-packages/somelib/io.py", "exec")
    script = compile("def main(f):\n    f()\n", "/home/u/train.py", "exec")
    for code, said in ((hook, None), (lib, "somelib.io.load_state")):
        ns, main_ns = {}, {}
        exec(code, ns)
        exec(script, main_ns)
        fn = next(v for k, v in ns.items() if callable(v) and not k.startswith("__builtins"))
        try:
            main_ns["main"](fn)
        except Exception as e:
            assert _api_called(e.__traceback__) == said


def test_a_library_installed_in_dist_packages_is_not_taken_for_the_users_code(tmp_path):
    """A package installed by Debian's or Ubuntu's Python (``dist-packages``) is a library, not the
    script: the failure names the script's line that called into it, and the library's function as
    the API called."""
    lib = tmp_path / "usr" / "lib" / "python3" / "dist-packages" / "helperlib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("def check(x):\n    raise ValueError('helperlib: expected 3 channels')\n")
    (tmp_path / "train.py").write_text(
        "import torch\nimport helperlib\n"
        "model = torch.nn.Linear(8, 8).cuda()\n"
        "x = torch.randn(4, 8, device='cuda')\n"
        "helperlib.check(model(x))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(lib.parent), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "vest_slurm.cli", "estimate", "--gpu", "a100-40gb", "--json", "--",
                        "python", "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    doc = json.loads(r.stdout)
    assert doc["kind"] == "script-error" and "expected 3 channels" in doc["error"], r.stderr
    assert doc["where"].endswith("train.py:5"), doc


def test_values_read_to_numpy_are_stand_ins_listed_as_reads():
    """``.cpu().numpy()`` of a device tensor the model computed (TimesNet's FFT periods): the
    stand-in value in every element, listed with its line as an ``.item()`` is; it was an unlisted
    array of zeros, and ``T // period`` failed with the script blamed."""
    (est,), run = estimate_script("fft_period_train.py")
    assert run.steps == 3 and est.peak_bytes > 0
    assert any(r.startswith("numpy at ") and r.endswith("fft_period_train.py:14") for r in run.reads), run.reads


def test_parameters_listed_before_the_model_moved_are_the_ones_trained():
    """An optimizer built after model.cuda() from parameters listed before it (and their gradient
    hooks, registered before): on a GPU the objects are the same; here the move makes new ones.
    The optimizer's state and the gradients were missing (the old objects were never trained);
    now the estimate is the one of the list made after the move."""
    (est,), run = estimate_script("params_before_cuda_train.py", "--list", "before")
    (ref,), plain = estimate_script("params_before_cuda_train.py", "--list", "after")
    assert run.steps == plain.steps == 3
    assert run.trace.live_at_step_ends() == plain.trace.live_at_step_ends() and est.peak_bytes == ref.peak_bytes


def test_a_model_saved_from_the_host_and_moved_back_holds_its_weights_once():
    """``torch.save(net.cpu().state_dict()); net.cuda()`` between steps (CycleGAN's save_networks),
    while the last step's loss holds its graph, whose leaves are the parameters: on a GPU the
    parameters are the same objects, their device memory freed by the move to the host. Here the
    move makes new objects, and the old ones kept their weights and gradients on the device: the
    estimate was a model's weights high (+8 MiB of 40.5, +21%); now it is the run's without saves."""
    (est,), run = estimate_script("save_on_host_train.py", "--save", "2")
    (ref,), plain = estimate_script("save_on_host_train.py")
    assert run.steps == plain.steps == 3
    assert run.trace.live_peak_bytes() == plain.trace.live_peak_bytes() and est.peak_bytes == ref.peak_bytes
    assert run.trace.live_at_step_ends() == plain.trace.live_at_step_ends()


def test_an_optimizer_of_its_own_made_before_the_move_trains_the_moved_parameters():
    """fastai's Learner makes its optimizer (no torch.optim one) before model.to(device); a list for
    clip_grad_norm_ taken before the move: on a GPU the move keeps the parameter objects, here it
    makes new ones, and the old ones held by the script's own objects never got gradients: every
    fastai Learner ended with "0 steps traced", the script blamed. Now they hold the moved ones:
    the run is the one with the optimizer made after the move."""
    (est,), run = estimate_script("plain_optimizer_train.py")
    (ref,), after = estimate_script("plain_optimizer_train.py", "--after")
    assert run.steps == after.steps == 3
    assert run.trace.live_peak_bytes() == after.trace.live_peak_bytes() and est.peak_bytes == ref.peak_bytes


def test_batch_norm_takes_a_contiguous_copy_of_a_transposed_input_as_cudnn_does():
    """On a GPU ATen's batch norm runs cuDNN, which takes (and saves for backward) a contiguous copy
    of a transposed input: the same memory as a script that makes the copy itself. The fake tensors
    took the host's native kernel, which reads the strided input: one activation-sized copy per
    norm missing (PatchTST 4% low)."""
    (est,), run = estimate_script("transposed_batch_norm_train.py")
    (ref,), copied = estimate_script("transposed_batch_norm_train.py", "--copy")
    assert run.trace.live_peak_bytes() == copied.trace.live_peak_bytes()


def test_steps_whose_forward_count_stand_ins_decide_are_flagged():
    """A policy run until its episode ends, one forward kept per environment step until the
    backward, the sampled actions (stand-ins here) deciding the end: the traced episodes are as
    long as the stand-ins make them, and a trained policy's are far longer (CartPole's 500 steps:
    12x the memory), unflagged. Steps of a fixed length, reading the same values, say nothing;
    nor do steps whose counts differ for a reason no value read decides."""
    (est,), run = estimate_script("episode_policy_train.py")
    said = [f for f in run.flags if "different numbers of forward passes" in f]
    assert len(said) == 1 and "(5, 6, 7)" in said[0] and "episode_policy_train.py:" in said[0], run.flags
    (est,), fixed = estimate_script("episode_policy_train.py", "--fixed", "7")
    assert not [f for f in fixed.flags if "forward passes" in f], fixed.flags
    # steps of 2, 1, 2 forwards (a sample drawn every other step) with the loss read after each
    # backward: no forward followed a value read from the one before it, nothing is said (DCGAN)
    (est,), sampled = estimate_script("periodic_sample_train.py")
    assert not [f for f in sampled.flags if "forward passes" in f], sampled.flags


def test_training_in_processes_the_script_starts_is_vests_limit_not_the_scripts():
    """A script that trains in processes it starts itself (I-JEPA: one spawn Process per GPU) trains
    no step in its own process: that is vest's limit, named with the process's target, not "check
    that the script's arguments start training", whether it joins them or lets __main__ end."""
    for args in ((), ("--join",)):
        with pytest.raises(EstimateError) as e:
            estimate_script("process_per_gpu_train.py", *args)
        assert e.value.kind == "vest-unsupported" and "processes of its own with multiprocessing (train)" in e.value.what, e.value
        assert "check that the script's arguments" not in e.value.fix


def test_a_stop_between_training_steps_keeps_the_steps_traced():
    """vest stops in what the script does between two training steps (a validation whose shapes
    the data decides, after an epoch of one step: YOLOv8 on a small data set): the step traced
    stands, flagged with where and what is not in the estimate; it was refused as data-dependent."""
    (est,), run = estimate_script("eval_between_steps_train.py")
    assert run.steps == 1 and est.peak_bytes > 0
    said = [f for f in run.flags if "between its steps" in f]
    assert len(said) == 1 and "after 1 training step(s) of the 3 asked" in said[0], run.flags
    # the same stop in a later step's training forward (a larger batch's mask): refused, not an
    # estimate of the steps before it "stopped between its steps"
    with pytest.raises(EstimateError) as e:
        estimate_script("eval_between_steps_train.py", "--in-step")
    assert e.value.kind == "data-dependent", e.value


def test_an_all_ones_attention_mask_is_dropped_as_transformers_does_on_a_gpu():
    """transformers took vest's fake CUDA tensors for tracing (is_fake_tensor) and kept the 4-D mask
    and per-head key/value copies a GPU run drops: Llama-style fine-tunes 10-23% high, silently.
    With the collator's all-ones mask the estimate is the one without a mask but for the mask's own
    bytes, as on a GPU (it was 12% more here)."""
    (_,), masked = estimate_script("hf_llama_mask_train.py", "--mask")
    (_,), plain = estimate_script("hf_llama_mask_train.py")
    assert masked.trace.live_peak_bytes() - plain.trace.live_peak_bytes() == 4 * 256 * 8   # the mask itself


def test_memory_reserved_holds_what_the_cache_keeps_for_a_probe_that_sizes_the_batch():
    """AutoBatch (ultralytics, YOLOv5) reads torch.cuda.memory_reserved() after a probe's forward and
    backward, where a GPU's cache still holds the activations freed: it read the live bytes alone
    (the input and the gradients), fitted a slope 10-100x too small and chose a batch the GPU run
    never would (here its 65,536 cap), silently. Now the probe reads the peak since empty_cache, and
    the batch fills 60% of the GPU as on a GPU."""
    h100 = get_profile("h100-80gb")
    (est,), run = estimate_command(parse_train_command("python autobatch_train.py"), [h100], cwd=SCRIPTS)
    assert run.batch_hint < 1 << 16
    # the tensors of the batch chosen fill about the 60% the script aimed at (the allocator's rounding
    # and cuDNN's workspaces come on top, in the estimate, as on the GPU)
    live = run.trace.live_peak_bytes()
    assert 0.45 * h100.total_bytes < live < 0.75 * h100.total_bytes, (run.batch_hint, live)


def test_the_backend_a_script_asked_for_is_the_one_it_reads_back(tmp_path):
    """dist.get_backend() said "fake" (the fake group's): OLMo-core picks its device by "nccl" in
    that name, and the run failed with the script blamed. It says the backend asked for."""
    (tmp_path / "train.py").write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('nccl')\n"
        "if 'nccl' not in dist.get_backend():\n    raise NotImplementedError(dist.get_backend())\n"
        "m = torch.nn.Linear(32, 32).cuda()\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(4):\n    m(torch.randn(8, 32, device='cuda')).sum().backward()\n    opt.step()\n    opt.zero_grad()\n")
    (est,), run = estimate_command(parse_train_command("torchrun --nproc_per_node 2 train.py"), [A100],
                                   cwd=str(tmp_path))
    assert run.steps == 3


def test_a_failure_under_a_packages_console_script_is_named_at_the_packages_line(tmp_path):
    """`yolo train ...`: the job runs a package's command, whose file on PATH is pip's wrapper of
    an entry point (imports, then ``sys.exit(main())``). No line of it is the user's: the failure is
    named at the package's line that raised, not at the wrapper's ``sys.exit`` line."""
    pkg = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "tinycli"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "import torch\n\n"
        "def main():\n"
        "    model = torch.nn.Linear(8, 8).cuda()\n"
        "    out = model(torch.randn(4, 8, device='cuda'))\n"
        "    raise ValueError('tinycli: no labels in the data set')\n")
    bin_ = tmp_path / "venv" / "bin"
    bin_.mkdir()
    (bin_ / "tinycli").write_text(   # pip's (distlib's) console-script template
        f"#!{sys.executable}\n# -*- coding: utf-8 -*-\nimport re\nimport sys\nfrom tinycli import main\n"
        "if __name__ == '__main__':\n"
        "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
        "    sys.exit(main())\n")
    (bin_ / "tinycli").chmod(0o755)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pkg.parent), os.environ.get("PYTHONPATH", "")]),
           "PATH": os.pathsep.join([str(bin_), os.environ["PATH"]])}
    r = subprocess.run([sys.executable, "-m", "vest_slurm.cli", "estimate", "--gpu", "a100-40gb", "--json", "--",
                        "tinycli", "--epochs", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    doc = json.loads(r.stdout)
    assert doc["kind"] == "script-error" and "no labels" in doc["error"], r.stderr
    assert doc["where"].endswith(os.path.join("tinycli", "__init__.py") + ":6"), doc


def test_an_update_skipped_on_a_check_of_the_gradients_is_taken_as_a_healthy_run_takes_it():
    """Keras' loss scaling on torch: the update only where every gradient is finite, checked as
    ``stack([all(isfinite(g)) ...]).all()``. A healthy run passes it (isfinite's stand-in is True);
    the stack lost that, the stand-in took the way without the update, and the run ended "without
    a training step", the script blamed. A branch on a value only the data decides (the gradient
    norm under a bound) is said as such: data-dependent, at its line, vest's limit."""
    (est,), run = estimate_script("skip_nonfinite_train.py", "--check", "stack")
    assert run.steps == 3 and dict(est.breakdown)["optimizer_state"] > 0
    with pytest.raises(EstimateError) as e:
        estimate_script("skip_nonfinite_train.py", "--check", "norm")
    assert e.value.kind == "data-dependent" and e.value.where.endswith("skip_nonfinite_train.py:22"), e.value.what
    assert "stand-in" in e.value.what and "limit" in e.value.fix


def test_tensors_of_tagging_subclasses_move_to_the_gpu_and_wrap_its_outputs():
    """torchvision's tv_tensors (transforms v2 pipelines) and a script's own tagging class: their
    ``.cuda()`` failed ("Multiple dispatch failed", the script blamed), ``tv_tensors.wrap`` of a
    device output failed ("already associated to a python object of type FakeTensor"), and
    ``as_subclass(torch.Tensor)`` of a device tensor gave one autograd took for a real GPU's, and a
    class that copies a host tensor's ``__dict__`` over its device result (fastai's set_meta) wiped
    the fake tensor's fields. Now they run as on a GPU: the tag and the metadata kept where torch
    and the class keep them, the estimate the plain script's."""
    (est,), run = estimate_script("tagged_tensors_train.py")
    assert run.steps == 3
    params = 4 * (3 * 16 * 9 + 16 + 16 * 3 * 9 + 3)
    assert dict(est.breakdown)["parameters"] == params


def test_torch_compile_that_records_cuda_graphs_is_said():
    """torch.compile(mode="reduce-overhead") and the other ways to inductor's CUDA graphs (mode
    "max-autotune", options, inductor's config): on the GPU the captured graphs keep private memory
    pools the eager run vest traces has not; the estimate said nothing (torch.cuda.graph itself is
    refused for it). FLAGGED, with the line and the mode that runs as estimated; the default mode
    and max-autotune-no-cudagraphs are not."""
    (ref,), plain = estimate_script("compile_modes_train.py")
    assert not [f for f in plain.flags if "CUDA graphs" in f]
    (est,), run = estimate_script("compile_modes_train.py", "--mode", "max-autotune-no-cudagraphs")
    assert not [f for f in run.flags if "CUDA graphs" in f]
    for args in (("--mode", "reduce-overhead"), ("--mode", "max-autotune"), ("--options-cudagraphs",),
                 ("--config-cudagraphs",)):
        (est,), run = estimate_script("compile_modes_train.py", *args)
        said = [f for f in run.flags if "CUDA graphs" in f]
        assert len(said) == 1 and "compile_modes_train.py:21" in said[0], (args, run.flags)
        assert est.peak_bytes == ref.peak_bytes


def test_a_cuda_graph_captured_after_warm_up_steps_is_refused_as_a_capture_is():
    """The documented whole-step capture: the steps vest traced were the warm-up; the job's steps
    are the graph's replays from its private pool. It was estimated from the warm-up, flagged as
    if the script had gone on to its epoch's end; it is refused as a capture at the start is,
    naming the API."""
    with pytest.raises(EstimateError) as e:
        estimate_script("graph_after_warmup_train.py")
    assert e.value.kind == "vest-unsupported" and "torch.cuda." in e.value.what and "private memory pool" in e.value.what


def test_nvml_answers_as_the_jobs_node_would():
    """pynvml (NVIDIA's DeepLearningExamples set their CPU affinity from NVML before training): there
    is no NVML here, and ``nvmlInit`` failed with the script blamed. It answers as nvidia-smi's
    stand-in does, from the GPU type estimated (an 80 GB type sizes this script's model larger); an
    NVML call it does not answer is vest's gap, not the script's."""
    (est,), run = estimate_script("nvml_affinity_train.py")
    assert run.steps == 3 and dict(est.breakdown)["parameters"] == 4 * (512 * 512 + 512)   # A100 40 GB
    with pytest.raises(EstimateError) as e:
        estimate_script("nvml_affinity_train.py", "--other")
    assert e.value.kind == "vest-unsupported", e.value.what


def test_meta_twins_of_gpu_tensors_are_shapes_only():
    """torch.zeros_like(p.data, device="meta") of a GPU parameter (DeepSpeed ZeRO-1/2's optimizer):
    the host-value shadows took the meta result for host values and compared it ("aten::equal on
    Meta"), vest's own failure. A meta tensor holds no values and no device memory."""
    (est,), run = estimate_script("meta_twin_train.py")
    assert run.steps == 3 and dict(est.breakdown)["parameters"] == 4 * (512 * 512 + 512)


def test_growing_batches_are_flagged_beside_a_read_random_draw():
    """A length-sorted data set (SpeechBrain's default): its batches grow through the epoch, which
    the flag on training inputs that change shape says. A random draw of the GPU read on the host
    (an augmentation's choice) silenced it (the draws' own note was taken to say it): the estimate
    was of the shortest batches (TIMIT CTC: -19% on 1-3 s clips), with no word."""
    (est,), run = estimate_script("sorted_lengths_train.py")
    assert run.steps == 3 and [f for f in run.flags if "changed shape" in f], run.flags


def test_istfts_own_window_check_passes_as_on_a_gpu():
    """torch.istft checks its window's overlap-add in C++ (at::is_scalar_tensor_true, an at::equal
    with ones): the fake mode refused it as data-dependent, with advice about shapes the data
    decides; istft's shapes are its arguments'. The check passes, as a healthy run's does."""
    (est,), run = estimate_script("istft_train.py")
    assert run.steps == 3


def test_the_grad_scalers_own_checks_fail_the_script_as_on_a_gpu():
    """torch's GradScaler refuses fp16 gradients ("Attempting to unscale FP16 gradients.": a model
    cast to half under the scaler, diffusers' LoRA scripts with fp16 from accelerate's config) and a
    second unscale_ in one iteration. The stand-in unscaled them: an estimate of a job that fails
    at its first step. Now it fails as the GPU run does, the script's to fix (no "run it directly":
    it cannot run here); bf16 weights pass, as in torch."""
    (est,), run = estimate_script("grad_scaler_checks_train.py")
    assert run.steps == 3
    (est,), run = estimate_script("grad_scaler_checks_train.py", "--bf16-half")
    assert run.steps == 3
    for flag, words in (("--half", "ValueError: Attempting to unscale FP16 gradients."),
                        ("--twice", "RuntimeError: unscale_() has already been called on this optimizer")):
        with pytest.raises(EstimateError) as e:
            estimate_script("grad_scaler_checks_train.py", flag)
        assert e.value.kind == "script-error" and words in e.value.what, e.value.what
        assert "grad_scaler_checks_train.py:2" in e.value.where and "on the job's GPU" in e.value.fix


def test_the_cuda_runtime_loaded_through_ctypes_answers_as_the_jobs_node_would():
    """ctypes.CDLL("libcudart.so") (Transformer-XL's L2 promotion, asserting the limit it set; device
    count and memory): a login node has no driver, the runtime answered an error code and the
    script's own assert failed, blamed on the script. It answers from the GPU type estimated (an
    A100 40 GB sizes this model smaller); a call it does not answer, or a limit that reserves
    device memory, is vest's gap, named."""
    (est,), run = estimate_script("cudart_ctypes_train.py")
    assert run.steps == 3 and dict(est.breakdown)["parameters"] == 4 * (512 * 512 + 512)
    for flag, api in (("--reset", "cudaDeviceReset"), ("--stack", "cudaDeviceSetLimit")):
        with pytest.raises(EstimateError) as e:
            estimate_script("cudart_ctypes_train.py", flag)
        assert e.value.kind == "vest-unsupported" and api in e.value.what, e.value.what


def test_a_loop_over_iterations_stopped_by_the_epochs_end_is_said_as_such():
    """A trainer that calls next() on its data iterator itself (Megatron-LM's iteration loop): the
    epoch's end vest makes after the traced steps stops it there. The flag said the script "went on
    to the end of the epoch, where it evaluates, samples or saves"; it says what happened."""
    (est,), run = estimate_script("iteration_count_train.py")
    said = [f for f in run.flags if "next()" in f]
    assert run.steps == 3 and len(said) == 1, run.flags
    assert "iteration_count_train.py:17" in said[0] and "counts iterations" in said[0]
    assert "evaluates, samples or saves" not in said[0]


def test_forward_passes_alone_after_reads_of_gpu_values_are_flagged():
    """FGSM's loop goes on only with the samples the model gets right (``pred.item() !=
    target.item()``): with the prediction a stand-in, every sample was skipped. Without an optimizer
    the run stopped on forward passes and printed an estimate without the backward, silently: now
    FLAGGED with the read. With one, it ended "without a training step", the script blamed: now
    refused as data-dependent at the read. Without the read, both train."""
    (est,), run = estimate_script("item_branch_train.py", "--attack")
    said = [f for f in run.flags if "forward passes without a backward" in f]
    assert run.stopped_by.startswith("forward passes") and len(said) == 1, (run.stopped_by, run.flags)
    assert "item_branch_train.py:17" in said[0]
    with pytest.raises(EstimateError) as e:
        estimate_script("item_branch_train.py", "--train")
    assert e.value.kind == "data-dependent" and e.value.where.endswith("item_branch_train.py:17"), e.value.what
    (est,), trained = estimate_script("item_branch_train.py", "--train", "--no-read")
    assert trained.steps == 3 and not [f for f in trained.flags if "forward passes without a backward" in f]
