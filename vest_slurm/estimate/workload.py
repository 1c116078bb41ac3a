"""WorkloadSpec: what a training job trains, as one frozen record.

Parsed from command-line options (``vest estimate --model ...``) and from ``#VEST`` job-script
directives, which carry exactly the same options (``#VEST --model torchvision:resnet50 --batch-size
128``). Nothing here imports torch: the spec is checked for form here, and for meaning (does the
model exist, does the input fit it) when the model is built.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import asdict, dataclass, replace

from ..errors import WorkloadError

# Optimizers: name -> (torch.optim class or "module:Class", the memory-relevant arguments, states
# per parameter element in fp32 equivalents, as the optimizer keeps them). Learning rates are the
# classes' defaults: they move no memory.
OPTIMIZER_TABLE: dict[str, tuple[str, dict, float]] = {
    "sgd": ("SGD", {}, 0),
    "sgd-momentum": ("SGD", {"momentum": 0.9}, 1),                 # momentum_buffer
    "adam": ("Adam", {}, 2),                                      # exp_avg, exp_avg_sq
    "adamw": ("AdamW", {}, 2),
    "adam-amsgrad": ("Adam", {"amsgrad": True}, 3),               # + max_exp_avg_sq
    "adamw-amsgrad": ("AdamW", {"amsgrad": True}, 3),
    "rmsprop": ("RMSprop", {}, 1),                                # square_avg
    "rmsprop-momentum": ("RMSprop", {"momentum": 0.9}, 2),        # + momentum_buffer
    "rmsprop-centered": ("RMSprop", {"centered": True}, 2),       # + grad_avg
    "adagrad": ("Adagrad", {}, 1),                                # sum
    "adamax": ("Adamax", {}, 2),                                  # exp_avg, exp_inf
    "nadam": ("NAdam", {}, 2),                                    # exp_avg, exp_avg_sq
    "radam": ("RAdam", {}, 2),
    "adadelta": ("Adadelta", {}, 2),                              # square_avg, acc_delta
    "asgd": ("ASGD", {}, 1),                                      # ax (eta, mu: scalars)
    "rprop": ("Rprop", {}, 2),                                    # prev, step_size
    # factored second moments: a row and a column vector per matrix (row_var, col_var), the full
    # size only for 1-D parameters (variance); the count is that of the matrices
    "adafactor": ("Adafactor", {}, 0),
    # bitsandbytes' 8-bit optimizers (installed separately: pip install bitsandbytes): two uint8
    # states per element (a quarter of fp32's each) plus an fp32 absmax per block of 256; tensors
    # under 4,096 elements keep fp32 states. Their kernels have fake-tensor implementations.
    "adam-8bit": ("bitsandbytes.optim:Adam8bit", {}, 0.5),
    "adamw-8bit": ("bitsandbytes.optim:AdamW8bit", {}, 0.5),
}
OPTIMIZERS = tuple(OPTIMIZER_TABLE)


def optimizer_name(opt: dict) -> str | None:
    """--optimizer's name of a script's optimizer, described as ``{"class": ..., <its defaults>}``
    (fake_dist.describe_optimizer): the table's entry of that class whose memory-relevant arguments
    (momentum, amsgrad, centered) the optimizer has, the most specific where several do; None where
    the table has no such entry or two fit equally (RMSprop with momentum and centered)."""
    def same_class(cls: str) -> bool:   # "SGD" (torch.optim) or "package.module:Class"
        where, _, name = cls.rpartition(":")
        return name == opt.get("class") and (str(opt.get("module", "")).startswith(where) if where else
                                              str(opt.get("module", "torch.optim")).startswith("torch.optim"))

    fits = [(len(kw), name) for name, (cls, kw, _) in OPTIMIZER_TABLE.items()
            if same_class(cls) and all(bool(opt.get(k)) == bool(v) for k, v in kw.items())]
    fits.sort(reverse=True)
    if not fits or (len(fits) > 1 and fits[0][0] == fits[1][0]):
        return None
    return fits[0][1]

OPTIMIZER_IMPLS = ("auto", "foreach", "fused", "for-loop")
PRECISIONS = ("fp32", "tf32", "amp-fp16", "amp-bf16", "bf16", "fp16")
LOSSES = ("auto", "cross-entropy", "mse", "model")
PARALLELISMS = ("ddp", "dp", "none", "fsdp", "fsdp2", "hsdp", "zero1", "zero2", "zero3")
SHARDED = ("fsdp", "fsdp2", "hsdp", "zero1", "zero2", "zero3")   # sharding.py models them per rank
# FSDP1's ShardingStrategy FULL_SHARD / SHARD_GRAD_OP, and HYBRID_SHARD / _HYBRID_SHARD_ZERO2 (the same
# within a shard group of --shard-group-size ranks, default one node's GPUs; replicated across groups)
SHARDINGS = ("full-shard", "shard-grad-op", "hybrid-shard", "hybrid-shard-grad-op")
SHARD_DTYPES = ("auto", "fp32", "bf16", "fp16")   # auto: the weights' own dtype (no mixed-precision policy)
OFFLOADS = ("none", "optimizer", "params")
ON_OFF = ("on", "off")
PRE_FORWARDS = ("none", "grad", "no-grad")
CUDNN_TF32 = ("on", "off")
CUDNN_BENCHMARK = ("off", "on")
ZERO_GRADS = ("after-step", "before-backward", "never")
GRADIENT_CHECKPOINTING = ("off", "on")
MODEL_PREFIXES = ("torchvision:", "timm:", "hf:", "mlp:")


@dataclass(frozen=True)
class InputSpec:
    """Per-sample input. ``kind`` is image (C, H, W), tokens (length,), tensor (any shape), or
    default (the model's own default input size, e.g. timm's pretrained_cfg)."""

    kind: str
    shape: tuple[int, ...] = ()

    def __str__(self) -> str:
        if self.kind == "default":
            return "default"
        if self.kind == "tokens":
            return f"seq{self.shape[0]}"
        prefix = "tensor:" if self.kind == "tensor" else ""
        return prefix + "x".join(str(d) for d in self.shape)


def parse_input(text: str) -> InputSpec:
    """``3x224x224`` image, ``seq512`` tokens, ``tensor:16x80`` any float tensor, ``784`` features,
    ``default`` the model's default."""
    t = text.strip().lower()
    if t in ("default", "timm_default", ""):
        return InputSpec("default")
    m = re.fullmatch(r"seq(?:uence)?[:=]?(\d+)", t)
    if m:
        n = int(m.group(1))
        if n <= 0:
            raise WorkloadError(f"input {text!r}: sequence length must be positive", "use e.g. --input seq512")
        return InputSpec("tokens", (n,))
    kind = "tensor"
    if t.startswith("tensor:"):
        t = t[len("tensor:"):]
    dims = t.split("x")
    if not all(re.fullmatch(r"\d+", d) for d in dims):
        raise WorkloadError(
            f"malformed input shape {text!r}",
            "use CxHxW for images (3x224x224), seqN for tokens (seq512), N for features (784), "
            "or tensor:AxB for any other per-sample shape",
        )
    shape = tuple(int(d) for d in dims)
    if any(d <= 0 for d in shape):
        raise WorkloadError(f"input {text!r}: every dimension must be positive", "e.g. --input 3x224x224")
    if len(shape) == 3 and not text.strip().lower().startswith("tensor:"):
        kind = "image"
    return InputSpec(kind, shape)


