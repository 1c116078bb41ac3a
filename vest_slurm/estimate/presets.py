"""Models named by a workload that need no code to describe: transformers presets and MLP layer names.

A plain data module (no torch import), so the bridge's allow-list (allowlist.py) can check a model
name without importing a model library; models.py builds them.
"""

from __future__ import annotations

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


def hf_local_path(name: str) -> bool:
    """Whether ``hf:NAME`` is a folder written as a path (``./DIR``, ``/abs/DIR``, ``~/DIR``): its
    config.json is read (models._local_config). Any other name is a class, a preset or a hub name,
    the built-in one whatever lies on the disk under it."""
    return name.startswith(("/", "./", "../", "~"))


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
