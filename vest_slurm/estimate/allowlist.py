"""Which ``#VEST`` directives a process that is not the job's user may trace: an allow-list.

The bridge (the decision server, the per-call program, ``vest bridge test``) runs as the
controller's user, and ``vest check`` or ``vsbatch`` may be run by root or an exempt admin on
another user's script. None of them may run code a job names. So on those paths a ``#VEST`` line is
read by this parser instead of argparse: every option is matched by its exact name (no
abbreviations, no unknown options), and every value by its shape, before anything else sees it.

Allowed, and nothing else:
- models built by name from installed libraries: ``torchvision:NAME``, ``timm:NAME``,
  ``hf:CLASS`` or ``hf:PRESET`` (a hub name ``org/name`` only where it stands for a built-in
  preset), ``mlp:[layers]`` with the layer names of ``presets.MLP_LAYERS``;
- optimizers of the built-in table (``workload.OPTIMIZER_TABLE``), by their names;
- model arguments as JSON scalars and short lists: keys are ASCII identifiers, strings are short
  ASCII words without a path separator, numbers are bounded, nesting is at most two levels; keys
  that name files, directories, URLs, checkpoints, hubs or code (``checkpoint_path``,
  ``pretrained_cfg_overlay``, ``trust_remote_code``, ``cache_dir``) are refused as well;
- ``--num-gpus auto``: the job's own Slurm GPU count (the caller's), which vsbatch chose and wrote;
- every other option with the values ``vest estimate`` accepts, bounded (batch, steps, GPUs, shapes)
  so that a directive cannot ask for unbounded work; ``--alloc-conf`` only in the grammar of
  ``PYTORCH_CUDA_ALLOC_CONF``.

A refused line raises ``DirectiveRefused`` with a short ``reason`` (for the admin's log) and the
offending token; the caller applies the site's policy for jobs without a usable estimate.
Nothing here imports torch or a model library.
"""

from __future__ import annotations

import json
import math
import re
from argparse import Namespace
from typing import Sequence

from ..errors import WorkloadError
from .workload import (CUDNN_BENCHMARK, CUDNN_TF32, GRADIENT_CHECKPOINTING, LOSSES, OPTIMIZER_IMPLS,
                       OPTIMIZERS, PARALLELISMS, PRE_FORWARDS, PRECISIONS, ZERO_GRADS, WorkloadSpec,
                       SHARDINGS, SHARD_DTYPES, OFFLOADS, ON_OFF,
                       spec_from_namespace, NUM_GPUS_AUTO)

# Bounds on what a directive may ask for. They keep a hostile line from asking the worker for
# unbounded work; a real job beyond them is estimated by vsbatch, as its own user.
MAX_ARGV_WORDS = 64
MAX_WORD_CHARS = 4096
MAX_BATCH = 1 << 16
MAX_STEPS = 8                  # the trace needs 2; the steady-state replay repeats the last step itself
MAX_GRAD_ACCUM = 1024
MAX_NUM_GPUS = 1 << 14
MAX_INPUT_DIMS = 6
MAX_INPUT_DIM = 1 << 20
MAX_INPUT_ELEMENTS = 1 << 28   # per sample
MAX_JSON_CHARS = 4096
MAX_JSON_DEPTH = 2             # {"k": [1, 2]} is depth 2
MAX_LIST_ITEMS = 64
MAX_MLP_LAYERS = 256
MAX_INT = 1 << 31
MAX_STRING_CHARS = 64
MAX_ALLOC_CONF_CHARS = 256

_ASCII_INT = re.compile(r"[0-9]{1,10}")
_ASCII_FLOAT = re.compile(r"[0-9]{1,10}(\.[0-9]{1,10})?([eE]-?[0-9]{1,3})?")
_CHOICE = re.compile(r"[a-z0-9_-]{1,32}", re.ASCII)
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}", re.ASCII)
_STRING = re.compile(r"[A-Za-z0-9_.+-]{0,%d}" % MAX_STRING_CHARS, re.ASCII)
_TORCHVISION = re.compile(r"[a-z][a-z0-9_]{0,63}", re.ASCII)
_TIMM = re.compile(r"[a-z][a-z0-9_.]{0,95}", re.ASCII)
_HF_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,95}", re.ASCII)
_HF_HUB = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}", re.ASCII)
_INPUT = re.compile(r"default|timm_default|seq[0-9]{1,7}|(tensor:)?[0-9]{1,7}(x[0-9]{1,7}){0,%d}" % (MAX_INPUT_DIMS - 1),
                    re.ASCII)
