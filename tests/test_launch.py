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
