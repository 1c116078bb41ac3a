"""``accelerate launch [options] train.py``: the environment accelerate's launcher gives the script,
made by accelerate's own code in the estimate's child process.

Enters: the launcher's option words (TrainCommand.launcher_args, ``--config_file X.yaml`` made
absolute by the runner), in the child's environment variable VEST_ACCELERATE_LAUNCH (JSON). Leaves:
``apply()`` puts the variables accelerate's launcher would set (ACCELERATE_*: mixed precision,
ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED, FSDP_*: sharding strategy, auto-wrap policy,
transformer layer classes, FSDP version, offload, ...) into os.environ before the script runs, so that
``Accelerator()`` builds the same plugins as on the cluster and its ``prepare`` wraps the model with
FullyShardedDataParallel / fully_shard, which fake_dist.py records. The variables come from
``accelerate.commands.launch``'s parser, ``_validate_launch_command`` (the config file's values as
defaults) and ``accelerate.utils.launch.prepare_multi_gpu_env`` / ``prepare_deepspeed_cmd_env``:
nothing of the config format is re-implemented here. Process placement (ranks, ports, hosts) stays
the runner's (rank 0 of the launch's world).

``config_processes(path)`` (parent side, no torch): the config file's num_processes, for the world size.
"""

from __future__ import annotations

import json
import os

ENV = "VEST_ACCELERATE_LAUNCH"
# what the launcher sets for the script's behaviour; the rest (RANK, MASTER_PORT, OMP_NUM_THREADS,
# CUDA_VISIBLE_DEVICES, ...) is process placement, which the runner decides for rank 0
_PREFIXES = ("ACCELERATE_", "FSDP_", "MEGATRON_LM_")


def config_processes(path: str) -> int:
    """num_processes of an accelerate config file (YAML or JSON); 0 where it does not say."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return 0
    try:
        import yaml

        doc = yaml.safe_load(text)
    except Exception:   # no PyYAML, or not YAML: JSON configs are accepted by accelerate too
        try:
            doc = json.loads(text)
        except ValueError:
            return 0
    n = doc.get("num_processes") if isinstance(doc, dict) else None
    return n if isinstance(n, int) and n > 0 else 0


def apply(script: str) -> dict[str, str]:
    """Set accelerate's launch variables in os.environ (in the child); returns what was set."""
    words = os.environ.pop(ENV, None)
    if words is None:
        return {}
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as ul

    args = launch_command_parser().parse_args([*json.loads(words), script])
    args, _defaults, mp_from_config = _validate_launch_command(args)
    # the launcher checks that the rendezvous port is free on this host (is_port_in_use): placement,
    # not the script's behaviour, and a socket the sandbox refuses
    ul.is_port_in_use = lambda port=None: False
    if args.use_deepspeed:
        fields = list(_defaults.deepspeed_config.keys()) if _defaults else []   # as launch_command does
        args.deepspeed_fields_from_accelerate_config = ",".join(fields + (["mixed_precision"] if mp_from_config else []))
        _cmd, env = ul.prepare_deepspeed_cmd_env(args)
    else:
        env = ul.prepare_multi_gpu_env(args)
    set_ = {k: str(v) for k, v in env.items() if k.startswith(_PREFIXES) and os.environ.get(k) != str(v)}
    os.environ.update(set_)
    return set_
