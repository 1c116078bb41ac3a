"""transformers presets: each builds the published model (its parameter count), and hub names find them."""

import pytest
import transformers  # noqa: F401  (the presets build transformers models)

from groundtruth import RowSkip, row_to_spec
from vest_slurm.estimate.models import HF_PRESETS, build_model, hf_preset
from vest_slurm.estimate.workload import parse_workload_args

# Published parameter counts (millions): model cards and papers. The tolerance (4%) absorbs how a
# card rounds and which head it counts (OpenAI's Whisper sizes, ALBERT's "11M"); a wrong width,
# depth, vocabulary or tying is off by far more.
PUBLISHED_M = {
    "bert-base": 110, "bert-base-uncased": 110, "bert-base-cased": 108, "bert-large": 335, "bert-large-uncased": 335,
    "bert-large-cased": 334, "distilbert-base-uncased": 67, "roberta-base": 125, "roberta-large": 355,
    "albert-base-v2": 11, "longformer-base-4096": 149, "bigbird-roberta-base": 128, "deberta-v3-base": 184,
    "gpt2": 124, "distilgpt2": 82, "gpt2-medium": 355, "gpt2-large": 774, "gpt2-xl": 1558,
    "opt-125m": 125, "opt-350m": 331, "opt-1.3b": 1316, "bart-base": 139, "bart-large": 406,
    "t5-small": 60.5, "t5-base": 223, "t5-large": 738, "flan-t5-small": 77.0, "flan-t5-base": 247.6,
    "flan-t5-large": 783.2, "xlnet-base-cased": 117, "xlnet-large-cased": 361,
    "whisper-tiny": 39, "whisper-base": 74, "whisper-small": 244, "whisper-medium": 769,
    "vit-base-patch16-224": 86.6, "llama-7b": 6738, "llama-2-7b": 6738, "llama-2-13b": 13016, "llama-3-8b": 8030,
    "llama-3.1-8b": 8030, "llama-1b": 1236, "llama-3.2-1b": 1236, "llama-3.2-3b": 3213, "mistral-7b": 7242,
    "qwen2.5-0.5b": 494, "qwen2.5-1.5b": 1544, "qwen2.5-7b": 7616,
}


def test_every_preset_has_a_published_count():
    assert set(HF_PRESETS) - {"tiny-llama"} <= set(PUBLISHED_M)


@pytest.mark.parametrize("name", sorted(PUBLISHED_M))
def test_preset_builds_the_published_model(name):
    module = build_model(parse_workload_args(["--model", f"hf:{name}", "--batch-size", "1"])).module
    n = sum(p.numel() for p in module.parameters()) / 1e6
    expected = PUBLISHED_M[name]
    if name.startswith("flan-t5") and module.config.tie_word_embeddings:
        # T5 v1.1 unties its output layer; transformers 5 ties it always (T5Config.__post_init__)
        expected -= module.config.vocab_size * module.config.d_model / 1e6
    assert abs(n - expected) <= 0.04 * expected, f"{name}: {n:.1f}M built, {expected:.1f}M published"


def test_hub_names_find_their_preset():
    assert hf_preset("meta-llama/Meta-Llama-3-8B") == "llama-3-8b"
    assert hf_preset("Qwen/Qwen2.5-7B-Instruct") == "qwen2.5-7b"
    assert hf_preset("openai/whisper-tiny") == "whisper-tiny"
    assert hf_preset("facebook/opt-1_3b") == "opt-1.3b"
    assert hf_preset("FacebookAI/roberta-base") == "roberta-base"
    assert hf_preset("meta-llama/Llama-2-7b-chat-hf") == "llama-7b"      # a tuning: its base architecture
    assert hf_preset("meta-llama/Llama-3.2-3B-Instruct") == "llama-3.2-3b"
    assert hf_preset("google/gemma-7b") is None


def _row(model_name, config):
    return {"id": "x", "gpu": "NVIDIA H100 80GB HBM3", "model_kind": "hf", "model_name": model_name,
            "model_args": '{"config": "AutoConfig %s"}' % config, "input_shape": "seq512", "batch_size": "4",
            "num_gpus": "1", "optimizer": "Adam", "optimizer_args": "{}", "loss": "", "precision": "fp32",
            "channels_last": "0", "notes": ""}


def test_ground_truth_rows_name_checkpoints_by_hub_name():
    s = row_to_spec(_row("OPTForCausalLM", "facebook/opt-350m"))
    assert s.model == "hf:opt-350m"
    s = row_to_spec(_row("LlamaForSequenceClassification", "meta-llama/Llama-2-7b-hf"))
    assert s.model == "hf:LlamaForSequenceClassification" and s.model_kwargs["intermediate_size"] == 11008
    # milabench names its models by Auto category: the class from_config builds
    assert row_to_spec(_row("AutoModelForCausalLM", "facebook/opt-350m")).model == "hf:opt-350m"
    s = row_to_spec(_row("AutoModelForSequenceClassification", "roberta-base"))
    assert s.model == "hf:RobertaForSequenceClassification" and s.model_kwargs["vocab_size"] == 50265
    with pytest.raises(RowSkip, match="no model class"):
        row_to_spec(_row("AutoModelForSpeechSeq2Seq", "roberta-base"))
    with pytest.raises(RowSkip, match="no preset"):
        row_to_spec(_row("GemmaForCausalLM", "google/gemma-7b"))


def test_a_local_config_folder_is_that_config_not_a_preset_of_its_name(tmp_path, monkeypatch):
    """hf:./DIR (a path written as one) with a config.json (a checkpoint's folder, a job's own tiny
    config) builds the class its "architectures" names from that config, even where the folder is
    named like a preset (a bare name is the preset, whatever lies on the disk: before, the only way
    to say the folder gave BERT-base's 108 M parameters for a 2-layer config); its trace is not
    cached (the key cannot see the file change). A config without a class is refused."""
    from vest_slurm.errors import WorkloadError
    from vest_slurm.estimate import tracecache

    monkeypatch.chdir(tmp_path)
    transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                            vocab_size=500, architectures=["BertForSequenceClassification"]).save_pretrained("bert-base-cased")
    spec = parse_workload_args(["--model", "hf:./bert-base-cased", "--batch-size", "2", "--input", "seq16"])
    built = build_model(spec)
    assert type(built.module).__name__ == "BertForSequenceClassification"
    assert sum(p.numel() for p in built.module.parameters()) < 200_000
    monkeypatch.setenv("VEST_CACHE_DIR", str(tmp_path / "cache"))
    assert tracecache.key(spec, (8, 0), 80 << 30) is None
    assert tracecache.key(spec.with_(model="hf:bert-base-uncased"), (8, 0), 80 << 30) is not None
    transformers.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2).save_pretrained("bare")
    with pytest.raises(WorkloadError, match="architectures"):
        build_model(parse_workload_args(["--model", "hf:./bare", "--batch-size", "2", "--input", "seq16"]))
    preset = build_model(parse_workload_args(["--model", "hf:bert-base-cased", "--batch-size", "2", "--input", "seq16"]))
    assert sum(p.numel() for p in preset.module.parameters()) > 100_000_000   # the bare name: the preset
