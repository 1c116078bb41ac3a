"""Training command lines: what to run, and on how many GPUs (pure)."""

import pytest

from vest_slurm.errors import WorkloadError
from vest_slurm.dynamic.launch import find_train_command, parse_train_command


@pytest.mark.parametrize("line,script,module,args,nproc,launcher", [
    ("python train.py --lr 0.1", "train.py", None, ("--lr", "0.1"), 1, "python"),
    ("python3 -u train.py", "train.py", None, (), 1, "python"),
    ("/usr/bin/python3.11 -m pkg.train --epochs 3", None, "pkg.train", ("--epochs", "3"), 1, "python"),
    ("srun --ntasks=1 -c 8 python train.py a", "train.py", None, ("a",), 1, "python"),
    ("srun -n 1 --gres gpu:1 python train.py", "train.py", None, (), 1, "python"),
    ("torchrun --nproc_per_node 4 train.py --bs 32", "train.py", None, ("--bs", "32"), 4, "torchrun"),
    ("torchrun --nproc-per-node=8 --nnodes=1 -m pkg.train x", None, "pkg.train", ("x",), 8, "torchrun"),
    ("python -m torch.distributed.run --nproc_per_node=2 train.py", "train.py", None, (), 2, "torchrun"),
    ("accelerate launch --num_processes 2 --mixed_precision bf16 train.py --x 1", "train.py", None, ("--x", "1"), 2, "accelerate"),
    ("OMP_NUM_THREADS=4 exec python train.py", "train.py", None, (), 1, "python"),
    ("./train.py --fast", "./train.py", None, ("--fast",), 1, "python"),
])
def test_forms(line, script, module, args, nproc, launcher):
    c = parse_train_command(line)
    assert (c.script, c.module, c.args, c.nproc, c.launcher) == (script, module, args, nproc, launcher)


def test_env_prefix_and_mixed_precision_kept():
    c = parse_train_command("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True accelerate launch --mixed_precision=fp16 t.py")
    assert dict(c.env)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and c.mixed_precision == "fp16"


@pytest.mark.parametrize("line,what", [
    ("python -c 'print(1)'", "python -c"),
    ("bash run.sh", "not a Python training command"),
    ("python", "names no script"),
    ("python -m", "-m without a module"),
    ("torchrun --nproc_per_node four train.py", "is not a number"),
    ("python 'train.py", "quotes"),
])
def test_errors_say_what(line, what):
    with pytest.raises(WorkloadError) as e:
        parse_train_command(line)
    assert what in str(e.value)


def test_find_train_command_skips_setup_lines():
    lines = ["module load cuda", "source venv/bin/activate", "echo start", "srun python train.py --x", "echo done"]
    c = find_train_command(lines)
    assert c is not None and c.script == "train.py" and c.args == ("--x",)
    assert find_train_command(["echo hi", "bash other.sh"]) is None


@pytest.mark.parametrize("line,nproc,nnodes,world", [
    ("torchrun --nnodes=2 --nproc_per_node=4 train.py", 4, 2, 8),
    ("torchrun --nnodes 2:2 --nproc-per-node 2 train.py", 2, 2, 4),
    # an elastic range, the job's variables, one per GPU: the job's GPUs decide (-1)
    ("torchrun --nnodes 1:4 --nproc_per_node 2 train.py", 2, -1, -1),
    ("torchrun --nnodes $SLURM_NNODES --nproc_per_node 4 train.py", 4, -1, -1),
    ("torchrun --nnodes=${SLURM_JOB_NUM_NODES} --nproc_per_node=$SLURM_GPUS_ON_NODE train.py", -1, -1, -1),
    ("torchrun --nnodes 2 --nproc_per_node gpu train.py", -1, 2, -1),
    ("accelerate launch --num_processes 8 --num_machines 2 train.py", 8, 1, 8),   # all machines' processes
    ("python train.py", 1, 1, 1),
    ("fabric run --devices=2 --num-nodes 2 train.py", 2, 2, 4),
    ("lightning run model --devices 0,1,2 train.py", 3, 1, 3),
    ("fabric run --devices auto train.py", 1, 1, 1),
    ("fabric run --devices -1 train.py", -1, 1, -1),
    ("fabric run --strategy dp --devices 4 train.py", 1, 1, 1),
])
def test_the_launch_size_over_nodes(line, nproc, nnodes, world):
    c = parse_train_command(line)
    assert (c.nproc, c.nnodes, c.world) == (nproc, nnodes, world)


