"""vest-slurm: estimate a PyTorch training job's peak GPU memory on the CPU, then place it on Slurm.

The packages follow the data flow (each package's docstring says what enters and what leaves):

    job script ─► slurm (jobscript) ─► estimate (workload ─► trace ─► replay ─► MemoryEstimate)
                                    └► dynamic (a training command run with fake CUDA ─► trace)
               ─► site (config, placement, advice) ─► slurm (sbatch argv, cluster) ─► job id
    bridge: job_submit.lua's decision in slurmctld, from the estimate vsbatch attached
    gpu: measuring and calibrating on a real GPU

Entry points: ``cli`` (``vest``), ``vsbatch`` (``vsbatch``), ``testbed`` (``scripts/slurm-testbed.sh``).
Shared by all: ``errors`` (the exceptions and exit codes), ``units``.
"""

__version__ = "0.1.0"
