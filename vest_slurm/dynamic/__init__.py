"""Dynamic analysis: a training command as a user runs it in, its allocation trace out.

Enters: a command line (``launch.parse_train_command``: ``python train.py``, ``torchrun``,
``accelerate launch``, behind ``srun`` or not) and the device profile to pretend to be.
Leaves: an ``AllocTrace`` and what the run showed (``runner.DynamicRun``), or EstimateError saying
who must act.

``runner`` starts ``bootstrap`` in a bounded child process, which runs the unmodified script with
fake CUDA (``estimate._fakecuda``) and the stand-ins of ``standins`` for what needs a real GPU.
"""