@dataclass(frozen=True)
class WorkloadSpec:
    """One training job's memory-relevant settings. ``batch_size`` is per GPU."""

    model: str
    batch_size: int
    input: InputSpec = InputSpec("default")
    model_args: tuple[tuple[str, object], ...] = ()
    loss: str = "auto"
    optimizer: str = "adam"
    optimizer_impl: str = "auto"
    precision: str = "fp32"
    channels_last: bool = False
    grad_accum: int = 1
    num_gpus: int = 1
    parallelism: str = "ddp"
    alloc_conf: str = ""
    steps: int = 2
    weight_decay: float | None = None   # None: the optimizer's torch default (AdamW 0.01, others 0)
    pre_forward: str = "none"   # one full-batch fp32 forward before training (a sanity check, a summary,
                                # targets built from the model's output): with autograd ("grad") or not
    cudnn_tf32: str = "on"      # torch.backends.cudnn.allow_tf32 (PyTorch's default: on); it decides which
                                # cuDNN engines fp32 convolutions may use, and so their workspaces
    cudnn_benchmark: str = "off"   # torch.backends.cudnn.benchmark (PyTorch's default: off); on, the first
                                   # run of each convolution shape times every engine in one workspace
                                   # as large as the largest engine's (timm's train.py sets it)
    zero_grad: str = "after-step"   # where the loop calls optimizer.zero_grad() (set_to_none): after the
                                    # step or before the forward ("after-step": the gradients are gone
                                    # while the next forward runs), between the forward and backward
                                    # ("before-backward": Lightning, timm < 0.9's train.py; last step's
                                    # gradients live through the forward), or "never" (accumulated)
    gradient_checkpointing: str = "off"   # activation checkpointing through the model's own switch (HF
                                          # activation/gradient_checkpointing_enable, timm set_grad_checkpointing):
                                          # each block keeps its input and recomputes the rest in backward
    # Sharded data parallel (parallelism in SHARDED; sharding.py). num_gpus is the total.
    sharding: str = "full-shard"       # FSDP1 only: FULL_SHARD, SHARD_GRAD_OP or the hybrid ones (SHARDINGS)
    shard_group_size: int = 0          # hsdp: ranks per shard group (0: the GPUs of one node)
    gpus_per_node: int = 0             # 0: as many per node as the GPU type's nodes have (placement)
    param_dtype: str = "auto"          # the wrapper's MixedPrecision(Policy) param_dtype
    reduce_dtype: str = "auto"         # its reduce_dtype (auto: the param dtype, PyTorch's default)
    offload: str = "none"              # CPU offload: none, optimizer (states and masters), params
    reshard_after_forward: str = "on"  # FSDP2 reshard_after_forward / FSDP1 FULL_SHARD vs SHARD_GRAD_OP
    reduce_bucket_size: int = 0        # DeepSpeed ZeRO-2/3 reduce_bucket_size, elements (0: DeepSpeed's default)
    max_reuse_distance: int = 1_000_000_000   # DeepSpeed ZeRO-3 stage3_max_reuse_distance, elements (its default)
    tensor_parallel: int = 1           # dynamic analysis: the ranks of a script's parallelize_module group, each
                                       # holding its shards of the layers named (its trace is one rank's)
    flags: tuple[str, ...] = ()   # dynamic analysis: why the estimate may not be the real run's (shown with it)

    @property
    def model_kwargs(self) -> dict:
        return {k: _thaw(v) for k, v in self.model_args}

    @property
    def amp_dtype(self) -> str | None:
        return {"amp-fp16": "float16", "amp-bf16": "bfloat16"}.get(self.precision)

    @property
    def weight_dtype(self) -> str:
        return {"bf16": "bfloat16", "fp16": "float16"}.get(self.precision, "float32")

    @property
    def computes_bf16(self) -> bool:
        """The precision computes in bfloat16 (autocast to it, or bf16 weights): on every GPU alike."""
        return "bfloat16" in (self.amp_dtype, self.weight_dtype)

    def with_(self, **changes) -> "WorkloadSpec":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["input"] = str(self.input)
        d["model_args"] = self.model_kwargs
        return d

    def to_argv(self) -> list[str]:
        """The options that parse back into this spec (used to attach and to re-run)."""
        argv = ["--model", self.model, "--batch-size", str(self.batch_size), "--input", str(self.input)]
        if self.model_args:
            argv += ["--model-args", json.dumps(self.model_kwargs, sort_keys=True)]
        defaults = WorkloadSpec(model="x", batch_size=1)
        for name in ("loss", "optimizer", "optimizer_impl", "precision", "grad_accum", "num_gpus",
                     "parallelism", "alloc_conf", "steps", "weight_decay", "pre_forward", "cudnn_tf32",
                     "cudnn_benchmark", "zero_grad", "gradient_checkpointing", "sharding", "shard_group_size",
                     "gpus_per_node", "param_dtype", "reduce_dtype", "offload", "reshard_after_forward",
                     "reduce_bucket_size", "max_reuse_distance"):
            v = getattr(self, name)
            if v != getattr(defaults, name):
                argv += ["--" + name.replace("_", "-"), str(v)]
        if self.channels_last:
            argv.append("--channels-last")
        return argv