def test_slurms_own_torchrun_line_is_a_training_command():
    """The multi-node launch of Slurm's and torchrun's docs, its sizes the job's variables: found
    (it was skipped as "not a number", and vsbatch saw no training command in the job)."""
    c = find_train_command(["export MASTER_ADDR=$(scontrol show hostnames | head -n 1)",
                            "srun torchrun --nnodes $SLURM_NNODES --nproc_per_node $SLURM_GPUS_ON_NODE "
                            "--rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 train.py --lr 1"])
    assert c is not None and (c.script, c.args, c.launcher, c.world) == ("train.py", ("--lr", "1"), "torchrun", -1)


def test_rank_variables_over_nodes(tmp_path):
    from vest_slurm.dynamic.runner import _child_env

    env = _child_env(parse_train_command("torchrun --nnodes 2 --nproc_per_node gpu train.py"), str(tmp_path), 8)
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("8", "4")


_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize("line,world,rank_vars", [
    # a plain python process gets no launcher variables at any GPU count (the job's own python
    # has none: nanoGPT's RANK check then takes its one-process branch, as on the GPU node)
    ("python train.py", 1, False),
    ("python train.py", 2, False),
    ("srun python train.py", 1, False),            # srun sets SLURM_PROCID, not RANK
    ("torchrun --nproc_per_node 1 train.py", 1, True),
    ("torchrun --nproc_per_node 2 train.py", 2, True),
    ("accelerate launch train.py", 1, False),      # accelerate's simple_launcher
    ("accelerate launch --num_processes 2 train.py", 2, True),    # multi_gpu_launcher: torchrun
    ("accelerate launch --use_fsdp --num_processes 1 train.py", 1, True),
])
def test_rank_variables_only_where_the_launcher_sets_them(line, world, rank_vars, tmp_path, monkeypatch):
    from vest_slurm.dynamic.runner import _child_env

    for k in _RANK_VARS:
        monkeypatch.delenv(k, raising=False)
    env = _child_env(parse_train_command(line), str(tmp_path), world)
    if rank_vars:
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("0", "0", str(world))
        assert env["MASTER_ADDR"] and env["MASTER_PORT"]
    else:
        assert not any(k in env for k in _RANK_VARS), {k: env[k] for k in _RANK_VARS if k in env}


def test_a_plain_python_run_keeps_the_users_own_rank_variables(tmp_path, monkeypatch):
    """What the user's environment has is what the job's python sees (not overwritten, not removed)."""
    from vest_slurm.dynamic.runner import _child_env

    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    env = _child_env(parse_train_command("python train.py"), str(tmp_path), 1)
    assert env["RANK"] == "3" and "WORLD_SIZE" not in env


def test_the_users_cuda_and_nccl_settings_carry_over_and_this_machines_gpu_selection_does_not(tmp_path, monkeypatch):
    """sbatch carries the submitter's environment to the job: settings a script reads
    (CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron's tensor parallelism asserts; NCCL_*) reach the
    estimate's run as they reach the job (they were all dropped: "fix the script"). Which GPUs this
    machine shows is not the job's (Slurm sets it on the node), nor an enclosing launcher's state."""
    from vest_slurm.dynamic.runner import _child_env

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    env = _child_env(parse_train_command("torchrun --nproc_per_node 2 train.py"), str(tmp_path), 2)
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["NCCL_DEBUG"] == "WARN"
    assert "CUDA_VISIBLE_DEVICES" not in env and "TORCHELASTIC_RUN_ID" not in env


@pytest.mark.parametrize("distributed_type,rank_vars", [("FSDP", True), ("MULTI_GPU", True), ("NO", False)])
def test_accelerate_config_of_one_process_decides_the_launcher(distributed_type, rank_vars, tmp_path, monkeypatch):
    """accelerate launch of one process takes torchrun (multi_gpu_launcher) for an FSDP config, its
    simple launcher otherwise (accelerate.commands.launch.launch_command)."""
    from vest_slurm.dynamic.runner import _child_env

    monkeypatch.delenv("RANK", raising=False)
    config = tmp_path / "acc.yaml"
    config.write_text(f"distributed_type: {distributed_type}\nnum_processes: 1\n")
    cmd = parse_train_command(f"accelerate launch --config_file {config} train.py")
    assert ("RANK" in _child_env(cmd, str(tmp_path), 1, str(config))) == rank_vars


