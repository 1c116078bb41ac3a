"""Build the model a WorkloadSpec names, on the meta device (no memory, no time), and say how to feed it.

Families: ``torchvision:NAME``, ``timm:NAME`` (pretrained=False), ``hf:CLASS_OR_PRESET`` (from a
transformers config, never downloaded), ``mlp:[layers]`` (the nn.Sequential list of the ground-truth
README), and user code ``path/to/file.py:factory`` or ``package.module:factory``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import os
import sys
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import WorkloadError
from .presets import HF_PRESETS, MLP_LAYERS, hf_local_path, hf_preset
from .workload import InputSpec, WorkloadSpec

@dataclass
class BuiltModel:
    """A model on the meta device and how to feed it."""

    module: nn.Module
    family: str          # torchvision, timm, hf, mlp, user
    input: InputSpec     # resolved (no "default")
    hf_main_input: str = ""   # input_ids, input_features, pixel_values (hf only)
    hf_labels: str = ""   # tokens (one per input token), decoder (a decoder sequence), class (one per sample), none
    num_classes: int | None = None


def build_model(spec: WorkloadSpec, device: str = "meta") -> BuiltModel:
    """Build on the meta device. Constructors that compute with tensors and read the values back
    (torchvision's RegNet derives its widths that way) cannot run there: they are built again with
    host tensors for their arithmetic and each parameter moved to meta as it is registered.
    ``device``: build for real there instead (a GPU measurement), the model's own constructor
    initialising its parameters and buffers."""
    if device != "meta":
        with torch.device(device):
            built = _build(spec)
        if spec.gradient_checkpointing == "on":
            _enable_checkpointing(built, spec.model)
        return built
    try:
        with torch.device("meta"):
            built = _build(spec)
    except NotImplementedError as e:
        if "meta" not in str(e):
            raise WorkloadError(f"building {spec.model} failed: {e}", "check the model name and its arguments") from None
        with _weights_on_meta():
            built = _build(spec)
    if spec.gradient_checkpointing == "on":
        _enable_checkpointing(built, spec.model)
    return built


def _enable_checkpointing(built: BuiltModel, name: str) -> None:
    """The model's own activation checkpointing, as a training script turns it on: transformers'
    activation_checkpointing_enable (gradient_checkpointing_enable before 5.x; its default
    torch.utils.checkpoint arguments), timm's set_grad_checkpointing."""
    m = built.module
    if built.family == "hf":
        if not getattr(m, "supports_gradient_checkpointing", False):
            raise WorkloadError(f"{type(m).__name__} has no activation checkpointing in this transformers",
                                "drop --gradient-checkpointing")
        (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
        return
    if hasattr(m, "set_grad_checkpointing"):
        try:
            m.set_grad_checkpointing(True)
            return
        except (AssertionError, NotImplementedError):
            pass
    raise WorkloadError(f"{name} has no activation checkpointing switch (transformers and timm models have one)",
                        "drop --gradient-checkpointing, or estimate your own script that checkpoints "
                        "(vest estimate -- python train.py ...)")


_user_code = {"allowed": True}


def forbid_user_code() -> None:
    """From now on this process builds no model from user code (the bridge's directive worker:
    a second wall behind the allow-list that checked its directives)."""
    _user_code["allowed"] = False


def _build(spec: WorkloadSpec) -> BuiltModel:
    family, _, name = spec.model.partition(":")
    kwargs = spec.model_kwargs
    try:
        if family == "torchvision":
            return _torchvision(name, kwargs, spec.input)
        if family == "timm":
            return _timm(name, kwargs, spec.input)
        if family == "hf":
            return _hf(name, kwargs, spec.input)
        if family == "mlp":
            return _mlp(name, spec.input)
        if not _user_code["allowed"]:
            raise WorkloadError(f"model {spec.model!r} is user code, which this process never runs",
                                "name a torchvision, timm, transformers or mlp model")
        return _user(spec.model, kwargs, spec.input)
    except (WorkloadError, NotImplementedError):
        raise
    except TypeError as e:
        raise WorkloadError(f"model {spec.model!r} rejected its arguments {kwargs}: {e}",
                            "check --model-args / --model-arg names against the model's constructor") from None
    except (ValueError, RuntimeError, KeyError, AttributeError, AssertionError, ImportError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise WorkloadError(f"building {spec.model} failed: {type(e).__name__}: {msg}",
                            "check the model name and its arguments (--model-args)") from None


class _weights_on_meta:
    """Parameters and buffers go to the meta device as modules register them (the pattern of
    accelerate's init_empty_weights): host memory holds one layer's weights at a time."""

    def __enter__(self):
        self._reg_p, self._reg_b = nn.Module.register_parameter, nn.Module.register_buffer
        reg_p, reg_b = self._reg_p, self._reg_b

        def register_parameter(module, name, param):
            if param is not None and param.device.type != "meta":
                param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            reg_p(module, name, param)

        def register_buffer(module, name, tensor, persistent=True):
            if tensor is not None and tensor.device.type != "meta":
                tensor = tensor.to("meta")
            reg_b(module, name, tensor, persistent)

        nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer
        return self

    def __exit__(self, *exc):
        nn.Module.register_parameter, nn.Module.register_buffer = self._reg_p, self._reg_b
        return False


def _require_input(inp: InputSpec, model: str, example: str) -> InputSpec:
    if inp.kind == "default":
        raise WorkloadError(f"model {model!r} has no default input size", f"give --input, e.g. --input {example}")
    return inp


def _torchvision(name: str, kwargs: dict, inp: InputSpec) -> BuiltModel:
    import torchvision

    try:
        builder = torchvision.models.get_model_builder(name)
    except ValueError:
        available = sorted(torchvision.models.list_models())
        close = [m for m in available if name.lower()[:4] in m][:8]
        raise WorkloadError(f"unknown torchvision model {name!r}",
                            f"use one of torchvision.models.list_models(), e.g. {', '.join(close or available[:8])}") from None
    if name in torchvision.models.list_models(module=torchvision.models.detection):
        # In training mode these take a list of images and of target dicts (boxes, labels, masks)
        # and return a dict of losses; how much they allocate follows the number of proposals and
        # boxes after NMS, which only the data decides. Not traced: say so instead of guessing.
        raise WorkloadError(f"torchvision detection model {name!r} is not supported: its memory depends on "
                            "the boxes and proposals of each image, which a trace without data cannot know",
                            "measure it with scripts/measure_gpu.py on a GPU, or estimate its backbone "
                            "(e.g. torchvision:resnet50 at the training image size) as a lower bound")
    # Random weights, and no pretrained backbone either: segmentation builders default to
    # downloading ImageNet backbone weights (weights_backbone). Values never change the memory.
    kwargs = {k: v for k, v in kwargs.items() if k not in ("weights", "weights_backbone")}
    if "weights_backbone" in inspect.signature(builder).parameters:
        kwargs["weights_backbone"] = None
    module = builder(weights=None, **kwargs)
    if inp.kind == "default":
        inp = InputSpec("image", (3, 299, 299) if name == "inception_v3" else (3, 224, 224))
    return BuiltModel(module, "torchvision", inp, num_classes=kwargs.get("num_classes", 1000))


def _timm(name: str, kwargs: dict, inp: InputSpec) -> BuiltModel:
    import timm

    if not timm.is_model(name):
        close = timm.list_models(f"*{name[:5]}*")[:8]
        raise WorkloadError(f"unknown timm model {name!r}", f"use a name from timm.list_models(), e.g. {', '.join(close) or 'resnet50'}")
    kwargs = dict(kwargs)
    kwargs.pop("pretrained", None)
    module = timm.create_model(name, pretrained=False, **kwargs)
    if inp.kind == "default":
        inp = InputSpec("image", tuple(module.pretrained_cfg.get("input_size", (3, 224, 224))))
    return BuiltModel(module, "timm", inp, num_classes=getattr(module, "num_classes", None))


def _skip_value_checks(module) -> None:
    """transformers 4.x looks into the input ids for the pad token (a value on the device), only
    to warn that no attention mask was given; the step's memory does not depend on it, and a
    traced tensor has no values to look at."""
    for m in module.modules():
        if hasattr(m, "warn_if_padding_and_no_attention_mask"):
            m.warn_if_padding_and_no_attention_mask = lambda *args, **kwargs: None


def _local_config(name: str):
    """(model class name, config) of ``hf:./DIR`` (a path written as one: presets.hf_local_path) that
    holds a config.json, read offline: its ``architectures`` names the class. None for any other
    name: a class, a preset or a hub name means the built-in one, whatever lies on the disk under
    that name (a #VEST line's model is never read from disk: allowlist.check_model refuses paths)."""
    import os

    if not hf_local_path(name):
        return None
    name = os.path.expanduser(name)
    if not os.path.isfile(os.path.join(name, "config.json")):
        raise WorkloadError(f"hf:{name}: no config.json in that folder", "give the folder of a transformers config")
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise WorkloadError(f"{name}/config.json: transformers cannot read it: {str(e).splitlines()[0]}",
                            "give a config.json that transformers' AutoConfig reads") from None
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise WorkloadError(f"{name}/config.json names no model class (no \"architectures\")",
                            f"add \"architectures\": [\"{type(config).__name__.replace('Config', 'ForCausalLM')}\"] "
                            "(or the class the job trains) to it")
    return archs[0], config


def _hf(name: str, kwargs: dict, inp: InputSpec) -> BuiltModel:
    import transformers

    kwargs = {k: v for k, v in kwargs.items() if k not in ("from_config", "config")}
    # attention kernel: the job's transformers decides (e.g. T5 runs eagerly before transformers
    # PR #47014, 2026-07); default sdpa where the model supports it, as current transformers does
    attn = kwargs.pop("attn_implementation", None)
    local = _local_config(name)
    if local is not None:   # a folder with a config.json (a checkpoint's, a job's own): that config
        cls_name, config = local
        for k, v in kwargs.items():
            setattr(config, k, v)
    else:
        preset_key = hf_preset(name)
        if preset_key is not None:
            cls_name, preset = HF_PRESETS[preset_key]
            kwargs = {**preset, **kwargs}
        else:
            cls_name = name
    cls = getattr(transformers, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) and hasattr(cls, "config_class")):
        raise WorkloadError(f"unknown transformers model {name!r}",
                            f"use a model class (e.g. hf:BertForMaskedLM, hf:GPT2LMHeadModel) or a preset: {', '.join(sorted(HF_PRESETS))}")
    config_cls = cls.config_class
    if local is None:
        try:
            config = config_cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise WorkloadError(f"{config_cls.__name__} rejected {kwargs}: {e}", "check the config field names") from None
    unknown = [k for k in kwargs if not hasattr(config, k)]
    if unknown:
        raise WorkloadError(f"{config_cls.__name__} has no field(s) {', '.join(unknown)}",
                            f"use fields of {config_cls.__name__} (see its documentation)")
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        # The decoder's inputs are the labels shifted right behind this token; a bare config
        # (T5Config()) leaves it unset, every published checkpoint sets it (T5: the pad token, 0).
        # Which token it is changes no memory.
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    if cls_name.endswith("ForSequenceClassification") and getattr(config, "pad_token_id", None) is None:
        # A decoder classifying sequences pools at each row's last non-pad token and refuses a
        # batch without a pad token; fine-tuning configs set one (GPT-2, Llama: their end-of-text
        # token). Which token it is changes no memory.
        eos = getattr(config, "eos_token_id", None)
        config.pad_token_id = (eos[0] if isinstance(eos, (list, tuple)) and eos else eos) or 0
    # Attention as a GPU run picks it: sdpa where the model supports it, else eager. A refused
    # attempt leaves its choice in the config, hence a fresh copy for each.
    import copy

    if attn is not None:
        if attn not in ("eager", "sdpa"):
            raise WorkloadError(f"attn_implementation {attn!r} is not one vest can trace", "use eager or sdpa")
        module = cls._from_config(copy.deepcopy(config), attn_implementation=attn)
    else:
        try:
            module = cls._from_config(copy.deepcopy(config), attn_implementation="sdpa")
        except (ValueError, ImportError):
            module = cls._from_config(copy.deepcopy(config), attn_implementation="eager")
    _skip_value_checks(module)
    main = getattr(cls, "main_input_name", "input_ids")
    if inp.kind == "default":
        if main == "input_features":
            inp = InputSpec("tensor", (getattr(config, "num_mel_bins", 80), 2 * getattr(config, "max_source_positions", 1500)))
        elif main == "pixel_values":
            size = getattr(config, "image_size", 224)
            inp = InputSpec("image", (getattr(config, "num_channels", 3), size, size))
        else:
            n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 512
            inp = InputSpec("tokens", (min(int(n), 2048),))
    if main == "input_ids" and inp.kind != "tokens":
        raise WorkloadError(f"{cls_name} reads token ids, but the input is {inp}", "give --input seqN, e.g. --input seq512")
    if "Classification" in cls_name:
        labels = "class"
    elif bool(getattr(config, "is_encoder_decoder", False)) and main != "input_ids":
        labels = "decoder"
    else:
        labels = "tokens" if main == "input_ids" else "none"
    return BuiltModel(module, "hf", inp, hf_main_input=main, hf_labels=labels)


def _mlp(text: str, inp: InputSpec) -> BuiltModel:
    try:
        layers = json.loads(text)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"mlp layer list is not valid JSON: {e}", 'e.g. mlp:[["Linear",784,256],["ReLU"],["Linear",256,10]]') from None
    if isinstance(layers, dict):
        layers = layers.get("sequential", [])
    if not isinstance(layers, list) or not layers:
        raise WorkloadError("mlp: expects a non-empty JSON list of layers", 'e.g. mlp:[["Linear",784,10]]')
    mods = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, list) or not layer or layer[0] not in MLP_LAYERS:
            raise WorkloadError(f"mlp layer {i} {layer!r} is not one of {', '.join(sorted(MLP_LAYERS))}",
                                'write each layer as ["Name", args...]')
        mods.append(getattr(nn, layer[0])(*layer[1:]))
    linears = [m for m in mods if isinstance(m, nn.Linear)]
    if len(inp.shape) > 1 and linears and math.prod(inp.shape) == linears[0].in_features:
        # an image or tensor per sample into a first Linear of its size: the forward flattens it
        # (x.view(B, -1), a view, no copy), as an MLP training script does
        mods.insert(0, nn.Flatten())
    module = nn.Sequential(*mods)
    if inp.kind == "default":
        if not linears:
            raise WorkloadError("mlp without a Linear layer needs --input", "give --input N (features)")
        inp = InputSpec("tensor", (linears[0].in_features,))
    return BuiltModel(module, "mlp", inp, num_classes=linears[-1].out_features if linears else None)


