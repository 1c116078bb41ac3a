"""vest-slurm: estimate a PyTorch training job's peak GPU memory on the CPU, then place it on Slurm."""

__version__ = "0.1.0"
