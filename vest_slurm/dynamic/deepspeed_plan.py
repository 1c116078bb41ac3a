"""DeepSpeed in a training command: read what it asks for, refuse the dynamic estimate, and say which
declarative workload stands for it. No torch.

DeepSpeed is not traced: its engine (deepspeed.initialize) builds flat fp32 partitions, CUDA streams
and events and JIT-compiled ops (FusedAdam, ...) that a fake-CUDA run cannot build, and it is not a
dependency of vest-slurm. The per-rank model of ZeRO-1/2/3 (estimate/sharding.py: partitions padded
as stage_1_and_2.py and partition_parameters.py cut them, DeepSpeed's default buckets) covers it
declaratively, so a DeepSpeed job is answered with the #VEST line that names its stage, offload,
precision and gradient bucket, read from the DeepSpeed JSON (``--deepspeed ds.json``: transformers'
Trainer, Megatron-style scripts) or from an accelerate config (``distributed_type: DEEPSPEED``, its
``deepspeed_config`` or ``deepspeed_config_file``). What this does not cover: the model (the user
names it with --model), DeepSpeed settings other than stage, offload, precision and
reduce_bucket_size (the other buckets, stage3_max_live_parameters, activation checkpointing and
partitioning), ZeRO++ and MiCS.

``plan(cmd, cwd)``: None when the command asks for no DeepSpeed, else a DeepSpeedPlan.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..errors import WorkloadError
from ..estimate.workload import bucket_elements
from .launch import TrainCommand

_DS_ARGS = ("--deepspeed_config", "--deepspeed-config", "--deepspeed")


@dataclass(frozen=True)
class DeepSpeedPlan:
    source: str            # where the settings came from
    stage: int | None      # ZeRO stage (None: not said)
    offload: str           # none, optimizer, params (the per-rank model's --offload)
    precision: str | None  # bf16, fp16, or None (fp32)
    reduce_bucket: int = 0  # zero_optimization.reduce_bucket_size in elements (0: DeepSpeed's default, or "auto")
    max_reuse: int | None = None   # zero_optimization.stage3_max_reuse_distance (None: DeepSpeed's default)

    @property
    def what(self) -> str:
        """DeepSpeed as the command asks for it: ZeRO of a stage, or its stage 0 (data parallel)."""
        return "DeepSpeed (ZeRO stage 0: data parallel)" if self.stage == 0 else \
            f"DeepSpeed ZeRO{'-' + str(self.stage) if self.stage else ''}"

    @property
    def vest_line(self) -> str:
        return self.line()

    def line(self, num_gpus: int | None = None, batch: int | None = None) -> str:
        """The #VEST line, with the job's GPU count and per-GPU batch where the command says them."""
        stage = self.stage if self.stage in (1, 2, 3) else None
        parts = ["#VEST --model ...", "--parallelism ddp" if self.stage == 0 else
                 f"--parallelism zero{stage}" if stage else "--parallelism zero2 (its stage: 1, 2 or 3)"]
        if self.offload != "none":
            parts.append(f"--offload {self.offload}")
        if self.precision:
            parts.append(f"--precision {self.precision}")
        if self.reduce_bucket and stage in (2, 3):
            parts.append(f"--reduce-bucket-size {self.reduce_bucket}")
        if self.max_reuse is not None and stage == 3:
            parts.append(f"--max-reuse-distance {self.max_reuse}")
        return " ".join(parts + [f"--num-gpus {num_gpus or 'N'} --batch-size {batch or 'B'} --optimizer ..."])


def _value(args, names) -> str | None:
    """The value of the first of ``names`` given with one (``--deepspeed`` is a bare switch in
    Megatron-DeepSpeed scripts, whose file is ``--deepspeed_config``); "" for a bare switch."""
    bare = None
    for name in names:
        for i, a in enumerate(args):
            k, eq, v = a.partition("=")
            if k != name:
                continue
            v = v if eq else (args[i + 1] if i + 1 < len(args) else "")
            if v and not v.startswith("-"):
                return v
            bare = ""
    return bare


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return {}
    try:
        doc = json.loads(text)
    except ValueError:
        try:
            import yaml

            doc = yaml.safe_load(text)
        except Exception:
            return {}
    return doc if isinstance(doc, dict) else {}