def test_child_env_starts_from_the_users_environment_given(tmp_path):
    """The live oracle and the estimate are given the same user environment (a model cache the job
    reads: HF_HUB_CACHE), not only this process's; the GPU's own variables are not passed on."""
    from vest_slurm.dynamic.runner import _child_env

    user = {"HF_HUB_CACHE": "/data/hub", "CUDA_VISIBLE_DEVICES": "3", "PATH": "/usr/bin"}
    env = _child_env(parse_train_command("python train.py"), str(tmp_path), 1, user_env=user)
    assert env["HF_HUB_CACHE"] == "/data/hub" and "CUDA_VISIBLE_DEVICES" not in env and env["PATH"] == "/usr/bin"


def test_the_estimates_child_computes_the_host_work_on_one_thread(tmp_path):
    """The host's work decides no device memory: one OpenMP/MKL thread, whatever the user's shell
    set (a login node's cores are shared); the live oracle, which computes the model, keeps the
    user's setting."""
    from vest_slurm.dynamic.runner import _child_env

    user = {"OMP_NUM_THREADS": "8", "PATH": "/usr/bin"}
    cmd = parse_train_command("python train.py")
    env = _child_env(cmd, str(tmp_path), 1, user_env=user)
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) == ("1", "1")
    oracle = _child_env(cmd, str(tmp_path), 1, user_env=user, host_threads=False)
    assert oracle["OMP_NUM_THREADS"] == "8" and "MKL_NUM_THREADS" not in oracle


def test_an_environment_the_job_script_activates_is_the_commands_python(tmp_path):
    from vest_slurm.dynamic.launch import find_train_command

    def env_dir(path):
        (path / "bin").mkdir(parents=True)
        (path / "bin" / "python").write_text("")
        (path / "bin" / "activate").write_text("")
        return str(path / "bin")

    venv = env_dir(tmp_path / "venv")
    named = env_dir(tmp_path / "home" / ".conda" / "envs" / "torch24")
    installed = env_dir(tmp_path / "opt" / "miniforge" / "envs" / "lm")
    env = {"PATH": "/usr/bin", "HOME": str(tmp_path / "home"), "CONDA_EXE": str(tmp_path / "opt" / "miniforge" / "bin" / "conda"),
           "WORK": str(tmp_path)}
    cases = {
        (f"source {tmp_path}/venv/bin/activate",): venv,
        (". $WORK/venv/bin/activate",): venv,
        ("conda activate torch24",): named,
        ("mamba activate lm",): installed,
        ("source activate lm",): installed,
        (f"conda activate {tmp_path}/venv",): venv,
        ("conda activate torch24", "conda deactivate"): None,
        ("conda activate no-such-env",): None,
        ("module load pytorch/2.4",): None,   # not resolvable here: PATH as it is, and the estimate says whose Python
    }
    for lines, bin_dir in cases.items():
        cmd = find_train_command([*lines, "srun python train.py --lr 1"], env)
        assert cmd.script == "train.py" and cmd.args == ("--lr", "1")
        assert dict(cmd.env).get("PATH") == (f"{bin_dir}:/usr/bin" if bin_dir else None), lines
    # an environment not found here is named with the lines vest cannot follow; $NAMEs the script
    # exported expand in an activation
    assert find_train_command(["conda activate no-such-env", "python train.py"], env).unresolved == \
        ("conda activate no-such-env",)
    # read with the same words as a found one (quotes and all)
    assert find_train_command(['source "/no/such/venv/bin/activate"', "python train.py"], env).unresolved == \
        ('source "/no/such/venv/bin/activate"',)
    cmd = find_train_command([f"export ENVS={tmp_path}", "source $ENVS/venv/bin/activate", "python train.py"], env)
    assert dict(cmd.env)["PATH"] == f"{venv}:/usr/bin" and cmd.unresolved == ()
    # the command's own PATH= is the user's word
    cmd = find_train_command([f"source {tmp_path}/venv/bin/activate", "PATH=/x python train.py"], env)
    assert dict(cmd.env)["PATH"] == "/x"