def _freeze(v):
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, list):
        return ("__list__",) + tuple(_freeze(x) for x in v)
    return v


def _thaw(v):
    if isinstance(v, tuple):
        if v and v[0] == "__list__":
            return [_thaw(x) for x in v[1:]]
        return {k: _thaw(x) for k, x in v}
    return v


def _parse_scalar(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class _Parser(argparse.ArgumentParser):
    """argparse that raises WorkloadError instead of printing usage and exiting."""

    def error(self, message):  # noqa: D401 - argparse's hook
        raise WorkloadError(f"workload options: {message}", "see `vest estimate --help` for the options")


def add_workload_arguments(p: argparse.ArgumentParser, required: bool = True) -> None:
    """The workload options, shared by `vest estimate`, `vest check` and #VEST directives."""
    g = p.add_argument_group("workload")
    g.add_argument("--model", required=required,
                   help="torchvision:NAME, timm:NAME, hf:CLASS_OR_PRESET, mlp:JSON_LAYERS, FILE.py:FACTORY or pkg.mod:FACTORY")
    g.add_argument("--model-args", default=None, help="JSON object of constructor / config arguments")
    g.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="one constructor / config argument (repeatable; VALUE parsed as JSON when it can be)")
    g.add_argument("--batch-size", type=str, default=None, help="per-GPU batch size")
    g.add_argument("--input", default=None, help="3x224x224 (image), seq512 (tokens), 784 (features), tensor:AxB, default")
    g.add_argument("--loss", default=None, help="auto, cross-entropy, mse (on an HF model: on its logits, no labels), model (the model's own loss; auto for HF models)")
    g.add_argument("--optimizer", default=None, help=", ".join(OPTIMIZERS))
    g.add_argument("--optimizer-impl", default=None, help=", ".join(OPTIMIZER_IMPLS) + " (auto: as PyTorch picks on a GPU)")
    g.add_argument("--precision", default=None, help=", ".join(PRECISIONS))
    g.add_argument("--channels-last", action="store_true", default=None)
    g.add_argument("--grad-accum", type=str, default=None, help="gradient accumulation steps")
    g.add_argument("--num-gpus", type=str, default=None, help="GPUs of the job (data parallel; batch size is per GPU); "
                   "auto (sharded jobs, vsbatch and vest check): the smallest count that fits")
    g.add_argument("--parallelism", default=None, help=", ".join(PARALLELISMS) + " (fsdp: FSDP1, fsdp2: fully_shard, "
                   "hsdp: fully_shard over a 2-D mesh, zero1/2/3: DeepSpeed ZeRO stages; modelled per rank)")
    g.add_argument("--sharding", default=None, help="fsdp only: full-shard (default), shard-grad-op, hybrid-shard, hybrid-shard-grad-op")
    g.add_argument("--shard-group-size", type=str, default=None, help="hsdp: GPUs per shard group (default: one node's)")
    g.add_argument("--gpus-per-node", type=str, default=None, help="GPUs per node (default: the GPU type's nodes')")
    g.add_argument("--param-dtype", default=None, help="sharded jobs: the mixed-precision param dtype (fp32, bf16, fp16; "
                   "default: the weights' dtype); parameters and optimizer states stay in their own dtype, sharded")
    g.add_argument("--reduce-dtype", default=None, help="sharded jobs: the gradient reduction dtype (default: the param dtype)")
    g.add_argument("--offload", default=None, help="sharded jobs: CPU offload: none (default), optimizer, params")
    g.add_argument("--reshard-after-forward", default=None, help="fsdp2/hsdp/zero3: on (default) or off")
    g.add_argument("--reduce-bucket-size", default=None,
                   help="zero2/zero3: DeepSpeed's reduce_bucket_size in elements (e.g. 2e8; default DeepSpeed's 5e8)")
    g.add_argument("--max-reuse-distance", default=None,
                   help="zero3: DeepSpeed's stage3_max_reuse_distance in elements (default DeepSpeed's 1e9): a "
                        "block used again within it stays gathered from its forward to its backward")
    g.add_argument("--alloc-conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF of the job")
    g.add_argument("--steps", type=str, default=None, help="training iterations to trace (default 2)")
    g.add_argument("--pre-forward", default=None,
                   help="one fp32 forward of a full batch before training, as scripts that check the model or "
                        "build targets from its output do: grad (autograd on, its activations held until it "
                        "ends), no-grad, none (default)")
    g.add_argument("--cudnn-tf32", default=None,
                   help="on (PyTorch's default) or off: torch.backends.cudnn.allow_tf32 of the job, which decides "
                        "the cuDNN engines, and so the workspaces, of fp32 convolutions")
    g.add_argument("--cudnn-benchmark", default=None,
                   help="off (PyTorch's default) or on: torch.backends.cudnn.benchmark of the job; on, the first "
                        "run of each convolution shape allocates the largest workspace of all cuDNN engines "
                        "to time them (timm's train.py sets it)")
    g.add_argument("--zero-grad", default=None,
                   help="where the loop zeroes the gradients (set to None): after-step (default; also "
                        "zero_grad() at the top of the loop), before-backward (after the forward: Lightning, "
                        "timm < 0.9's train.py; the previous gradients live through the forward), never")
    g.add_argument("--gradient-checkpointing", default=None,
                   help="off (default) or on: the model's own activation checkpointing switch (transformers "
                        "models, timm models that have one); each block keeps its input and recomputes the "
                        "rest in the backward")
    g.add_argument("--weight-decay", type=str, default=None,
                   help="optimizer weight decay (default: torch's, 0.01 for AdamW, 0 otherwise); "
                        "SGD and Adam with weight decay take a temporary copy of the gradients")


