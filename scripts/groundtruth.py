"""Ground-truth rows (shared/groundtruth/*.csv) as WorkloadSpecs, for the accuracy benchmark.

A row of the ground-truth schema (see the groundtruth README) describes one measured training run
in words and JSON; ``row_to_spec`` turns it into the same WorkloadSpec a user would write with
``vest estimate --model ... --batch-size ...``, so the benchmark measures the path users take.
The mapping is a pure function of the row: no torch, no files. A row that cannot be rebuilt
(variable input sizes, an unknown optimizer or precision) raises ``RowSkip`` with the reason; the
benchmark writes that reason in the row's status, it never drops the row.

Mapping rules, one per column (the README states what each column means):
- model_kind/model_name/model_args -> ``--model`` and ``--model-args``. Annotation keys (``note``,
  ``guess``, ``weights``/``pretrained`` flags, ``from_config``, ``impl``) do not change memory and
  are dropped. HF: ``from_config`` rows pass their config fields; ``{"config": "XConfig() defaults"}``
  means the class defaults; ``{"config": "AutoConfig <checkpoint>"}`` and ``{"pretrained":
  "<checkpoint>"}`` name a checkpoint whose config is one of models.HF_PRESETS. Where the preset's
  class differs from the row's class (whisper-tiny as WhisperForAudioClassification), the row's
  class is built from the preset's config fields. ``other`` rows with ``library":
  "segmentation_models_pytorch"`` are built by ``smp_model`` below (a user factory).
- input_shape: ``CxHxW`` image, ``seqN`` tokens (``seq<=N`` dynamic padding: its maximum N, which
  a full-length forward reaches), ``input_features AxB`` a float tensor, ``N`` MLP features,
  ``timm_default`` the model's default. Anything else (COCO's variable image sizes) is a RowSkip.
- batch_size: per GPU, except DataParallel rows whose notes say the batch is global: divided by the
  GPU count (each replica's share).
- num_gpus: empty means "all GPUs of the node" (milabench *-gpus benches, per-device values): a
  data-parallel job of an unknown count; per-GPU memory depends only on it being more than one
  (gradient buckets, NCCL), so 2 is used. ``DataParallel`` in the notes -> parallelism dp, else ddp.
- optimizer/optimizer_args: Adam -> adam, AdamW -> adamw (-amsgrad with amsgrad), SGD -> sgd-momentum iff
  momentum > 0, RMSprop -> rmsprop[-momentum|-centered], Adagrad, Adamax, NAdam, RAdam, Adadelta, ASGD,
  Rprop, Adafactor by name; HF Trainer's ``adamw_torch_fused`` or ``{"fused": true}`` ->
  ``--optimizer-impl fused``, ``{"foreach": false}`` -> ``for-loop``; bitsandbytes' 8-bit Adam / AdamW
  (``adamw_bnb_8bit``, ``AdamW8bit``) -> adam-8bit / adamw-8bit, its paged optimizers are a RowSkip.
- precision: fp32, tf32 (fp32 memory), amp_fp16[+tf32] -> amp-fp16, amp_bf16 -> amp-bf16; bf16 and fp16
  (weights in half precision) as they are; PyTorch Lightning's names too (bf16-mixed, 16-mixed,
  bf16-true, 16-true, 32-true).
- loss: HF rows use the model's own loss; cross-entropy rows cross-entropy; smp's DiceLoss, MSE, L1,
  Huber, BCE and KL-divergence -> mse (all keep a float target of the output's size, which
  cross-entropy's int64 class map does not).
"""

from __future__ import annotations

import json
import re
from typing import Mapping

from vest_slurm.estimate.workload import OPTIMIZER_TABLE, WorkloadSpec, parse_workload_args

# Keys of model_args that describe the row for people and do not change what is built.
_ANNOTATION_KEYS = {"note", "guess", "from_config", "impl", "library", "encoder_weights"}

_PRECISIONS = {"fp32": "fp32", "tf32": "tf32", "amp_fp16": "amp-fp16", "amp_fp16+tf32": "amp-fp16",
               "amp_bf16": "amp-bf16", "amp_bf16+tf32": "amp-bf16", "bf16": "bf16", "fp16": "fp16",
               # PyTorch Lightning's precision names: "-mixed" is autocast, "-true" the weights' dtype
               "bf16-mixed": "amp-bf16", "16-mixed": "amp-fp16", "bf16-true": "bf16", "16-true": "fp16",
               "32-true": "fp32", "32": "fp32"}


