"""Read a training command line: what to run, and on how many GPUs. Pure, no torch.

Forms understood (each optionally behind ``srun [srun options]``):
    python [-u] train.py ARGS          python -m pkg.train ARGS
    torchrun [--nproc_per_node N | --nproc-per-node N] [--nnodes M] [...] train.py ARGS
        (N or M given as a job's variable, ``$SLURM_NNODES``, ``${SLURM_GPUS_ON_NODE}``, or as
        torchrun's ``gpu``/``auto``, or M as an elastic range ``1:4``: decided by the job's GPUs)
    python -m torch.distributed.run / torch.distributed.launch  (same options as torchrun)
    accelerate launch [--num_processes N] [--mixed_precision X] [...] train.py ARGS
    fabric run [--devices N] [--num-nodes M] [--strategy S] [--precision P] [...] train.py ARGS
        (Lightning Fabric's launcher, also ``lightning run model``: torchrun underneath, and the
        options handed to the script's Fabric() as LT_* variables, lightning/fabric/cli.py)
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass

from ..errors import WorkloadError

_SRUN_FLAGS_WITH_VALUE = {
    "-n", "--ntasks", "-N", "--nodes", "-c", "--cpus-per-task", "-G", "--gpus", "--gres", "-p", "--partition",
    "-t", "--time", "--mem", "-J", "--job-name", "-o", "--output", "-e", "--error", "--ntasks-per-node",
    "--gpus-per-task", "--gpus-per-node", "--cpu-bind", "--mpi", "--export", "-w", "--nodelist", "-A", "--account",
}
_TORCHRUN_FLAGS_WITH_VALUE = {
    "--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank", "--master_addr",
    "--master-addr", "--master_port", "--master-port", "--rdzv_backend", "--rdzv-backend", "--rdzv_endpoint",
    "--rdzv-endpoint", "--rdzv_id", "--rdzv-id", "--rdzv_conf", "--rdzv-conf", "--max_restarts",
    "--max-restarts", "--monitor_interval", "--monitor-interval", "--start_method", "--start-method",
    "--role", "--log_dir", "--log-dir", "-r", "--redirects", "-t", "--tee", "--local_addr", "--local-addr",
    "--logs_specs", "--logs-specs",
}
_ACCELERATE_FLAGS_WITH_VALUE = {
    "--num_processes", "--num-processes", "--num_machines", "--num-machines", "--mixed_precision",
    "--mixed-precision", "--config_file", "--config-file", "--gpu_ids", "--gpu-ids", "--main_process_port",
    "--main-process-port", "--machine_rank", "--machine-rank", "--main_process_ip", "--main-process-ip",
    "--dynamo_backend", "--dynamo-backend",
}
_FABRIC_FLAGS_WITH_VALUE = {
    "--accelerator", "--strategy", "--devices", "--num-nodes", "--num_nodes", "--node-rank", "--node_rank",
    "--main-address", "--main_address", "--main-port", "--main_port", "--precision",
}
# DeepSpeed's launcher (deepspeed/launcher/runner.py parse_args): the options that take a value
_DEEPSPEED_FLAGS_WITH_VALUE = {
    "-H", "--hostfile", "-i", "--include", "-e", "--exclude", "--num_nodes", "--min_elastic_nodes",
    "--max_elastic_nodes", "--num_gpus", "--num_accelerators", "--master_port", "--master_addr", "--node_rank",
    "--launcher", "--launcher_args", "--ssh_port", "--bind_core_list", "--venv_script", "--comment", "--account",
    "--autotuning", "--enable_each_rank_log",
}
# Python console scripts a job script runs to set itself up, not to train: a job script's training
# command is its first Python file or module run, else its first other console script (find_train_command)
_SETUP_TOOLS = {"pip", "pip3", "uv", "conda", "mamba", "micromamba", "huggingface-cli", "hf", "wandb", "gdown",
                "jupyter", "tensorboard", "nvitop", "gpustat", "accelerate", "deepspeed", "vest", "vsbatch"}
# launchers that start --nproc_per_node processes on each node through torch.distributed.run
TORCHRUN_LIKE = ("torchrun", "fabric", "deepspeed")
_PYTHON_FLAGS = {"-u", "-B", "-O", "-OO", "-s", "-E", "-I", "-b", "-bb", "-q", "-v"}
# the interpreter flags that change what the script does, as the variables that say the same to the
# child's Python (-O: asserts removed, as a job's `python -O train.py` runs them)
_PYTHON_FLAG_ENV = {"-O": ("PYTHONOPTIMIZE", "1"), "-OO": ("PYTHONOPTIMIZE", "2"), "-s": ("PYTHONNOUSERSITE", "1")}


@dataclass(frozen=True)
class TrainCommand:
    """What to run: a script path or a module, its argv, and the GPUs of the launch."""

    script: str | None         # path of the .py file, or None for a module
    module: str | None         # for python -m
    args: tuple[str, ...]
    nproc: int = 1             # processes (GPUs) per node the launcher starts (-1: as the job's GPUs decide)
    launcher: str = "python"   # python, torchrun, accelerate, fabric
    env: tuple[tuple[str, str], ...] = ()    # VAR=value prefixes of the command
    mixed_precision: str | None = None       # accelerate's --mixed_precision
    launcher_args: tuple[str, ...] = ()      # accelerate launch's own option words (accelerate_env.py)
    config_file: str | None = None           # accelerate's --config_file, as written
    program: str = ""          # the command's first word (python, a venv's python, torchrun, ./train.py): whose torch runs
    srun: tuple[tuple[str, str], ...] | None = None   # srun's options where srun starts the command, else None
    unresolved: tuple[str, ...] = ()   # job-script lines that set up an environment vest cannot follow (module load)
    nnodes: int = 1            # torchrun's --nnodes (-1: as the job's nodes decide)
    chdir: str | None = None   # where the job script's `cd` lines took it before the command (absolute, or
                               # relative to the job's working directory); None: that directory

    def workdir(self, base: str | None) -> str:
        """The directory the command runs in, for a job whose working directory is ``base``."""
        base = base or os.getcwd()
        return os.path.normpath(os.path.join(base, self.chdir)) if self.chdir else base

    @property
    def world(self) -> int:
        """The processes (ranks) the launch starts in all, where its command line says (torchrun's
        --nproc_per_node x --nnodes, accelerate's --num_processes), else -1: the job's GPUs decide."""
        return self.nproc * self.nnodes if self.nproc > 0 and self.nnodes > 0 else -1

    @property
    def path(self) -> str | None:
        """The PATH the command runs with: its own or its job script's (``env``), else this process's."""
        return dict(self.env).get("PATH", os.environ.get("PATH"))

    @property
    def display(self) -> str:
        target = self.script if self.script else f"-m {self.module}"
        return f"{self.launcher} {target} {' '.join(shlex.quote(a) for a in self.args)}".strip()


def _is_python(word: str) -> bool:
    return bool(re.fullmatch(r"(.*/)?python(\d(\.\d+)?)?", word))


def console_script(name: str, path: str | None) -> tuple[str, str] | None:
    """(the file, its Python) of a Python package's console script (pip's wrapper of an entry point:
    ``yolo``, ``litgpt``, ``llamafactory-cli``, ``axolotl``), a file whose first line runs Python
    (``#!/venv/bin/python``, ``#!/usr/bin/env python3``, or pip's ``#!/bin/sh`` with an ``exec`` of
    the Python on its second line, for long paths), found as the shell would: a path as given, else
    on PATH (a shell shim there, as pyenv's, is passed over), then beside this Python. None where
    there is none."""
    import sysconfig

    if "/" in name:
        candidates = [name]
    else:
        dirs = [d for d in (path or "").split(os.pathsep) if d] + [sysconfig.get_path("scripts")]
        candidates = [os.path.join(d, name) for d in dirs]
    for c in candidates:
        try:
            with open(c, "rb") as f:
                head = f.read(512).decode("utf-8", "replace").splitlines()
        except OSError:
            continue
        if not head or not head[0].startswith("#!"):
            continue
        words = head[0][2:].split()
        prog = words[-1] if words and os.path.basename(words[0]) == "env" else (words[0] if words else "")
        if not _is_python(os.path.basename(prog)) and len(head) > 1 and head[1].startswith("'''exec' "):
            prog = head[1].split()[1].strip('"')
        if _is_python(os.path.basename(prog)):
            return c, prog
    return None


def _skip_options(words: list[str], i: int, takes_value) -> tuple[int, dict]:
    """The launcher's options from words[i] on, up to its script (or past a `--`): the index there
    and the options seen. ``takes_value(option, next_word)`` says whether the next word is the
    option's value."""
    seen: dict[str, str] = {}
    while i < len(words) and words[i].startswith("-") and words[i] != "--":
        w = words[i]
        nxt = words[i + 1] if i + 1 < len(words) else None
        if "=" in w:
            k, v = w.split("=", 1)
            seen[k] = v
            i += 1
        elif takes_value(w, nxt):
            seen[w] = nxt or ""
            i += 2
        else:
            seen[w] = ""
            i += 1
    if i < len(words) and words[i] == "--":
        i += 1
    return i, seen


def _named(options: set[str]):
    """The options that take a value are exactly these (srun's, torchrun's)."""
    return lambda w, nxt: w in options and nxt is not None


def _accelerate_takes_value(w: str, nxt: str | None) -> bool:
    """accelerate launch's options: it has dozens that take a value (--fsdp_sharding_strategy X,
    --zero_stage 2, --deepspeed_config_file ds.json, ...) besides switches (--use_fsdp): a word after
    an option is its value unless it is an option itself or the script (a .py path)."""
    return w in _ACCELERATE_FLAGS_WITH_VALUE or (nxt is not None and not nxt.startswith("-")
                                                 and not nxt.endswith(".py") and w not in ("-m", "--module"))


def _int(value: str, what: str) -> int:
    if value in ("gpu", "auto") or "$" in value:
        return -1   # "one per GPU", or the job's variable ($SLURM_GPUS_ON_NODE): decided by the job's GPUs
    try:
        return int(value)
    except ValueError:
        raise WorkloadError(f"{what} {value!r} is not a number", f"give {what} a whole number") from None


def _fabric(seen: dict) -> tuple[int, list]:
    """``fabric run``'s processes per node (its _torchrun_launch: 1 for strategy dp, else the
    devices: a count, a list of indices, "auto" one, -1 every GPU: as the job's decide) and the variables
    it hands the script's Fabric() (_set_env_variables)."""
    devices = seen.get("--devices", "1").strip()
    strategy = seen.get("--strategy")
    if strategy == "dp":
        nproc = 1
    elif devices == "auto":
        nproc = 1   # (_get_num_processes: "auto" is one CUDA device)
    elif devices == "-1" or "$" in devices:
        nproc = -1
    elif "," in devices or devices.startswith("["):
        nproc = len([d for d in devices.strip("[]").split(",") if d.strip()])
    else:
        nproc = _int(devices, "--devices")
    env = [("LT_CLI_USED", "1")]
    for opt, var in (("--accelerator", "LT_ACCELERATOR"), ("--strategy", "LT_STRATEGY")):
        if seen.get(opt):
            env.append((var, seen[opt]))
    env += [("LT_DEVICES", devices), ("LT_NUM_NODES", seen.get("--num-nodes", seen.get("--num_nodes", "1")))]
    if seen.get("--precision"):
        env.append(("LT_PRECISION", seen["--precision"]))
    return nproc, env


def _nodes(value: str) -> int:
    """torchrun's --nnodes: a number, ``MIN:MAX`` (elastic: one number where MIN equals MAX, else
    the job's nodes decide), or a variable of the job (``$SLURM_NNODES``: -1, the job decides)."""
    lo, _, hi = value.partition(":")
    if hi and lo.strip() != hi.strip():
        return -1
    return _int(lo.strip(), "--nnodes")


def parse_train_command(command: str | list[str]) -> TrainCommand:
    """Parse one command line (a string as in a job script, or an argv list)."""
    if isinstance(command, str):
        try:
            words = shlex.split(command, comments=True)
        except ValueError as e:
            raise WorkloadError(f"cannot split the command {command!r}: {e}", "check its quotes") from None
    else:
        words = list(command)
    env = []
    i = 0
    while i < len(words) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[i]):
        k, v = words[i].split("=", 1)
        env.append((k, v))
        i += 1
    if i < len(words) and words[i] in ("exec", "time", "env"):
        i += 1
    srun = None
    if i < len(words) and os.path.basename(words[i]) == "srun":
        i, seen = _skip_options(words, i + 1, _named(_SRUN_FLAGS_WITH_VALUE))
        srun = tuple(seen.items())
    if i >= len(words):
        raise WorkloadError(f"no training command in {command!r}", "give e.g. `python train.py ...`")
    head = words[i]
    base = os.path.basename(head)
    launcher, nproc, nnodes, mixed = "python", 1, 1, None
    launcher_args, config_file, rank_args = (), None, ()
    if base == "torchrun" or (_is_python(base) and words[i + 1:i + 3] in (["-m", "torch.distributed.run"], ["-m", "torch.distributed.launch"])):
        start = i + 1 if base == "torchrun" else i + 3
        legacy = words[i + 1:i + 3] == ["-m", "torch.distributed.launch"]
        i, seen = _skip_options(words, start, _named(_TORCHRUN_FLAGS_WITH_VALUE))
        nproc = _int(seen.get("--nproc_per_node", seen.get("--nproc-per-node", "1")), "--nproc_per_node")
        nnodes = _nodes(seen.get("--nnodes", "1"))
        launcher = "torchrun"
        if legacy and not {"--use-env", "--use_env"} & set(seen):
            # the legacy launcher passes the local rank as an argument (torch/distributed/launch.py)
            rank_args = ("--local-rank=0",)
        if ("-m" in seen or "--module" in seen) and i < len(words):   # torchrun -m: the target is a module
            return TrainCommand(None, words[i], rank_args + tuple(words[i + 1:]), nproc, launcher, tuple(env),
                                program=head, srun=srun, nnodes=nnodes)
        if "--no_python" in seen or "--no-python" in seen:
            raise WorkloadError("torchrun --no-python runs a program that is not Python", "estimate the Python training script directly")
    elif base == "accelerate" and i + 1 < len(words) and words[i + 1] == "launch":
        first = i + 2
        i, seen = _skip_options(words, first, _accelerate_takes_value)
        nproc = _int(seen.get("--num_processes", seen.get("--num-processes", "1")), "--num_processes")
        mixed = seen.get("--mixed_precision", seen.get("--mixed-precision"))
        launcher = "accelerate"
        launcher_args = tuple(w for w in words[first:i] if w != "--")
        config_file = seen.get("--config_file", seen.get("--config-file"))
    elif base == "deepspeed":
        # DeepSpeed's launcher: torch.distributed's variables per rank, as torchrun gives them, and
        # the legacy --local_rank=N before the script's own arguments (launcher/launch.py), unless
        # --no_local_rank. Its defaults: every GPU of the node (--num_gpus -1), the hostfile's nodes.
        i, seen = _skip_options(words, i + 1, _named(_DEEPSPEED_FLAGS_WITH_VALUE))
        launcher = "deepspeed"
        nproc = _int(seen.get("--num_gpus", seen.get("--num_accelerators", "gpu")), "--num_gpus")
        nnodes = _int(seen.get("--num_nodes", "-1" if "--hostfile" in seen or "-H" in seen else "1"), "--num_nodes")
        if "--no_python" in seen:
            raise WorkloadError("deepspeed --no_python runs a program that is not Python", "estimate the Python training script directly")
        rank_args = () if "--no_local_rank" in seen else ("--local_rank=0",)
        if "--module" in seen and i < len(words):
            return TrainCommand(None, words[i], rank_args + tuple(words[i + 1:]), nproc, launcher, tuple(env),
                                program=head, srun=srun, nnodes=nnodes)
    elif (base == "fabric" and words[i + 1:i + 2] == ["run"]) or (base == "lightning" and words[i + 1:i + 3] == ["run", "model"]):
        i, seen = _skip_options(words, i + (2 if base == "fabric" else 3), _named(_FABRIC_FLAGS_WITH_VALUE))
        launcher = "fabric"
        nproc, fabric_env = _fabric(seen)
        nnodes = _int(seen.get("--num-nodes", seen.get("--num_nodes", "1")), "--num-nodes")
        env = [e for e in env if e[0] not in dict(fabric_env)] + fabric_env
    elif _is_python(base):
        i += 1
        while i < len(words) and words[i] in _PYTHON_FLAGS:
            if words[i] in _PYTHON_FLAG_ENV:
                env.append(_PYTHON_FLAG_ENV[words[i]])
            i += 1
        if i < len(words) and words[i] == "-m":
            if i + 1 >= len(words):
                raise WorkloadError(f"`{command}`: -m without a module", "give the module, e.g. python -m pkg.train")
            return TrainCommand(None, words[i + 1], tuple(words[i + 2:]), 1, "python", tuple(env), program=head,
                                srun=srun)
        if i < len(words) and words[i] == "-c":
            raise WorkloadError("`python -c` code cannot be estimated", "put the training code in a file and run that")
    elif head.endswith(".py"):
        pass
    else:
        found = console_script(head, dict(env).get("PATH", os.environ.get("PATH")))
        if found is None:
            raise WorkloadError(f"`{' '.join(words)}` is not a Python training command",
                                "use python train.py, python -m pkg.train, torchrun ... train.py, srun python ..., "
                                "accelerate launch ..., fabric run ..., deepspeed ..., or a Python package's console script")
        script, interpreter = found
        return TrainCommand(script, None, tuple(words[i + 1:]), 1, "python", tuple(env), program=interpreter, srun=srun)
    if i >= len(words):
        raise WorkloadError(f"`{' '.join(words)}` names no script", "give the training script, e.g. python train.py")
    return TrainCommand(words[i], None, rank_args + tuple(words[i + 1:]), nproc, launcher, tuple(env), mixed,
                        launcher_args, config_file, program=head, srun=srun, nnodes=nnodes)