NUM_GPUS_AUTO = "auto"


def split_num_gpus_auto(argv) -> tuple[tuple[str, ...], bool]:
    """(argv without ``--num-gpus auto`` / ``--num-gpus=auto``, whether it was there). ``auto`` is
    not a count: vsbatch and ``vest check`` resolve it (site/autogpus.py) and the bridge reads it as
    the GPU count the job asks Slurm for (which vsbatch wrote); every other parser sees a number."""
    words, out, auto, i = list(argv), [], False, 0
    while i < len(words):
        w = words[i]
        if w == "--num-gpus" and i + 1 < len(words) and words[i + 1] == NUM_GPUS_AUTO:
            auto, i = True, i + 2
            continue
        if w == "--num-gpus=" + NUM_GPUS_AUTO:
            auto, i = True, i + 1
            continue
        out.append(w)
        i += 1
    return tuple(out), auto


def _positive_int(name: str, text, minimum: int = 1) -> int:
    try:
        v = int(str(text))
    except ValueError:
        raise WorkloadError(f"--{name} {text!r} is not an integer", f"give --{name} a whole number, e.g. --{name} 32") from None
    if v < minimum:
        raise WorkloadError(f"--{name} {v} must be at least {minimum}", f"give --{name} a value of {minimum} or more")
    return v