def _user(target: str, kwargs: dict, inp: InputSpec) -> BuiltModel:
    where, _, fn_name = target.rpartition(":")
    try:
        if where.endswith(".py") or os.sep in where:
            path = os.path.abspath(where)
            if not os.path.isfile(path):
                raise WorkloadError(f"model file {where!r} does not exist", "give the path of a Python file and a factory: path/to/model.py:build")
            mod_name = f"_vest_user_{abs(hash(path))}"
            spec_ = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(spec_)
            sys.modules[mod_name] = module
            spec_.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except WorkloadError:
        raise
    except Exception as e:  # user code: any failure is the user's to fix, report it plainly
        raise WorkloadError(f"importing {where!r} failed: {type(e).__name__}: {e}", "fix the module so that it imports, or check the path") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise WorkloadError(f"{where!r} has no callable {fn_name!r}", f"define def {fn_name}(**kwargs) returning an nn.Module")
    try:
        model = fn(**kwargs)
    except Exception as e:
        raise WorkloadError(f"model factory {target} raised {type(e).__name__}: {e}", "fix the factory; it is called on the meta device, with no data") from None
    if not isinstance(model, nn.Module):
        raise WorkloadError(f"model factory {target} returned {type(model).__name__}, not an nn.Module", "return the model (an nn.Module)")
    if inp.kind == "default":
        raise WorkloadError(f"user model {target} needs an input shape", "give --input, e.g. --input 3x224x224 or tensor:16x80")
    return BuiltModel(model, "user", inp)