def find_train_command(command_lines: list[str], env: dict | None = None) -> TrainCommand | None:
    """The first command line of a job script that runs Python training (None if there is none),
    with the environment the lines before it set up, as in the job: ``export NAME=VALUE`` (``$NAME``
    expanded; what only the running job knows stays for it: _expand), ``unset NAME``, variables set
    without export (they expand in the command line: ``srun $CMD``),
    and an environment activated (``source VENV/bin/activate``, ``conda activate NAME``;
    activation) first on PATH, so that its Python is the job's. The command's own ``NAME=VALUE``
    prefixes win. ``env``: the variables to expand and find conda by (default this process's)."""
    env = os.environ if env is None else env
    exported: dict[str, str | None] = {}   # None: unset
    shell: dict[str, str] = {}   # NAME=VALUE lines, not exported: they expand, the job's processes do not see them
    before_activation: list[str | None] = []
    unresolved: list[str] = []

    def lookup(name: str) -> str:
        v = exported[name] if name in exported else shell[name] if name in shell else env.get(name)
        return v or ""

    chdir: str | None = None
    console: TrainCommand | None = None
    for text in (seg for line in command_lines for seg in _segments(line.strip())):
        if not text or text.startswith("#"):
            continue
        words = _shell_words(text, lookup) if text.split()[0] in ("cd", "pushd") else []
        if words and words[0] in ("cd", "pushd"):   # where the job goes before its command
            target = words[1] if len(words) > 1 else (lookup("HOME") or "~")
            if target in ("$SLURM_SUBMIT_DIR", "${SLURM_SUBMIT_DIR}"):
                chdir = None   # the job's working directory, where vsbatch and vest check run it
            elif "$" in target or target == "-":
                pass   # a directory only the running job knows ($SLURM_TMPDIR): the script is looked for here
            else:
                if target == "~" or target.startswith("~/"):
                    target = (lookup("HOME") or os.path.expanduser("~")) + target[1:]
                chdir = os.path.join(chdir, target) if chdir else target
            continue
        if _unresolvable_setup(text):
            unresolved.append(text)
            continue
        seen = {**env, **{k: v for k, v in exported.items() if v is not None}}   # what the line's $NAMEs expand to
        activates, found = activation(text, seen)
        if activates and found is None:   # an environment activated that is not found here
            unresolved.append(text)
            continue
        if activates:
            if found:
                before_activation.append(lookup("PATH"))
                exported["PATH"] = found + (os.pathsep + before_activation[-1] if before_activation[-1] else "")
            elif before_activation:   # deactivate: PATH as it was
                prev = before_activation.pop()
                if prev == (env.get("PATH") or ""):
                    exported.pop("PATH", None)
                else:
                    exported["PATH"] = prev or None
            continue
        if _exports(text, exported, lookup) or _assigns(text, shell, lookup):
            continue
        try:   # the command as the shell runs it: `srun $CMD`, `torchrun ... $SCRIPT $ARGS`
            cmd = parse_train_command(_shell_words(text, lookup))
        except WorkloadError:
            continue
        python_file = cmd.module or (cmd.script and cmd.script.endswith(".py"))
        if not python_file and (console is not None or os.path.basename(cmd.script or "") in _SETUP_TOOLS):
            continue
        own = dict(cmd.env)
        # (a value only the running job computes is not the child's: it expanded where used)
        setup = tuple((k, v) for k, v in exported.items() if v is not None and k not in own and JOB_DECIDES not in v)
        if setup or unresolved or chdir:
            cmd = TrainCommand(**{**cmd.__dict__, "env": setup + cmd.env, "unresolved": tuple(unresolved),
                                  "chdir": chdir})
        if python_file:
            return cmd
        console = cmd   # a package's console script (yolo, litgpt, ...): where the script runs no .py itself
    return console