# ZeRO-3 with its parameters offloaded keeps a working set of gathered parameters on the GPU that
# DeepSpeed's coordinator sizes (stage3_max_live_parameters, stage3_prefetch_bucket_size, the small
# parameters it keeps resident: stage3_param_persistence_threshold); sharding.py places one unit's
# parameters at a time. Against the one published run found (benchmarks/README.md: a 18B GPT-2 on
# one A100) the estimate was 31% low, not yet attributed.
ZERO3_OFFLOAD_FLAG = ("DeepSpeed ZeRO-3 with parameter offload: the GPU's working set of gathered parameters "
                      "(stage3_max_live_parameters, prefetch, resident small parameters) is not modelled; "
                      "against a published run this estimate was 31% low")


def bucket_elements(text, option: str = "--reduce-bucket-size") -> int:
    """A DeepSpeed size in elements (a bucket, a reuse distance), written as DeepSpeed configs write
    it (200000000, 2e8, 5e8); 0 is the bucket's default."""
    try:
        v = float(str(text))
    except ValueError:
        v = float("nan")
    if not (0 <= v <= 1e12 and v == int(v)):   # (nan and inf fail the range before int() sees them)
        raise WorkloadError(f"{option} {text!r} is not a whole number of elements",
                            f"give it as DeepSpeed's config does, e.g. {option} 2e8")
    return int(v)


def _num_gpus(value) -> int:
    if value == NUM_GPUS_AUTO:
        raise WorkloadError("--num-gpus auto is chosen by vsbatch, `vest check` and `vest estimate` of a declared "
                            "workload (the smallest GPU count at which a sharded job fits); a training command's "
                            "launcher fixes its own count", "give --num-gpus N here, or declare the workload (--model ...)")
    return _positive_int("num-gpus", value)