_ALLOC_CONF = re.compile(r"[A-Za-z0-9_:,.\[\]]{0,%d}" % MAX_ALLOC_CONF_CHARS, re.ASCII)
# Words of an argument name that load something (a file, a directory, a URL, a hub entry, code):
# anywhere in the name, or as its last word ("checkpoint_path", but not timm's "drop_path_rate").
_LOADING_WORDS = frozenset({"file", "dir", "url", "uri", "checkpoint", "ckpt", "pretrained", "remote", "hub",
                            "repo", "plugin", "overlay", "download", "auth", "trust"})
_LOADING_LAST_WORDS = frozenset({"path", "module", "code", "load", "fn"})


class DirectiveRefused(WorkloadError):
    """A ``#VEST`` line outside the allow-list. ``reason`` is a short tag for the log."""

    def __init__(self, reason: str, what: str):
        super().__init__(f"#VEST directive refused ({reason}): {what}",
                         "the cluster's controller never runs code a job names: it builds only models named "
                         "from installed libraries (torchvision:, timm:, hf:, mlp:) with the built-in "
                         "optimizers; submit with vsbatch, which estimates anything else as your own user")
        self.reason = reason


def _word(text: str, what: str) -> str:
    if not isinstance(text, str) or len(text) > MAX_WORD_CHARS:
        raise DirectiveRefused("too-long", f"{what} is longer than {MAX_WORD_CHARS} characters")
    return text


def _int(option: str, text: str, maximum: int, minimum: int = 1) -> str:
    # int() alone accepts other scripts' digits and underscores ("١٢", "1_000"): ASCII digits only
    if not _ASCII_INT.fullmatch(text) or not minimum <= int(text) <= maximum:
        raise DirectiveRefused("bad-value", f"{option} {text[:40]!r} is not a whole number from {minimum} to {maximum}")
    return text


def _float(option: str, text: str) -> str:
    if not _ASCII_FLOAT.fullmatch(text) or not math.isfinite(float(text)):
        raise DirectiveRefused("bad-value", f"{option} {text[:40]!r} is not a plain non-negative number")
    return text


def _choice(option: str, text: str, choices: Sequence[str]) -> str:
    v = text.strip().lower().replace("_", "-")
    if not _CHOICE.fullmatch(v):
        raise DirectiveRefused("bad-value", f"{option} {text[:40]!r} is not one of {', '.join(choices)}")
    return v   # spec_from_namespace checks the choice itself (with its aliases)


def check_model(text: str) -> str:
    """A model named from an installed library, or DirectiveRefused."""
    family, sep, name = text.partition(":")
    if not sep:
        raise DirectiveRefused("model-not-allowed", f"--model {text[:80]!r} names no library (torchvision:, timm:, hf:, mlp:)")
    if family == "torchvision" and _TORCHVISION.fullmatch(name):
        return text
    if family == "timm" and _TIMM.fullmatch(name):
        return text
    if family == "hf":
        if _HF_NAME.fullmatch(name) and ".." not in name:
            return text
        if _HF_HUB.fullmatch(name) and ".." not in name:
            from .presets import hf_preset

            if hf_preset(name) is not None:
                return text
        raise DirectiveRefused("model-path", f"--model {text[:80]!r}: hf: takes a model class or a built-in preset, "
                                             "not a path (nothing is loaded from disk or a hub)")
    if family == "mlp":
        _check_mlp(name)
        return text
    if family in ("torchvision", "timm"):
        raise DirectiveRefused("bad-value", f"--model {text[:80]!r}: {family} model names are lower-case words")
    raise DirectiveRefused("model-code", f"--model {text[:80]!r} names code (a file or a module:function), "
                                         "which is never imported here")


def _check_mlp(text: str) -> None:
    from .presets import MLP_LAYERS

    layers = _json(text, "--model mlp:")
    if isinstance(layers, dict):
        layers = layers.get("sequential")
    if not isinstance(layers, list) or not 0 < len(layers) <= MAX_MLP_LAYERS:
        raise DirectiveRefused("bad-value", f"mlp: takes a list of 1 to {MAX_MLP_LAYERS} layers")
    for layer in layers:
        if not (isinstance(layer, list) and layer and layer[0] in MLP_LAYERS
                and all(_scalar_ok(a) and not isinstance(a, str) for a in layer[1:])):
            raise DirectiveRefused("bad-value", f"mlp layer {str(layer)[:60]!r} is not [\"Name\", numbers...] "
                                                f"with a name of {', '.join(sorted(MLP_LAYERS))}")


def _json(text: str, what: str):
    if len(text) > MAX_JSON_CHARS:
        raise DirectiveRefused("too-long", f"{what} JSON is longer than {MAX_JSON_CHARS} characters")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise DirectiveRefused("bad-value", f"{what} is not valid JSON") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number")   # NaN, Infinity


