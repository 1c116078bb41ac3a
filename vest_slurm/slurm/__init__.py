"""The Slurm side: job scripts in, sbatch command lines and cluster facts out. No torch here.

- ``jobscript``: a job script's ``#SBATCH`` and ``#VEST`` lines and commands (``JobScript``), and the
  GPU request they make (``GpuRequest``).
- ``cluster``: partitions and their GPU types from the running Slurm, through the command-line
  tools (or pyslurm where it matches), every call bounded by a timeout.
- ``sbatch``: the sbatch argv, built by one pure function.
- ``attach``: the estimate vsbatch attaches to the submitted script (``#VEST-ESTIMATE v1``).
- ``testbed``: a real slurmctld/slurmd on loopback with fake GPUs, for the tests and for trying it out.
"""