def _segments(line: str) -> list[str]:
    """A command line's commands, split at unquoted ``&&``, ``||`` and ``;`` (``cd run && python
    train.py``); [line] where a quote is not closed."""
    out, cur, quote, i = [], "", None, 0
    while i < len(line):
        c = line[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "\\":
            cur, i = cur + line[i:i + 2], i + 2
            continue
        elif line.startswith(("&&", "||"), i) or c == ";":
            out.append(cur.strip())
            cur, i = "", i + (1 if c == ";" else 2)
            continue
        cur += c
        i += 1
    return [line] if quote else out + [cur.strip()]


def _unresolvable_setup(text: str) -> bool:
    """A line that loads software into the job's environment by means vest does not run: Lmod and
    Environment Modules (``module load``, ``ml``), Spack (``spack load``). (A conda environment
    activated by a name not found here is recorded beside them, find_train_command.)"""
    words = text.split()
    if not words:
        return False
    if words[0] == "module" and len(words) >= 3 and words[1] in ("load", "add", "swap", "switch", "restore"):
        return True
    if words[0] == "ml" and len(words) >= 2 and words[1] not in ("list", "avail", "spider", "-t"):
        return True
    if words[0] == "spack" and len(words) >= 3 and words[1] in ("load", "env"):
        return True
    return False


def _exports(text: str, exported: dict, lookup) -> bool:
    """Apply a job script's ``export NAME=VALUE ...`` or ``unset NAME ...`` line to ``exported``;
    False for any other line."""
    words = _raw_words(text)
    if not words or words[0] not in ("export", "unset"):
        return False
    for w in words[1:]:
        if w.startswith("-"):
            continue
        if words[0] == "unset":
            exported[w] = None
            continue
        name, eq, raw = w.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            continue
        exported[name] = _value(raw, lookup)
    return True


def _raw_words(text: str) -> list[str]:
    """A shell line's words as written (quotes kept: each part is expanded as its quoting says),
    split at unquoted blanks, up to an unquoted ``#``; [] for an unclosed quote."""
    words, cur, quote, i = [], "", None, 0
    while i < len(text):
        c = text[i]
        if quote:
            cur += c
            if c == quote:
                quote = None
            elif c == "\\" and quote == '"' and i + 1 < len(text):
                cur += text[i + 1]
                i += 1
        elif c in "'\"":
            quote, cur = c, cur + c
        elif c == "$" and text[i + 1:i + 2] == "(":   # $(...) and $((...)): one word, blanks and all
            depth, j = 0, i + 1
            while j < len(text):
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                if depth == 0:
                    break
                j += 1
            cur += text[i:j + 1]
            i = j
        elif c == "\\" and i + 1 < len(text):
            cur += c + text[i + 1]
            i += 1
        elif c.isspace():
            if cur:
                words.append(cur)
            cur = ""
        elif c == "#" and not cur:
            break
        else:
            cur += c
        i += 1
    if quote:
        return []
    return words + ([cur] if cur else [])


def _value(raw: str, lookup) -> str:
    """The value of a shell assignment's right-hand side as the job would see it: single-quoted
    parts as written, the rest expanded (_expand), quotes and escapes removed; a leading ``~`` is HOME."""
    value = "".join(_quoted(part, lookup) if part[0] in "'\"" else re.sub(r"\\(.)", r"\1", _expand(part, lookup))
                    for part in _PARTS.findall(raw))
    if not raw.startswith(("'", '"')) and (value == "~" or value.startswith("~/")):
        value = (lookup("HOME") or os.path.expanduser("~")) + value[1:]
    return value


# a shell word's parts: single-quoted, double-quoted (escapes kept), unquoted
_PARTS = re.compile(r"'[^']*'|\"(?:[^\"\\]|\\.)*\"|(?:[^'\"\\]|\\.)+")


def _quoted(part: str, lookup) -> str:
    """A quoted part of a shell word as the shell reads it: single-quoted as written, double-quoted
    expanded (_expand) with its escapes removed."""
    if part[0] == "'":
        return part[1:-1]
    return re.sub(r"\\(.)", r"\1", _expand(part[1:-1], lookup, in_double_quotes=True))


# What only the running job knows: the variables Slurm sets when it starts it ($SLURM_NNODES,
# $SLURM_GPUS_ON_NODE, ...) and bash's $RANDOM stay $-words, as does what a command or arithmetic
# on them computes ($(...), `...`, $((...))): JOB_DECIDES. A size given so is the job's (_int: as
# its GPUs decide); any other unset variable is empty, as in bash.
_JOB_TIME = re.compile(r"(SLURM|SLURMD|SBATCH)_[A-Za-z0-9_]+|RANDOM")
JOB_DECIDES = "$VEST_JOB_DECIDES"
_EXPANSION = re.compile(
    r"\$\(\((?P<arith>[^()]*(?:\([^()]*\)[^()]*)*)\)\)"           # $((arithmetic))
    r"|(?P<subst>\$\([^()]*(?:\([^()]*\)[^()]*)*\)|`[^`]*`)"     # $(command), `command`
    r"|\$\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?::?-(?P<default>[^}]*))?\}|\$(?P<name>[A-Za-z_][A-Za-z0-9_]*)")


def _expand(text: str, lookup, in_double_quotes: bool = False) -> str:
    """``text`` with the variables set before it expanded as the shell would (``$NAME``, ``${NAME}``,
    ``${NAME:-default}``, ``$((arithmetic))`` of known numbers), single-quoted text as written (but
    inside double quotes, where a single quote is a character), and what only the running job
    knows left for it (_JOB_TIME, JOB_DECIDES)."""
    def one(m):
        if m.group("subst") is not None:
            return JOB_DECIDES
        if m.group("arith") is not None:
            expr = re.sub(r"\$?\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda v: lookup(v.group(1)) or "?", m.group("arith"))
            if re.fullmatch(r"[\d\s+\-*/%()]+", expr):
                try:
                    return str(int(eval(expr.replace("/", "//"), {"__builtins__": {}})))   # noqa: S307 - digits and operators only
                except (SyntaxError, ZeroDivisionError, ValueError):
                    pass
            return JOB_DECIDES
        name = m.group("braced") or m.group("name")
        value = lookup(name)
        if value:
            return value
        if m.group("default") is not None:   # ${NAME:-default}
            return _expand(m.group("default"), lookup)
        return m.group(0) if _JOB_TIME.fullmatch(name) else ""

    parts = [text] if in_double_quotes else re.split(r"('[^']*')", text)
    for i in range(0, len(parts), 2):   # outside single quotes
        parts[i] = _EXPANSION.sub(one, parts[i])
    return "".join(parts)


def _shell_words(text: str, lookup) -> list[str]:
    """A command line's words as the shell passes them: each word's quoted parts expanded as their
    quotes say (_expand), an unquoted expansion split at blanks into more words, quotes removed
    (not those inside an expansion's value: ``srun $CMD``)."""
    out: list[str] = []
    for raw in _raw_words(text):
        cur, started = "", False
        for part in _PARTS.findall(raw):
            if part[0] in "'\"":
                cur, started = cur + _quoted(part, lookup), True
            else:   # literal text as it is (escapes removed); each expansion's value split at blanks
                at = 0
                for m in [*_EXPANSION.finditer(part), None]:
                    literal = part[at:m.start() if m else len(part)]
                    if literal:
                        cur, started = cur + re.sub(r"\\(.)", r"\1", literal), True
                    if m is None:
                        break
                    at = m.end()
                    value = _expand(m.group(0), lookup, True)
                    fields = value.split()
                    if value[:1].isspace() and started:
                        out.append(cur)
                        cur, started = "", False
                    for k, f in enumerate(fields):
                        if k:
                            out.append(cur)
                            cur = ""
                        cur, started = cur + f, True
                    if fields and value[-1:].isspace():
                        out.append(cur)
                        cur, started = "", False
        if started:
            out.append(cur)
    return out


def _assigns(text: str, shell: dict, lookup) -> bool:
    """Apply a line of shell assignments alone (``NAME=VALUE [NAME=VALUE ...]``, no command after
    them) to ``shell``, the job script's variables not exported: they expand in later lines."""
    words = _raw_words(text)
    if not words or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w) for w in words):
        return False
    for w in words:
        name, _, raw = w.partition("=")
        shell[name] = _value(raw, lookup)
    return True