def _scalar_ok(v) -> bool:
    if v is None or isinstance(v, bool):
        return True
    if isinstance(v, int):
        return -MAX_INT <= v <= MAX_INT
    if isinstance(v, float):
        return math.isfinite(v) and abs(v) <= MAX_INT
    if isinstance(v, str):
        return bool(_STRING.fullmatch(v)) and not v.startswith(".")
    return False


def _value_ok(v, depth: int = 1) -> bool:
    if isinstance(v, list):
        return depth < MAX_JSON_DEPTH and len(v) <= MAX_LIST_ITEMS and all(_value_ok(x, depth + 1) for x in v)
    return _scalar_ok(v)


def check_model_arg(key: str, value) -> None:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise DirectiveRefused("bad-model-arg", f"model argument name {str(key)[:40]!r} is not an ASCII identifier")
    words = key.lower().split("_")
    loads = set(words) & _LOADING_WORDS | {words[-1]} & _LOADING_LAST_WORDS
    if loads:
        raise DirectiveRefused("model-arg-loads", f"model argument {key!r} names something to load "
                                                  f"({', '.join(sorted(loads))})")
    if not _value_ok(value):
        raise DirectiveRefused("bad-model-arg", f"model argument {key}={str(value)[:40]!r}: values are numbers, "
                                                f"true/false/null, short words without a path, or short lists of them")


def _model_args(text: str) -> dict:
    obj = _json(text, "--model-args")
    if not isinstance(obj, dict):
        raise DirectiveRefused("bad-model-arg", "--model-args must be a JSON object")
    if len(obj) > MAX_LIST_ITEMS:
        raise DirectiveRefused("bad-model-arg", f"--model-args has more than {MAX_LIST_ITEMS} entries")
    for k, v in obj.items():
        check_model_arg(k, v)
    return obj


def _model_arg(text: str) -> str:
    key, sep, raw = text.partition("=")
    if not sep:
        raise DirectiveRefused("bad-model-arg", f"--model-arg {text[:40]!r} is not KEY=VALUE")
    try:
        value = json.loads(raw, parse_constant=_no_constant) if len(raw) <= MAX_JSON_CHARS else None
    except ValueError:
        value = raw
    check_model_arg(key.strip(), value)
    return text


def _input(text: str) -> str:
    t = text.strip().lower()
    if not _INPUT.fullmatch(t):
        raise DirectiveRefused("bad-value", f"--input {text[:40]!r} is not CxHxW, seqN, N, tensor:AxB or default")
    dims = [int(d) for d in re.findall(r"[0-9]+", t)]
    if any(d > MAX_INPUT_DIM for d in dims) or math.prod(dims or [1]) > MAX_INPUT_ELEMENTS:
        raise DirectiveRefused("bad-value", f"--input {text[:40]!r} is larger than {MAX_INPUT_ELEMENTS} elements per sample")
    return text


def _alloc_conf(text: str) -> str:
    if not _ALLOC_CONF.fullmatch(text):
        raise DirectiveRefused("bad-value", f"--alloc-conf {text[:60]!r} is not in PYTORCH_CUDA_ALLOC_CONF's grammar")
    from .allocator_config import parse_alloc_conf

    parse_alloc_conf(text)   # its own WorkloadError names the problem
    return text