class RowSkip(Exception):
    """The row cannot be rebuilt as a WorkloadSpec; ``reason`` says why (written to the results)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def is_amd(row: Mapping[str, str]) -> bool:
    """AMD (ROCm) devices: reported apart and never used to tune anything (README caveat 8)."""
    g = row.get("gpu", "").lower()
    return "mi325" in g or "mi300" in g or "mi250" in g or "instinct" in g or g.startswith("amd")


def row_to_argv(row: Mapping[str, str]) -> list[str]:
    """The ``vest estimate`` options that describe this row's workload (raises RowSkip)."""
    kind = (row.get("model_kind") or "").strip()
    name = (row.get("model_name") or "").strip()
    notes = row.get("notes") or ""
    try:
        args = json.loads(row.get("model_args") or "{}")
    except json.JSONDecodeError as e:
        raise RowSkip(f"model_args is not JSON: {e}") from None
    if not isinstance(args, dict):
        raise RowSkip("model_args is not a JSON object")

    model, model_args = _model(kind, name, args)
    argv = ["--model", model]
    if model_args:
        argv += ["--model-args", json.dumps(model_args, sort_keys=True)]
    argv += ["--input", _input(row.get("input_shape") or "")]

    num_gpus, parallelism = _gpus(row.get("num_gpus") or "", notes)
    batch = _int(row.get("batch_size"), "batch_size")
    if parallelism == "dp" and re.search(r"batch_size\s*=\s*global", notes, re.I):
        batch = max(1, batch // num_gpus)   # DataParallel scatters a global batch over the replicas
    argv += ["--batch-size", str(batch)]
    argv += ["--optimizer", _optimizer(row.get("optimizer") or "", row.get("optimizer_args") or "")]
    impl = _optimizer_impl(row.get("optimizer") or "", row.get("optimizer_args") or "")
    if impl:
        argv += ["--optimizer-impl", impl]
    argv += ["--precision", _precision(row.get("precision") or "")]
    argv += ["--loss", "model" if kind == "hf" else _loss(row.get("loss") or "")]
    if (row.get("channels_last") or "").strip() in ("1", "true", "True"):
        argv.append("--channels-last")
    if num_gpus > 1:
        argv += ["--num-gpus", str(num_gpus), "--parallelism", parallelism]
    if (row.get("precision") or "").strip() == "fp32" and re.search(r"tf32 (enabled )?iff 'tf32' in precision", notes):
        # milabench turns TF32 off for its fp32 runs (torchcompat set_enable_tf32(False))
        argv += ["--cudnn-tf32", "off"]
    # milabench's HF bench: the versions of bench/__main__.py at hand (not the one at the data's
    # commit) call no optimizer.zero_grad() at all, which is --zero-grad never; the measurements
    # behave as if the gradients were freed every step (BERT in AMP fp16: 17 of 19 rows within
    # -2.2...+1.3% with the default; with never, 7 of them rise to +7...+13%), so they keep the default.
    if re.search(r"benchmarks/timm: pytorch-image-models train\.py|benchmarks/lightning/main\.py|Lightning DDP", notes):
        # timm's train.py and Lightning's automatic optimization zero the gradients after the
        # forward, just before backward: the previous step's gradients live through the forward
        argv += ["--zero-grad", "before-backward"]
    if re.search(r"benchmarks/timm: pytorch-image-models train\.py", notes):
        # timm's train.py sets torch.backends.cudnn.benchmark = True at import
        argv += ["--cudnn-benchmark", "on"]
    if re.search(r"bench '[^']*-noio'", notes) and re.search(r"fp32 forward of the full batch with autograd", notes):
        # milabench's synthetic_fixed loader builds its targets with one fp32 forward (autograd on)
        argv += ["--pre-forward", "grad"]
    return argv


# The cuDNN each torch release's CUDA wheels ship (pytorch/pytorch RELEASE.md, "Release
# Compatibility Matrix": 2.6 with CUDA 12.6 pins cuDNN 9.5.1.17). milabench's rows name torch 2.6.0
# +cu126; a row without a torch version (CARMA) ran an unknown cuDNN.
_TORCH_CUDNN = {("2.6.0", "cu126"): "9.5.1"}


def job_cudnn(row: Mapping[str, str]) -> str:
    """The cuDNN the row's job ran, as $VEST_JOB_CUDNN takes it ("unknown" where the row does not say)."""
    hint = row.get("framework_hint", "") or ""
    m = re.search(r"torch (\d+\.\d+\.\d+)", hint)
    if m is None or "rocm" in hint.lower():
        return "unknown"
    # milabench's README: its CUDA requirements were torch 2.6.0+cu126 (groundtruth README)
    return _TORCH_CUDNN.get((m.group(1), "cu126"), "unknown")


def row_to_spec(row: Mapping[str, str]) -> WorkloadSpec:
    """The WorkloadSpec of one ground-truth row (a csv.DictReader dict). Raises RowSkip."""
    argv = row_to_argv(row)
    try:
        return parse_workload_args(argv)
    except Exception as e:   # a WorkloadError here means the mapping produced something invalid
        raise RowSkip(f"workload options rejected: {e}") from None


# ------------------------------------------------------------------ columns

def _model(kind: str, name: str, args: dict) -> tuple[str, dict]:
    if kind == "torchvision":
        kept = {k: v for k, v in args.items() if k not in _ANNOTATION_KEYS and k != "weights"}
        # "weights" (pretrained or not) holds the same memory as random init; the estimate never loads weights
        return f"torchvision:{name}", kept
    if kind == "timm":
        kept = {k: v for k, v in args.items() if k not in _ANNOTATION_KEYS and k != "pretrained"}
        return f"timm:{name}", kept
    if kind == "hf":
        return _hf_model(name, args)
    if kind == "mlp":
        layers = args.get("sequential")
        if not isinstance(layers, list) or not layers:
            raise RowSkip("mlp row without a 'sequential' layer list in model_args")
        return "mlp:" + json.dumps(layers, separators=(",", ":")), {}
    if kind == "other" and args.get("library") == "segmentation_models_pytorch":
        m = re.match(r"\s*smp\.(\w+)\s*\(", name)
        arch = m.group(1) if m else "Unet"
        kept = {k: v for k, v in args.items() if k not in _ANNOTATION_KEYS}
        kept["arch"] = arch
        ctor = dict(re.findall(r"(\w+)\s*=\s*'?([\w.]+)'?", name))
        for k in ("in_channels", "classes"):
            if k in ctor and k not in kept:
                kept[k] = int(ctor[k])
        return "groundtruth:smp_model", kept
    raise RowSkip(f"model_kind {kind!r} ({name}) has no builder; describe it as torchvision/timm/hf/mlp "
                  "or give a user factory")


def _hf_model(cls_name: str, args: dict) -> tuple[str, dict]:
    from vest_slurm.estimate.models import HF_PRESETS, hf_preset   # imports torch: only HF rows need it

    fields = {k: v for k, v in args.items() if k not in _ANNOTATION_KEYS and k not in ("config", "pretrained")}
    checkpoint = None
    if isinstance(args.get("pretrained"), str):
        checkpoint = args["pretrained"]
    cfg = args.get("config")
    if isinstance(cfg, str):
        m = re.match(r"\s*AutoConfig\s+(\S+)", cfg)
        if m:
            checkpoint = m.group(1)
        elif not re.match(r"\s*\w+Config\(\)\s*defaults", cfg):
            raise RowSkip(f"HF config {cfg!r} is neither 'XConfig() defaults' nor 'AutoConfig <checkpoint>'")
        # runtime settings the description states ("num_buckets set to 128 if unset")
        for key, value in re.findall(r"(\w+) set to (\d+) if unset", cfg):
            fields.setdefault(key, int(value))
    if cls_name.startswith("T5") and "attn_implementation" not in fields:
        # The measured runs predate transformers' SDPA for T5 (PR #47014, merged 2026-07): eager
        # attention, which keeps the attention probabilities for backward.
        fields["attn_implementation"] = "eager"
    if checkpoint is None:
        return f"hf:{cls_name}", fields
    preset = hf_preset(checkpoint)
    if preset is None:
        raise RowSkip(f"HF checkpoint {checkpoint!r} has no preset in models.HF_PRESETS")
    preset_cls, preset_fields = HF_PRESETS[preset]
    if cls_name.startswith("AutoModel"):
        cls_name = _auto_class(cls_name, preset_cls)
    if preset_cls == cls_name:
        return f"hf:{preset}", fields
    return f"hf:{cls_name}", {**preset_fields, **fields}


def _auto_class(auto_name: str, preset_cls: str) -> str:
    """The class ``AutoModelForX.from_config`` builds for the preset's config (milabench names its
    models by Auto category): transformers' own mapping, which needs no download."""
    import transformers

    auto = getattr(transformers, auto_name, None)
    config_cls = getattr(getattr(transformers, preset_cls, None), "config_class", None)
    try:
        return auto._model_mapping[config_cls].__name__
    except (AttributeError, KeyError):
        raise RowSkip(f"{auto_name} has no model class for {preset_cls}'s config in this transformers") from None


def _input(text: str) -> str:
    t = text.strip().lower()
    if t in ("timm_default", "default", ""):
        return "default"
    if re.fullmatch(r"\d+(x\d+)*", t):
        return t
    m = re.match(r"seq\s*(?:<=|=)?\s*(\d+)", t)
    if m:
        return f"seq{m.group(1)}"
    m = re.fullmatch(r"[a-z_]+\s+(\d+(?:x\d+)+)", t)   # "input_features 80x3000"
    if m:
        return f"tensor:{m.group(1)}"
    raise RowSkip(f"input_shape {text!r} is not a fixed shape")


def _gpus(text: str, notes: str) -> tuple[int, str]:
    # torch.nn.DataParallel (one process, replicas scattered from GPU0) vs DistributedDataParallel
    dp = "dp" if re.search(r"(?<!Distributed)DataParallel", notes) else "ddp"
    t = text.strip()
    if not t:
        if re.search(r"\bDDP\b|multi-GPU|all GPUs", notes):
            return 2, dp   # count not recorded; per-GPU memory only depends on it being > 1
        return 1, dp
    return _int(t, "num_gpus"), dp


def _optimizer_args(text: str) -> dict:
    """optimizer_args as a dict ({} where it is empty or not a JSON object: the settings are then
    torch's defaults)."""
    try:
        args = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {}
    return args if isinstance(args, dict) else {}


def _flag(args: dict, key: str) -> bool:
    v = args.get(key, False)
    return bool(float(v)) if isinstance(v, (int, float)) else str(v).lower() in ("true", "1", "yes")


def _optimizer(name: str, args_text: str) -> str:
    args = _optimizer_args(args_text)
    low = name.lower()
    words = re.findall(r"[a-z]+", low)
    if "paged" in low:
        raise RowSkip(f"optimizer {name!r}: bitsandbytes' paged optimizers keep their states in CUDA unified "
                      "memory, which moves between host and GPU under memory pressure; not modelled")
    if re.search(r"8.?bit", low):
        if "adamw" in words or "adam" in words:
            return ("adamw" if "adamw" in words else "adam") + "-8bit"   # HF Trainer's adamw_bnb_8bit, AdamW8bit
        raise RowSkip(f"optimizer {name!r}: of bitsandbytes' 8-bit optimizers only Adam and AdamW are options")
    # the first optimizer the text names: "torch.optim.AdamW", "AdamW (HF Trainer default optim)",
    # "timm train.py default (SGD momentum 0.9, nesterov ...)", HF Trainer's "adamw_torch_fused"
    classes = sorted({cls for cls, _, _ in OPTIMIZER_TABLE.values() if ":" not in cls})   # torch.optim's
    names = {c.lower() for c in classes}
    n = next((w for w in words if w in names), "")

    def has_momentum():
        return float(args.get("momentum", 0) or 0) > 0

    if n in ("adam", "adamw"):
        return n + ("-amsgrad" if _flag(args, "amsgrad") else "")
    if n == "sgd":
        return "sgd-momentum" if has_momentum() else "sgd"
    if n == "rmsprop":
        momentum, centered = has_momentum(), _flag(args, "centered")
        if momentum and centered:
            raise RowSkip("RMSprop with both momentum and centered (three states per parameter) has no optimizer option")
        return "rmsprop-momentum" if momentum else "rmsprop-centered" if centered else "rmsprop"
    if n in OPTIMIZER_TABLE:
        return n
    raise RowSkip(f"optimizer {name!r} is not one of torch.optim's {', '.join(classes)}, or bitsandbytes' "
                  "8-bit Adam / AdamW")


def _optimizer_impl(name: str, args_text: str) -> str | None:
    """``fused`` where the row says so (HF Trainer's ``adamw_torch_fused``, ``{"fused": true}``),
    ``for-loop`` for ``{"foreach": false}``; None: PyTorch's default (foreach on a GPU)."""
    args = _optimizer_args(args_text)
    # "adamw_torch_fused", "fused=True"; not "foreach/fused depends on the version"
    if _flag(args, "fused") or re.search(r"_fused\b|\bfused\s*=\s*true", name.lower()):
        return "fused"
    if "foreach" in args and not _flag(args, "foreach"):
        return "for-loop"
    return None


def _precision(text: str) -> str:
    key = text.strip().split(" ", 1)[0].split("(", 1)[0].lower()
    if key not in _PRECISIONS:
        raise RowSkip(f"precision {text!r} is not one of {', '.join(_PRECISIONS)}")
    return _PRECISIONS[key]


def _loss(text: str) -> str:
    t = text.lower()
    if "dice" in t:
        return "mse"
    if "crossentropy" in t or re.search(r"\bce\b", t):
        return "cross-entropy"
    if re.search(r"mse|l1loss|huber|bce|kldiv", t):
        return "mse"   # a float target of the output's size, as MSE keeps
    return "auto"


def _int(text, column: str) -> int:
    try:
        return int(float(str(text).strip()))
    except ValueError:
        raise RowSkip(f"{column} {text!r} is not a number") from None


# ------------------------------------------------------------------ user factories for rows

def smp_model(arch: str = "Unet", encoder_name: str = "resnet34", in_channels: int = 3, classes: int = 1, **_):
    """segmentation_models_pytorch model with random weights (the CARMA UNet row)."""
    import segmentation_models_pytorch as smp

    return getattr(smp, arch)(encoder_name=encoder_name, encoder_weights=None, in_channels=in_channels, classes=classes)