def test_what_the_job_script_exports_before_the_command_is_its_environment():
    from vest_slurm.dynamic.launch import find_train_command

    env = {"PATH": "/usr/bin", "HOME": "/home/u", "SCRATCH": "/scratch/u"}
    lines = ["export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
             'export HF_HOME="$SCRATCH/hf" TOKENIZERS_PARALLELISM=false',
             "export OUT='$SCRATCH/literal'",
             "export CACHE=~/cache",
             "export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)",   # computed in the job
             "export GONE=1", "unset GONE",
             "export PATH=$HOME/.local/bin:$PATH",
             "HF_HOME=/own python train.py"]
    env_of = dict(find_train_command(lines, env).env)
    assert env_of == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TOKENIZERS_PARALLELISM": "false",
                      "OUT": "$SCRATCH/literal", "CACHE": "/home/u/cache", "PATH": "/home/u/.local/bin:/usr/bin",
                      "HF_HOME": "/own"}   # the command's own prefix wins


def test_software_loaded_by_modules_is_named_not_followed():
    from vest_slurm.dynamic.launch import find_train_command

    cmd = find_train_command(["module purge", "module load cuda/12.4 pytorch/2.4", "ml gcc", "module list",
                              "spack load py-torch", "python train.py"], {"PATH": "/usr/bin"})
    assert cmd.unresolved == ("module load cuda/12.4 pytorch/2.4", "ml gcc", "spack load py-torch")
    assert find_train_command(["python train.py"], {}).unresolved == ()


def test_fabric_run_hands_its_settings_to_the_script():
    c = parse_train_command("fabric run --devices=2 --strategy ddp --precision bf16-mixed train.py --lr 1")
    assert (c.launcher, c.script, c.args) == ("fabric", "train.py", ("--lr", "1"))
    assert dict(c.env) == {"LT_CLI_USED": "1", "LT_STRATEGY": "ddp", "LT_DEVICES": "2", "LT_NUM_NODES": "1",
                           "LT_PRECISION": "bf16-mixed"}


def test_a_command_built_in_variables_is_the_one_the_shell_runs():
    """Job scripts that build their launch in variables (`export CMD="$LAUNCHER $SCRIPT $ARGS"`,
    `srun $CMD`): expanded as the shell would; what only the running job knows (Slurm's variables,
    $(...), arithmetic on them) stays the job's, and stays out of the child's environment."""
    from vest_slurm.dynamic.launch import JOB_DECIDES

    lines = ["GPUS_PER_NODE=4",
             "head_node_ip=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)",
             'export LAUNCHER="accelerate launch --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) '
             '--num_machines $SLURM_NNODES --main_process_ip $head_node_ip --main_process_port 29500"',
             "SCRIPT=train.py",
             'export ARGS="--lr 3e-4 --out $SCRATCH/runs --gpus $((2 * GPUS_PER_NODE))"',
             'export CMD="$LAUNCHER $SCRIPT $ARGS"',
             "srun $CMD"]
    c = find_train_command(lines, {"PATH": "/usr/bin", "SCRATCH": "/scratch/u"})
    assert (c.launcher, c.script, c.nproc) == ("accelerate", "train.py", -1)
    assert c.args == ("--lr", "3e-4", "--out", "/scratch/u/runs", "--gpus", "8")
    assert c.launcher_args[:4] == ("--num_processes", JOB_DECIDES, "--num_machines", "$SLURM_NNODES")
    assert dict(c.env) == {"ARGS": "--lr 3e-4 --out /scratch/u/runs --gpus 8"}   # LAUNCHER, CMD: the job's
    assert find_train_command(["export A=\"it's $SCRATCH\"", "python t.py $A"], {"SCRATCH": "/s"}).env == (("A", "it's /s"),)
    c = find_train_command(["TRAIN=${TRAIN:-train.py}", "EPOCHS=3",
                            "srun torchrun --nnodes $SLURM_NNODES --nproc_per_node=${GPUS:-2} $TRAIN --epochs $EPOCHS"],
                           {"PATH": "/usr/bin"})
    assert (c.script, c.args, c.nproc, c.nnodes) == ("train.py", ("--epochs", "3"), 2, -1)


def test_accelerates_own_parser_gets_the_process_count_the_estimate_runs():
    from vest_slurm.dynamic.launch import JOB_DECIDES
    from vest_slurm.dynamic.runner import _known_launcher_args

    args = ["--num_processes", JOB_DECIDES, "--num_machines", "$SLURM_NNODES", "--main_process_ip", JOB_DECIDES,
            "--main_process_port", "29500", "--mixed_precision=bf16", "--multi_gpu"]
    assert _known_launcher_args(args, 16) == ["--num_processes", "16", "--main_process_port", "29500",
                                              "--mixed_precision=bf16", "--multi_gpu"]