# option -> (namespace field, value check; None for a flag, "append" lists)
_OPTIONS = {
    "--model": ("model", check_model),
    "--model-args": ("model_args", lambda v: (_model_args(v), v)[1]),
    "--model-arg": ("model_arg", _model_arg),
    "--batch-size": ("batch_size", lambda v: _int("--batch-size", v, MAX_BATCH)),
    "--input": ("input", _input),
    "--loss": ("loss", lambda v: _choice("--loss", v, LOSSES)),
    "--optimizer": ("optimizer", lambda v: _choice("--optimizer", v, OPTIMIZERS)),
    "--optimizer-impl": ("optimizer_impl", lambda v: _choice("--optimizer-impl", v, OPTIMIZER_IMPLS)),
    "--precision": ("precision", lambda v: _choice("--precision", v, PRECISIONS)),
    "--channels-last": ("channels_last", None),
    "--grad-accum": ("grad_accum", lambda v: _int("--grad-accum", v, MAX_GRAD_ACCUM)),
    "--num-gpus": ("num_gpus", lambda v: v if v == NUM_GPUS_AUTO else _int("--num-gpus", v, MAX_NUM_GPUS)),
    "--parallelism": ("parallelism", lambda v: _choice("--parallelism", v, PARALLELISMS)),
    "--alloc-conf": ("alloc_conf", _alloc_conf),
    "--steps": ("steps", lambda v: _int("--steps", v, MAX_STEPS)),
    "--pre-forward": ("pre_forward", lambda v: _choice("--pre-forward", v, PRE_FORWARDS)),
    "--cudnn-tf32": ("cudnn_tf32", lambda v: _choice("--cudnn-tf32", v, CUDNN_TF32)),
    "--cudnn-benchmark": ("cudnn_benchmark", lambda v: _choice("--cudnn-benchmark", v, CUDNN_BENCHMARK)),
    "--zero-grad": ("zero_grad", lambda v: _choice("--zero-grad", v, ZERO_GRADS)),
    "--gradient-checkpointing": ("gradient_checkpointing",
                                 lambda v: _choice("--gradient-checkpointing", v, GRADIENT_CHECKPOINTING)),
    "--weight-decay": ("weight_decay", lambda v: _float("--weight-decay", v)),
    "--sharding": ("sharding", lambda v: _choice("--sharding", v, SHARDINGS)),
    "--shard-group-size": ("shard_group_size", lambda v: _int("--shard-group-size", v, MAX_NUM_GPUS)),
    "--gpus-per-node": ("gpus_per_node", lambda v: _int("--gpus-per-node", v, MAX_NUM_GPUS)),
    "--param-dtype": ("param_dtype", lambda v: _choice("--param-dtype", v, SHARD_DTYPES)),
    "--reduce-dtype": ("reduce_dtype", lambda v: _choice("--reduce-dtype", v, SHARD_DTYPES)),
    "--offload": ("offload", lambda v: _choice("--offload", v, OFFLOADS)),
    "--reshard-after-forward": ("reshard_after_forward", lambda v: _choice("--reshard-after-forward", v, ON_OFF)),
    "--reduce-bucket-size": ("reduce_bucket_size", lambda v: _float("--reduce-bucket-size", v)),
    "--max-reuse-distance": ("max_reuse_distance", lambda v: _float("--max-reuse-distance", v)),
}
ALLOWED_OPTIONS = tuple(_OPTIONS)


def parse_untrusted(argv: Sequence[str]) -> WorkloadSpec:
    """The ``#VEST`` options of a job that is not ours to run, as a WorkloadSpec, or DirectiveRefused.

    Every word is matched here before the spec is built; the spec's own checks (choices, JSON
    forms) then apply as for any workload. The result names only allow-listed models and optimizers."""
    words = list(argv)
    if len(words) > MAX_ARGV_WORDS:
        raise DirectiveRefused("too-long", f"more than {MAX_ARGV_WORDS} words of #VEST options")
    ns = Namespace(**{field: None for field, _ in _OPTIONS.values()})
    ns.model_arg = []
    i = 0
    while i < len(words):
        word = _word(words[i], "an option")
        name, eq, inline = word.partition("=") if word.startswith("--") else (word, "", "")
        if name not in _OPTIONS:
            raise DirectiveRefused("unknown-option", f"{word[:60]!r} is not one of the options allowed here "
                                                     f"({', '.join(ALLOWED_OPTIONS)})")
        field, check = _OPTIONS[name]
        if check is None:
            if eq:
                raise DirectiveRefused("bad-value", f"{name} takes no value")
            setattr(ns, field, True)
            i += 1
            continue
        if eq:
            value = inline
            i += 1
        else:
            if i + 1 >= len(words):
                raise DirectiveRefused("bad-value", f"{name} needs a value")
            value = _word(words[i + 1], name)
            i += 2
        value = check(value)
        if field == "model_arg":
            ns.model_arg.append(value)
        elif getattr(ns, field) is not None:
            raise DirectiveRefused("repeated-option", f"{name} is given twice")
        else:
            setattr(ns, field, value)
    if ns.model is None:
        raise DirectiveRefused("no-model", "no --model given")
    if ns.num_gpus == NUM_GPUS_AUTO:
        # ``--num-gpus auto`` (that word exactly) has a bounded meaning here: the GPU count the job
        # asks Slurm for, which vsbatch wrote and the caller passes (decide.py: the request's total),
        # so it asks for no more work than a number would. The spec carries the default until then.
        ns.num_gpus = None
    spec = spec_from_namespace(ns)
    for k, v in spec.model_kwargs.items():   # --model-args and --model-arg merged
        check_model_arg(k, v)
    return spec


def untrusted_argv(spec: WorkloadSpec) -> list[str]:
    """The options a checked spec travels as to the directive worker (which checks them again)."""
    return spec.to_argv()