def _from_ds_json(doc: dict, source: str, args=()) -> DeepSpeedPlan:
    zero = doc.get("zero_optimization") or {}
    stage = zero.get("stage") if isinstance(zero.get("stage"), int) else None
    dev = lambda k: str((zero.get(k) or {}).get("device", "none")).lower()   # noqa: E731
    offload = "params" if dev("offload_param") in ("cpu", "nvme") else (
        "optimizer" if dev("offload_optimizer") in ("cpu", "nvme") else "none")
    def on(k: str) -> bool:   # "auto": the Trainer's own --bf16 / --fp16 decides (transformers' HfDeepSpeedConfig)
        v = str((doc.get(k) or {}).get("enabled", False)).lower()
        return v == "true" or (v == "auto" and any(a in (f"--{k}", f"--{k}=True", f"--{k}=true") for a in args))

    precision = "bf16" if on("bf16") else ("fp16" if on("fp16") else None)
    # a number (2e8 is a float in JSON), checked as --reduce-bucket-size checks it; "auto" is
    # transformers' hidden_size squared, not known here: DeepSpeed's default stands
    return DeepSpeedPlan(source, stage, offload, precision, _elements(zero.get("reduce_bucket_size")) or 0,
                         _elements(zero.get("stage3_max_reuse_distance")))


def _elements(v) -> int | None:
    """A size in elements as the JSON gives it (2e8 is a float there), checked as the option checks
    it; None where it is not a number ("auto", absent, bad)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        try:
            return bucket_elements(v)
        except WorkloadError:
            return None
    return None


def _from_script_args(args) -> DeepSpeedPlan:
    """A script that builds its DeepSpeed config in Python from its own switches, as
    DeepSpeed-Chat's ``get_train_ds_config`` does: ``--zero_stage N``, ``--offload`` (parameters
    and optimizer to the CPU), ``--dtype fp16|bf16|fp32``."""
    stage = _value(args, ("--zero_stage", "--zero-stage"))
    dtype = (_value(args, ("--dtype",)) or "").lower()
    return DeepSpeedPlan("the script's own DeepSpeed switches (--deepspeed, no config file)",
                         int(stage) if stage and stage.isdigit() else None,
                         "params" if _value(args, ("--offload",)) is not None else "none",
                         dtype if dtype in ("bf16", "fp16") else None)


def plan_of_initialize(config, args=None) -> DeepSpeedPlan:
    """The plan of a ``deepspeed.initialize`` call in the script (its config a dict built in Python,
    a path, or ``args.deepspeed_config``), for a command that named no DeepSpeed (DeepSpeedExamples'
    ``deepspeed train.py --deepspeed`` with the config in the code)."""
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if isinstance(config, (str, os.PathLike)):
        return _from_ds_json(_load(os.fspath(config)), f"{os.fspath(config)}, given to deepspeed.initialize")
    if isinstance(config, dict):
        return _from_ds_json(config, "the config the script gives deepspeed.initialize")
    return DeepSpeedPlan("deepspeed.initialize, its config not read", None, "none", None)


def plan(cmd: TrainCommand, cwd: str, accelerate_config: str | None = None) -> DeepSpeedPlan | None:
    path = _value(cmd.args, _DS_ARGS)
    if path:
        return _from_ds_json(_load(os.path.join(cwd, path)), f"{path} (the script's DeepSpeed arguments)", cmd.args)
    if path == "":   # a bare switch: the script builds its DeepSpeed config from its own arguments
        return _from_script_args(cmd.args)
    if cmd.launcher == "accelerate":
        cfg = _load(accelerate_config) if accelerate_config else {}
        if "--use_deepspeed" not in cmd.launcher_args and str(cfg.get("distributed_type", "")).upper() != "DEEPSPEED":
            return None
        ds = cfg.get("deepspeed_config") or {}
        file = ds.get("deepspeed_config_file") or _value(cmd.launcher_args, ("--deepspeed_config_file",))
        if file:
            return _from_ds_json(_load(os.path.join(cwd, file)), f"{file} (accelerate's deepspeed_config_file)")
        stage = ds.get("zero_stage", _value(cmd.launcher_args, ("--zero_stage",)))
        off_p = str(ds.get("offload_param_device", "none")).lower()
        off_o = str(ds.get("offload_optimizer_device", "none")).lower()
        mp = str(cfg.get("mixed_precision") or cmd.mixed_precision or "no").lower()
        return DeepSpeedPlan("the accelerate config's deepspeed_config", int(stage) if str(stage).isdigit() else None,
                             "params" if off_p in ("cpu", "nvme") else ("optimizer" if off_o in ("cpu", "nvme") else "none"),
                             mp if mp in ("bf16", "fp16") else None)
    return None
