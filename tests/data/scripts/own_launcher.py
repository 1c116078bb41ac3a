"""A project's own launcher, as torchtune's `tune run --nproc_per_node N recipe` and LLaMA-Factory's
CLI are: it works out the launch and starts torchrun for the training script itself.
--how inprocess: torch.distributed.run's run(args) in this process (tune run);
--how child: a `python -m torch.distributed.run ...` child process, with a variable set for it
(LLaMA-Factory's subprocess.run of torchrun); --how shell: the same through os.system."""
import argparse
import os
import shlex
import subprocess
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--how", choices=("inprocess", "child", "shell"), default="inprocess")
ap.add_argument("--nproc_per_node", default="2")
ap.add_argument("recipe")
ap.add_argument("rest", nargs=argparse.REMAINDER)
args = ap.parse_args()
script = os.path.join(os.path.dirname(os.path.abspath(__file__)), args.recipe)
launch = ["--nproc_per_node", args.nproc_per_node, script, *args.rest]
if args.how == "inprocess":
    from torch.distributed.run import get_args_parser, run

    run(get_args_parser().parse_args(launch))
elif args.how == "child":
    env = dict(os.environ, OMP_NUM_THREADS="4")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", *launch], env=env, check=True)
else:
    sys.exit(os.system(shlex.join([sys.executable, "-m", "torch.distributed.run", *launch])) >> 8)