def test_fabrics_sizes_left_to_the_job_reach_fabric_as_numbers(tmp_path):
    from vest_slurm.dynamic.runner import _child_env

    c = parse_train_command("fabric run --devices $SLURM_GPUS_ON_NODE --num-nodes $SLURM_NNODES train.py")
    env = _child_env(c, str(tmp_path), 8)
    assert (env["LT_DEVICES"], env["LT_NUM_NODES"], env["WORLD_SIZE"]) == ("8", "1", "8")
    c = parse_train_command("fabric run --devices 4 --num-nodes $SLURM_NNODES train.py")
    env = _child_env(c, str(tmp_path), 8)
    assert (env["LT_DEVICES"], env["LT_NUM_NODES"], env["LOCAL_WORLD_SIZE"]) == ("4", "2", "4")


def test_the_directory_the_job_script_goes_to_is_where_its_command_runs():
    c = find_train_command(["cd $SLURM_SUBMIT_DIR", "cd runs", "mkdir -p out; cd exp1 && srun python train.py --x"],
                           {"HOME": "/home/u"})
    assert (c.script, c.args, c.chdir, c.workdir("/sub")) == ("train.py", ("--x",), "runs/exp1", "/sub/runs/exp1")
    assert find_train_command(["cd /scratch/p", "python t.py"], {}).workdir("/sub") == "/scratch/p"
    assert find_train_command(["cd ~/proj", "python t.py"], {"HOME": "/home/u"}).chdir == "/home/u/proj"
    assert find_train_command(["python t.py"], {}).workdir("/sub") == "/sub"


def test_interpreter_flags_that_change_the_program_reach_the_child():
    """`python -O train.py` removes the script's asserts: the child's Python is told through the
    variable that says the same (PYTHONOPTIMIZE); it was dropped, and an assert the job never runs
    could fail the estimate."""
    assert dict(parse_train_command("python -O train.py --x 1").env) == {"PYTHONOPTIMIZE": "1"}
    assert dict(parse_train_command("python -u -OO train.py").env) == {"PYTHONOPTIMIZE": "2"}
    assert parse_train_command("python -u train.py").env == ()


@pytest.mark.parametrize("command,script,args,nproc,nnodes", [
    ("deepspeed --num_gpus 2 train.py --deepspeed ds.json", "train.py", ("--local_rank=0", "--deepspeed", "ds.json"), 2, 1),
    ("deepspeed --num_gpus=4 --num_nodes=2 --hostfile=hosts train.py --x 1", "train.py", ("--local_rank=0", "--x", "1"), 4, 2),
    ("deepspeed --hostfile hosts --master_port 29501 train.py", "train.py", ("--local_rank=0",), -1, -1),
    ("deepspeed --no_local_rank train.py --lr 1", "train.py", ("--lr", "1"), -1, 1),
])
def test_deepspeeds_launcher_is_read_without_deepspeed_installed(command, script, args, nproc, nnodes):
    """`deepspeed train.py` was found only as the console script of an installed DeepSpeed (not a
    dependency here); its launcher is now read as torchrun's is: GPUs per node (--num_gpus, default
    every GPU of the node), nodes (--num_nodes, default the hostfile's), and the legacy
    --local_rank=0 it passes rank 0 before the script's own arguments."""
    cmd = parse_train_command(command)
    assert (cmd.script, cmd.args, cmd.nproc, cmd.nnodes, cmd.launcher) == (script, args, nproc, nnodes, "deepspeed")


@pytest.mark.parametrize("command,args", [
    ("python -m torch.distributed.launch --nproc_per_node 2 train.py --lr 1", ("--local-rank=0", "--lr", "1")),
    ("python -m torch.distributed.launch --use_env --nproc_per_node 2 train.py --lr 1", ("--lr", "1")),
    ("torchrun --nproc_per_node 2 train.py --lr 1", ("--lr", "1")),
])
def test_the_legacy_launcher_passes_the_local_rank_as_an_argument(command, args):
    """torch.distributed.launch, unlike torchrun, passes --local-rank=N to the script unless
    --use-env (torch/distributed/launch.py): a script that reads it (``if args.local_rank != -1``:
    DDP) took its single-GPU branch here."""
    cmd = parse_train_command(command)
    assert cmd.args == args and cmd.nproc == 2