def activation(line: str, env) -> tuple[bool, str | None]:
    """(whether a job script's line activates or deactivates an environment, the bin folder it puts
    first on PATH). The forms: a venv's (``source VENV/bin/activate``, ``. VENV/bin/activate``), a
    conda env's (``conda activate [NAME|PATH]``, also mamba/micromamba, and the old ``source
    activate [NAME]``), found where conda keeps environments ($CONDA_EXE's install, ~/.conda, the
    usual installers' folders); the folder is "" for ``deactivate``, None for an environment not
    found here (the command then runs what PATH has: find_train_command names the line).
    (False, None) for any other line."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return False, None
    if not words:
        return False, None
    home = env.get("HOME") or os.path.expanduser("~")

    def expand(w: str) -> str:
        w = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), w)
        return home + w[1:] if w == "~" or w.startswith("~/") else w

    if words[0] in ("deactivate", "conda", "mamba", "micromamba") and words[-1] == "deactivate":
        return True, ""
    if words[0] in (".", "source") and len(words) >= 2:
        target = expand(words[1])
        if os.path.basename(target) != "activate":
            return False, None
        if os.path.basename(os.path.dirname(target)) == "bin" \
                and os.path.isfile(os.path.join(os.path.dirname(target), "python")):
            return True, os.path.dirname(target)   # a venv's bin/activate
        # conda's old `source activate NAME`
        return True, (_conda_bin(expand(words[2]), env, home) if len(words) >= 3 else None)
    if words[0] in ("conda", "mamba", "micromamba") and len(words) >= 2 and words[1] == "activate":
        names = [w for w in words[2:] if not w.startswith("-")]
        return True, (_conda_bin(expand(names[0]), env, home) if names else None)
    return False, None


def _conda_bin(name: str, env, home: str) -> str | None:
    if "/" in name:
        places = [name]
    else:
        roots = [os.path.dirname(os.path.dirname(env["CONDA_EXE"]))] if env.get("CONDA_EXE") else []
        roots += [os.path.join(home, d) for d in ("miniconda3", "anaconda3", "miniforge3", "mambaforge")]
        places = [os.path.join(home, ".conda", "envs", name)] + [os.path.join(r, "envs", name) for r in roots]
    for p in places:
        if os.path.isfile(os.path.join(p, "bin", "python")):
            return os.path.join(p, "bin")
    return None