def _weight_decay(value) -> float | None:
    if value is None:
        return None
    try:
        v = float(value)
    except ValueError:
        raise WorkloadError(f"--weight-decay {value!r} is not a number", "e.g. --weight-decay 0.01") from None
    if v < 0:
        raise WorkloadError(f"--weight-decay {v} is negative", "give 0 or a positive number")
    return v


def _choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    v = value.strip().lower().replace("_", "-")
    aliases = {"amp_fp16": "amp-fp16", "amp": "amp-fp16", "fp16-amp": "amp-fp16", "bf16-amp": "amp-bf16",
               "ce": "cross-entropy", "crossentropy": "cross-entropy", "foreach": "foreach", "loop": "for-loop"}
    v = aliases.get(v, v)
    if v not in choices:
        raise WorkloadError(f"unknown {name} {value!r}", f"use one of: {', '.join(choices)}")
    return v


def spec_from_namespace(ns: argparse.Namespace, base: WorkloadSpec | None = None) -> WorkloadSpec:
    """Build a spec from parsed options; options not given keep ``base``'s values (CLI over #VEST)."""
    model = ns.model or (base.model if base else None)
    if not model:
        raise WorkloadError("no model given", "add --model, e.g. --model torchvision:resnet50")
    if not (model.startswith(MODEL_PREFIXES) or re.fullmatch(r"[^:]+:[A-Za-z_][A-Za-z0-9_]*", model)):
        raise WorkloadError(
            f"model {model!r} has no known form",
            "use torchvision:NAME, timm:NAME, hf:CLASS_OR_PRESET, mlp:JSON_LAYERS, path/to/file.py:factory or pkg.module:factory",
        )
    kwargs = dict(base.model_kwargs) if base and model == base.model else {}
    if ns.model_args:
        try:
            extra = json.loads(ns.model_args)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"--model-args is not valid JSON: {e}", 'write it as a JSON object, e.g. \'{"num_classes": 100}\'') from None
        if not isinstance(extra, dict):
            raise WorkloadError("--model-args must be a JSON object", 'e.g. --model-args \'{"num_classes": 100}\'')
        kwargs.update(extra)
    for item in ns.model_arg or []:
        if "=" not in item:
            raise WorkloadError(f"--model-arg {item!r} is not KEY=VALUE", "e.g. --model-arg num_classes=100")
        k, v = item.split("=", 1)
        kwargs[k.strip()] = _parse_scalar(v)

    def pick(name, default):
        v = getattr(ns, name, None)
        if v is not None:
            return v
        return getattr(base, name) if base is not None else default

    batch = pick("batch_size", None)
    if batch is None:
        raise WorkloadError("no batch size given", "add --batch-size N (per GPU)")
    spec = WorkloadSpec(
        model=model,
        batch_size=_positive_int("batch-size", batch),
        input=parse_input(ns.input) if ns.input is not None else (base.input if base else InputSpec("default")),
        model_args=_freeze(kwargs) if kwargs else (),
        loss=_choice("loss", pick("loss", "auto"), LOSSES),
        optimizer=_choice("optimizer", pick("optimizer", "adam"), OPTIMIZERS),
        optimizer_impl=_choice("optimizer implementation", pick("optimizer_impl", "auto"), OPTIMIZER_IMPLS),
        precision=_choice("precision", pick("precision", "fp32"), PRECISIONS),
        channels_last=bool(pick("channels_last", False)),
        grad_accum=_positive_int("grad-accum", pick("grad_accum", 1)),
        num_gpus=_num_gpus(pick("num_gpus", 1)),
        parallelism=_choice("parallelism", pick("parallelism", "ddp"), PARALLELISMS),
        alloc_conf=str(pick("alloc_conf", "")),
        steps=_positive_int("steps", pick("steps", 2), minimum=1),
        weight_decay=_weight_decay(pick("weight_decay", None)),
        pre_forward=_choice("pre-forward", pick("pre_forward", "none"), PRE_FORWARDS),
        cudnn_tf32=_choice("cudnn-tf32", pick("cudnn_tf32", "on"), CUDNN_TF32),
        cudnn_benchmark=_choice("cudnn-benchmark", pick("cudnn_benchmark", "off"), CUDNN_BENCHMARK),
        zero_grad=_choice("zero-grad", pick("zero_grad", "after-step"), ZERO_GRADS),
        gradient_checkpointing=_choice("gradient-checkpointing", pick("gradient_checkpointing", "off"),
                                       GRADIENT_CHECKPOINTING),
        sharding=_choice("sharding", pick("sharding", "full-shard"), SHARDINGS),
        shard_group_size=_positive_int("shard-group-size", pick("shard_group_size", 0), minimum=0),
        gpus_per_node=_positive_int("gpus-per-node", pick("gpus_per_node", 0), minimum=0),
        param_dtype=_choice("param-dtype", pick("param_dtype", "auto"), SHARD_DTYPES),
        reduce_dtype=_choice("reduce-dtype", pick("reduce_dtype", "auto"), SHARD_DTYPES),
        offload=_choice("offload", pick("offload", "none"), OFFLOADS),
        reshard_after_forward=_choice("reshard-after-forward", pick("reshard_after_forward", "on"), ON_OFF),
        reduce_bucket_size=bucket_elements(pick("reduce_bucket_size", 0)),
        max_reuse_distance=bucket_elements(pick("max_reuse_distance", WorkloadSpec.max_reuse_distance),
                                           "--max-reuse-distance"),
    )
    if spec.parallelism == "zero3" and spec.offload == "params" and ZERO3_OFFLOAD_FLAG not in spec.flags:
        spec = replace(spec, flags=spec.flags + (ZERO3_OFFLOAD_FLAG,))
    if spec.max_reuse_distance != WorkloadSpec.max_reuse_distance and spec.parallelism != "zero3":
        raise WorkloadError(f"--max-reuse-distance is DeepSpeed ZeRO-3's stage3_max_reuse_distance, not --parallelism "
                            f"{spec.parallelism}'s", "add --parallelism zero3, or drop it")
    if spec.reduce_bucket_size and spec.parallelism not in ("zero2", "zero3"):
        raise WorkloadError(f"--reduce-bucket-size is DeepSpeed ZeRO-2/3's gradient bucket, not --parallelism "
                            f"{spec.parallelism}'s", "add --parallelism zero2 or zero3, or drop it")
    sharded_only = [n for n, d in (("sharding", "full-shard"), ("param_dtype", "auto"), ("reduce_dtype", "auto"),
                                   ("offload", "none"), ("shard_group_size", 0)) if getattr(spec, n) != d]
    if sharded_only and spec.parallelism not in SHARDED:
        raise WorkloadError(f"--{sharded_only[0].replace('_', '-')} applies to sharded jobs, not --parallelism "
                            f"{spec.parallelism}", f"add --parallelism one of {', '.join(SHARDED)}, or drop it")
    if spec.sharding != "full-shard" and spec.parallelism != "fsdp":
        raise WorkloadError(f"--sharding {spec.sharding} is FSDP1's sharding strategy, not --parallelism {spec.parallelism}'s",
                            "use --parallelism fsdp, or hsdp for fully_shard over a 2-D mesh")
    if (spec.parallelism == "hsdp" or spec.sharding.startswith("hybrid")) and spec.shard_group_size \
            and spec.num_gpus % spec.shard_group_size:
        raise WorkloadError(f"--shard-group-size {spec.shard_group_size} does not divide --num-gpus {spec.num_gpus}",
                            "HSDP's 2-D mesh needs num_gpus = replicas x shard group size")
    return spec


def parse_workload_args(argv: list[str], base: WorkloadSpec | None = None) -> WorkloadSpec:
    """Parse workload options from an argv list (a #VEST line, or tests)."""
    p = _Parser(prog="#VEST", add_help=False)
    add_workload_arguments(p, required=False)
    ns, rest = p.parse_known_args(argv)
    if rest:
        raise WorkloadError(f"unknown workload option(s): {' '.join(rest)}", "see `vest estimate --help` for the options")
    return spec_from_namespace(ns, base)


def parse_vest_line(text: str, base: WorkloadSpec | None = None) -> WorkloadSpec:
    """Parse the text after ``#VEST`` (shell-quoted options)."""
    try:
        argv = shlex.split(text, comments=False)
    except ValueError as e:
        raise WorkloadError(f"#VEST line cannot be split into options: {e}", "check its quotes") from None
    return parse_workload_args(argv, base)
