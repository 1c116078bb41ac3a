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

from .errors import WorkloadError
from .workload import InputSpec, WorkloadSpec

# transformers presets: the published configs of common checkpoints, written out so nothing is
# downloaded. Values from each model's config.json on the Hugging Face hub; fields left out are the
# config class's defaults, which those checkpoints keep (tests/test_hf_presets.py checks each preset's
# parameter count against the published one).
_BERT_LARGE = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096}
_ROBERTA = {"vocab_size": 50265, "max_position_embeddings": 514, "type_vocab_size": 1, "layer_norm_eps": 1e-5,
            "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
_T5 = {"d_kv": 64, "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}
_T5_V11 = {**_T5, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}   # Flan-T5, T5 v1.1


def _t5(d_model, d_ff, layers, heads, **kw):
    return ("T5ForConditionalGeneration", {"d_model": d_model, "d_ff": d_ff, "num_layers": layers,
                                           "num_decoder_layers": layers, "num_heads": heads, **kw})


def _whisper(d_model, layers, heads, **kw):
    return ("WhisperForConditionalGeneration", {"d_model": d_model, "encoder_layers": layers, "decoder_layers": layers,
                                                "encoder_attention_heads": heads, "decoder_attention_heads": heads,
                                                "encoder_ffn_dim": 4 * d_model, "decoder_ffn_dim": 4 * d_model, **kw})


def _decoder(cls, hidden, intermediate, layers, heads, kv_heads, vocab, **kw):
    return (cls, {"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
                  "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab, **kw})


HF_PRESETS: dict[str, tuple[str, dict]] = {
    "bert-base": ("BertForMaskedLM", {}),
    "bert-base-uncased": ("BertForMaskedLM", {}),
    "bert-base-cased": ("BertForMaskedLM", {"vocab_size": 28996}),
    "bert-large": ("BertForMaskedLM", dict(_BERT_LARGE)),
    "bert-large-cased": ("BertForMaskedLM", {**_BERT_LARGE, "vocab_size": 28996}),
    "distilbert-base-uncased": ("DistilBertForMaskedLM", {}),
    "roberta-base": ("RobertaForMaskedLM", dict(_ROBERTA)),
    "roberta-large": ("RobertaForMaskedLM", {**_ROBERTA, **_BERT_LARGE}),
    "albert-base-v2": ("AlbertForMaskedLM", {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072}),
    "longformer-base-4096": ("LongformerForMaskedLM", {**_ROBERTA, "max_position_embeddings": 4098, "attention_window": 512, "sep_token_id": 2}),
    "bigbird-roberta-base": ("BigBirdForMaskedLM", {}),
    "deberta-v3-base": ("DebertaV2ForMaskedLM", {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                                                 "intermediate_size": 3072, "vocab_size": 128100, "relative_attention": True, "max_relative_positions": -1, "position_buckets": 256,
                                                 "norm_rel_ebd": "layer_norm", "share_att_key": True, "pos_att_type": ["p2c", "c2p"],
                                                 "position_biased_input": False, "type_vocab_size": 0, "layer_norm_eps": 1e-7}),
    "gpt2": ("GPT2LMHeadModel", {}),
    "distilgpt2": ("GPT2LMHeadModel", {"n_layer": 6}),
    "gpt2-medium": ("GPT2LMHeadModel", {"n_embd": 1024, "n_layer": 24, "n_head": 16}),
    "gpt2-large": ("GPT2LMHeadModel", {"n_embd": 1280, "n_layer": 36, "n_head": 20}),
    "gpt2-xl": ("GPT2LMHeadModel", {"n_embd": 1600, "n_layer": 48, "n_head": 25}),
    "opt-125m": ("OPTForCausalLM", {}),
    "opt-350m": ("OPTForCausalLM", {"hidden_size": 1024, "num_hidden_layers": 24, "ffn_dim": 4096, "num_attention_heads": 16,
                                    "word_embed_proj_dim": 512, "do_layer_norm_before": False}),
    "opt-1.3b": ("OPTForCausalLM", {"hidden_size": 2048, "num_hidden_layers": 24, "ffn_dim": 8192, "num_attention_heads": 32}),
    "bart-base": ("BartForConditionalGeneration", {"d_model": 768, "encoder_layers": 6, "decoder_layers": 6, "encoder_attention_heads": 12,
                                                   "decoder_attention_heads": 12, "encoder_ffn_dim": 3072, "decoder_ffn_dim": 3072}),
    "bart-large": ("BartForConditionalGeneration", {}),
    "t5-small": _t5(512, 2048, 6, 8, **_T5),
    "t5-base": _t5(768, 3072, 12, 12, **_T5),
    "t5-large": _t5(1024, 4096, 24, 16, **_T5),
    "flan-t5-small": _t5(512, 1024, 8, 6, **_T5_V11),
    "flan-t5-base": _t5(768, 2048, 12, 12, **_T5_V11),
    "flan-t5-large": _t5(1024, 2816, 24, 16, **_T5_V11),
    "xlnet-base-cased": ("XLNetLMHeadModel", {"d_model": 768, "n_layer": 12, "n_head": 12, "d_inner": 3072}),
    "xlnet-large-cased": ("XLNetLMHeadModel", {"d_model": 1024, "n_layer": 24, "n_head": 16, "d_inner": 4096}),
    "whisper-tiny": _whisper(384, 4, 6),
    "whisper-base": _whisper(512, 6, 8),
    "whisper-small": _whisper(768, 12, 12),
    "whisper-medium": _whisper(1024, 24, 16),
    "vit-base-patch16-224": ("ViTForImageClassification", {"num_labels": 1000}),
    "llama-7b": _decoder("LlamaForCausalLM", 4096, 11008, 32, 32, 32, 32000, max_position_embeddings=4096),
    "llama-2-13b": _decoder("LlamaForCausalLM", 5120, 13824, 40, 40, 40, 32000, max_position_embeddings=4096),
    "llama-3-8b": _decoder("LlamaForCausalLM", 4096, 14336, 32, 32, 8, 128256, max_position_embeddings=8192),
    "llama-1b": _decoder("LlamaForCausalLM", 2048, 8192, 16, 32, 8, 128256, max_position_embeddings=4096, tie_word_embeddings=True),
    "llama-3.2-3b": _decoder("LlamaForCausalLM", 3072, 8192, 28, 24, 8, 128256, max_position_embeddings=131072, tie_word_embeddings=True),
    "tiny-llama": _decoder("LlamaForCausalLM", 256, 688, 4, 8, 4, 32000),
    "mistral-7b": _decoder("MistralForCausalLM", 4096, 14336, 32, 32, 8, 32000, max_position_embeddings=32768, sliding_window=4096),
    "qwen2.5-0.5b": _decoder("Qwen2ForCausalLM", 896, 4864, 24, 14, 2, 151936, max_position_embeddings=32768, tie_word_embeddings=True),
    "qwen2.5-1.5b": _decoder("Qwen2ForCausalLM", 1536, 8960, 28, 12, 2, 151936, max_position_embeddings=32768, tie_word_embeddings=True),
    "qwen2.5-7b": _decoder("Qwen2ForCausalLM", 3584, 18944, 28, 28, 4, 152064, max_position_embeddings=32768, tie_word_embeddings=False),
}

# Other names of the same architectures: hub names (the part after "org/", lower case) and
# releases that differ only in what moves no memory (context length, rope scaling, weights).
_PRESET_ALIASES = {
    "bert-large-uncased": "bert-large", "llama-2-7b": "llama-7b", "llama-2-7b-hf": "llama-7b",
    "llama-2-13b-hf": "llama-2-13b", "meta-llama-3-8b": "llama-3-8b", "llama-3.1-8b": "llama-3-8b",
    "meta-llama-3.1-8b": "llama-3-8b", "llama-3.2-1b": "llama-1b", "mistral-7b-v0.1": "mistral-7b",
    "opt-1_3b": "opt-1.3b", "t5-v1_1-base": "flan-t5-base", "t5-v1_1-large": "flan-t5-large",
}
_INSTRUCT_SUFFIXES = ("-instruct-v0.1", "-instruct", "-chat-hf", "-hf")


def hf_preset(name: str) -> str | None:
    """The preset a name or hub checkpoint ("org/name", any case; "-Instruct"/"-chat" tunings have
    their base model's architecture) stands for, or None."""
    key = name.rsplit("/", 1)[-1].strip().lower()
    for candidate in (key, *(key.removesuffix(s) for s in _INSTRUCT_SUFFIXES if key.endswith(s))):
        candidate = _PRESET_ALIASES.get(candidate, candidate)
        if candidate in HF_PRESETS:
            return candidate
    return None



MLP_LAYERS = {"Linear", "BatchNorm1d", "ReLU", "LeakyReLU", "PReLU", "ELU", "SELU", "Tanh", "Softplus",
              "SiLU", "Mish", "GELU", "Identity", "Dropout", "Softmax", "Sigmoid", "LayerNorm"}


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


def _hf(name: str, kwargs: dict, inp: InputSpec) -> BuiltModel:
    import transformers

    kwargs = {k: v for k, v in kwargs.items() if k not in ("from_config", "config")}
    # attention kernel: the job's transformers decides (e.g. T5 runs eagerly before transformers
    # PR #47014, 2026-07); default sdpa where the model supports it, as current transformers does
    attn = kwargs.pop("attn_implementation", None)
    preset_key = hf_preset(name)
    if preset_key is not None:
        cls_name, preset = HF_PRESETS[preset_key]
        kwargs = {**preset, **kwargs}
    else:
        cls_name = name
    cls = getattr(transformers, cls_name, None)
    if cls is None or not hasattr(cls, "config_class"):
        raise WorkloadError(f"unknown transformers model {name!r}",
                            f"use a model class (e.g. hf:BertForMaskedLM, hf:GPT2LMHeadModel) or a preset: {', '.join(sorted(HF_PRESETS))}")
    config_cls = cls.config_class
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
