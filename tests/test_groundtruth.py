"""row_to_spec: ground-truth rows (real rows of shared/groundtruth/{carma,milabench}.csv) as WorkloadSpecs."""

from __future__ import annotations

import csv
import io
import json
import os

import pytest

from groundtruth import RowSkip, is_amd, row_to_argv, row_to_spec
from vest_slurm.estimate.workload import InputSpec, parse_workload_args

# Verbatim rows of both files (columns the mapping reads; notes kept: DataParallel / DDP / global
# batch are stated there).
SAMPLE = r"""id,source,gpu,gpu_total_mib,model_kind,model_name,model_args,input_shape,batch_size,num_gpus,optimizer,optimizer_args,loss,precision,channels_last,measured_peak_mib,confidence,notes
carma-bert_base-32,CARMA,NVIDIA A100-SXM4-40GB,40960,hf,BertForMaskedLM,"{""from_config"":true,""vocab_size"":28996,""hidden_size"":768,""num_hidden_layers"":12,""num_attention_heads"":12,""intermediate_size"":3072,""max_position_embeddings"":512,""type_vocab_size"":2,""hidden_act"":""gelu""}",seq512,32,1,AdamW,"{""lr"":0.0001,""weight_decay"":0.01,""impl"":""torch.optim.AdamW defaults""}",MLM CE (DataCollatorForLanguageModeling mlm_probability 0.15; labels -100 elsewhere),fp32,0,19828.0,high,"WikiText-2 train, bert-large-cased tokenizer padding=max_length 512 (every batch 512 tokens, attention_mask passed); model from scratch; one extra forward on a random 32x512 batch + modelsummary before training; 1 epoch; CUDA_VISIBLE_DEVICES=0"
carma-cifar-efficientNet_cifar100-32,CARMA,NVIDIA A100-SXM4-40GB,40960,timm,efficientnet_b0,"{""pretrained"":false,""num_classes"":100}",3x32x32,32,1,AdamW,"{""lr"":0.001,""weight_decay"":0.0001,""betas"":[0.9,0.999]}",CrossEntropyLoss,fp32,0,666.0,high,"CIFAR-100 32x32, RandomCrop(32,pad 4)+HFlip, DataLoader num_workers=4; timm.create_model(pretrained=False, num_classes=100); CosineAnnealingLR; FakeTensor pass + torchsummary before training; 1 epoch + test pass"
carma-gpt2_large-8,CARMA,NVIDIA A100-SXM4-40GB,40960,hf,GPT2LMHeadModel,"{""from_config"":true,""vocab_size"":50257,""n_positions"":1024,""n_embd"":1280,""n_layer"":36,""n_head"":20,""activation_function"":""gelu_new""}",seq512,8,2,AdamW,"{""lr"":0.0001,""weight_decay"":0.01}","causal LM CE (labels=input_ids, pad=eos not masked)",fp32,0,28356.0,low,"torch.nn.DataParallel over GPUs 0,1; batch_size = global 8 (4 per replica); value is GPU0 only, which holds master params, all grads (reduced), AdamW state and gathered 8x512x50257 fp32 logits -> asymmetric, not per-replica DDP memory"
carma-imnet-inception_v3-32,CARMA,NVIDIA A100-SXM4-40GB,40960,torchvision,inception_v3,"{""weights"":null,""aux_logits"":false,""num_classes"":1000}",3x299x299,32,1,Adam,"{""lr"":0.001,""betas"":[0.9,0.999],""weight_decay"":0}",CrossEntropyLoss,fp32,0,5230.0,high,"CARMA workloads/Inception.py --batch_size 32 --num_epochs 1; ImageNet ImageFolder (Resize+CenterCrop, no augmentation), DataLoader num_workers=4, shuffle; 1 epoch then a no_grad validation pass; before training: FakeTensor estimate pass (timed) + torchsummary (batch 2)"
carma-imnet-xception-32,CARMA,NVIDIA A100-SXM4-40GB,40960,timm,xception,"{""pretrained"":false,""num_classes"":1000,""note"":""timm name 'xception' (= legacy_xception in timm>=0.9)""}",3x224x224,32,1,Adam,"{""lr"":0.001,""betas"":[0.9,0.999],""weight_decay"":0}",CrossEntropyLoss,fp32,0,5918.0,high,"CARMA workloads/Xception.py --batch_size 32 --num_epochs 1; ImageNet ImageFolder (Resize+CenterCrop, no augmentation), DataLoader num_workers=4, shuffle; 1 epoch then a no_grad validation pass; before training: FakeTensor estimate pass (timed) + torchsummary (batch 2)"
carma-xlnet_base-8,CARMA,NVIDIA A100-SXM4-40GB,40960,hf,XLNetForSequenceClassification,"{""pretrained"":""xlnet-base-cased"",""num_labels"":2}",seq<=512 dynamic padding,8,2,AdamW (HF Trainer default optim; foreach/fused depends on transformers version),"{""lr"":5e-05,""weight_decay"":0.0,""betas"":[0.9,0.999],""eps"":1e-08}",seq-classification CE (all labels 1),fp32,0,9192.0,low,"HF Trainer, 2 visible GPUs -> DataParallel (global batch = 2 x per_device); batch_size column = per_device; DataCollatorWithPadding on WikiText-2 lines (most short) so sequence length varies; a full-length random forward before training may set the peak; GPU0 value; epochs 8 (base) / 3 (large)"
carma-unet-8,CARMA,NVIDIA A100-SXM4-40GB,40960,other,"smp.Unet(encoder_name='resnet34', in_channels=3, classes=21)","{""library"":""segmentation_models_pytorch"",""encoder_name"":""resnet34"",""encoder_weights"":""imagenet (smp default)"",""classes"":21}",3x512x512,8,1,AdamW,"{""lr"":0.001,""weight_decay"":0.01}",smp DiceLoss(mode='multiclass'),fp32,0,9910.0,medium,"Pascal VOC 2012 seg, resized 512x512, num_workers 8, pin_memory; launched without --amp -> fp32 (GradScaler/autocast disabled); epochs default 90 (run took 5 min -> probably ended early or small epochs); FakeTensor pass before training"
carma-maskrcnn-8,CARMA,NVIDIA A100-SXM4-40GB,40960,torchvision,maskrcnn_resnet50_fpn,"{""weights"":null,""num_classes"":91}","variable COCO (min_size 800, max_size 1333)",8,1,SGD,"{""lr"":0.02,""momentum"":0.9,""weight_decay"":0.0001,""note"":""torchvision references/detection defaults (not read)""}",Mask R-CNN multi-task,fp32,0,28606.0,low,torchvision references/detection/train.py --dataset coco -b 8 --epochs 1 on 1 GPU; variable image sizes; summary 'execution time' 1.66 s is a parse artefact (README: 112 min)
mila-H100-bert-fp16-1-0,milabench,NVIDIA H100 80GB HBM3,81559,hf,BertForMaskedLM,"{""config"":""BertConfig() defaults (bert-base: vocab 30522, 768x12, 12 heads, 3072)""}",seq512,1,1,Adam,"{""lr"":0.001,""betas"":[0.9,0.999],""weight_decay"":0}",MLM CE on all 512 positions (labels = random token ids; no -100),amp_fp16,0,3885.0,high,"benchmarks/huggingface: transformers.<Category>.from_config(config) (random init); torch.optim.Adam(lr=1e-3) (no weight decay, default foreach); synthetic data: a fixed set of `bs` random samples repeated via DataLoader (CPU -> GPU each step); autocast(fp16)+GradScaler only if 'fp16' in precision; tf32 iff 'tf32' in precision; loss = outputs.loss; batch = {input_ids:[bs,512], labels:[bs,512]} (no attention_mask); milabench bench 'bert-fp16', cpu=8.0, perf=27.57 items/s"
mila-H100-convnext_large-fp32-1-67,milabench,NVIDIA H100 80GB HBM3,81559,torchvision,convnext_large,"{""weights"":null}",3x224x224,1,1,SGD,"{""lr"":0.01,""momentum"":0}",CrossEntropyLoss,fp32,0,3177.0,high,"benchmarks/torchvision/main.py: model = torchvision.models.<name>() (random init); model.train(); optimizer torch.optim.SGD(params, lr) with NO momentum/weight decay (no optimizer state); CrossEntropyLoss; every step runs inside accelerator.amp.autocast(dtype=float_dtype(precision)) and GradScaler(enabled = 'fp16' in precision); input tensor cast to that dtype; tf32 enabled iff 'tf32' in precision; loader 'pytorch' = ImageFolder(FakeImageNet) RandomResizedCrop(224)+HFlip, pin_memory, num_workers<=8; autocast(dtype=float32) is a no-op on CUDA (warns and disables) -> plain fp32 memory; milabench bench 'convnext_large-fp32', cpu=8.0, perf=24.92 items/s"
mila-H100-focalnet-1-149,milabench,NVIDIA H100 80GB HBM3,81559,timm,focalnet_base_lrf,"{""pretrained"":false}",3x224x224,1,1,"timm train.py default (SGD momentum 0.9, nesterov, wd 2e-5 - from timm defaults, not re-read)","{""momentum"":0.9,""weight_decay"":2e-05,""guess"":true}",timm train.py default (mixup off -> CE / label smoothing 0.1 default),amp_bf16,0,3911.0,medium,"benchmarks/timm: pytorch-image-models train.py at commit cb0e4391 launched via torchrun (1 process); --amp --amp-dtype bfloat16; FakeImageNet; --val-split; timm train.py defaults for optimizer/aug not re-verified; milabench bench 'focalnet', cpu=8.0, perf=14.15 items/s"
mila-H100-lightning-1-164,milabench,NVIDIA H100 80GB HBM3,81559,torchvision,resnet152,"{""weights"":null}",3x224x224,1,1,Adam,"{""lr"":0.001}",CrossEntropyLoss,amp_bf16 (Lightning precision='bf16-mixed'),0,2555.0,medium,"benchmarks/lightning/main.py (version at 2025-03): Lightning Trainer(devices=n, strategy='auto', precision='bf16-mixed'), Adam lr 1e-3; pytorch loader RandomResizedCrop 224; Lightning overhead; milabench bench 'lightning', cpu=8.0, perf=16.53 items/s"
mila-H100-lightning-gpus-1-179,milabench,NVIDIA H100 80GB HBM3,81559,torchvision,resnet152,"{""weights"":null}",3x224x224,1,,Adam,"{""lr"":0.001}",CrossEntropyLoss,amp_bf16 (Lightning precision='bf16-mixed'),0,4332.0,low,"multi-GPU Lightning DDP (strategy auto) over all GPUs of the node (count not recorded); per-device value; batch_size = per device; milabench bench 'lightning-gpus', cpu=8.0, perf=54.26 items/s"
mila-H100-reformer-1-247,milabench,NVIDIA H100 80GB HBM3,81559,hf,ReformerForMaskedLM,"{""config"":""ReformerConfig() defaults (num_buckets set to 128 if unset)""}",seq4096,1,1,Adam,"{""lr"":0.001}",MLM CE on all positions,amp_fp16+tf32,0,1767.0,medium,"benchmarks/huggingface: transformers.<Category>.from_config(config) (random init); torch.optim.Adam(lr=1e-3) (no weight decay, default foreach); synthetic data: a fixed set of `bs` random samples repeated via DataLoader (CPU -> GPU each step); autocast(fp16)+GradScaler only if 'fp16' in precision; tf32 iff 'tf32' in precision; loss = outputs.loss; ReformerConfig defaults include LSH/local attention and axial pos-emb (64,64); milabench bench 'reformer', cpu=8.0, perf=16.78 items/s"
mila-H100-regnet_y_128gf-1-261,milabench,NVIDIA H100 80GB HBM3,81559,torchvision,regnet_y_128gf,"{""weights"":null}",3x224x224,1,1,SGD,"{""lr"":0.01,""momentum"":0}",CrossEntropyLoss,amp_fp16+tf32,0,8051.0,high,"benchmarks/torchvision/main.py: model = torchvision.models.<name>() (random init); model.train(); optimizer torch.optim.SGD(params, lr) with NO momentum/weight decay (no optimizer state); CrossEntropyLoss; every step runs inside accelerator.amp.autocast(dtype=float_dtype(precision)) and GradScaler(enabled = 'fp16' in precision); input tensor cast to that dtype; tf32 enabled iff 'tf32' in precision; loader 'pytorch' = ImageFolder(FakeImageNet) RandomResizedCrop(224)+HFlip, pin_memory, num_workers<=8; milabench bench 'regnet_y_128gf', cpu=8.0, perf=16.17 items/s"
mila-H100-resnet152-ddp-gpus-1-278,milabench,NVIDIA H100 80GB HBM3,81559,torchvision,resnet152,"{""weights"":null}",3x224x224,1,,SGD,"{""lr"":0.001,""momentum"":0}",CrossEntropyLoss,amp_bf16,0,3513.0,low,"benchmarks/torchvision_ddp/main.py: DDP(device_ids=[rank]) one process per GPU over all GPUs of the node (count not recorded; DDP adds ~1x param-size gradient buckets), autocast bf16, SGD lr 1e-3 no momentum, DistributedSampler ImageFolder RandomResizedCrop 224; per-device value; batch_size = per device; milabench bench 'resnet152-ddp-gpus', cpu=8.0, perf=64.27 items/s"
mila-H100-resnet50-1-296,milabench,NVIDIA H100 80GB HBM3,81559,torchvision,resnet50,"{""weights"":null}",3x224x224,1,1,SGD,"{""lr"":0.01,""momentum"":0}",CrossEntropyLoss,amp_fp16+tf32,1,1607.0,high,"benchmarks/torchvision/main.py: model = torchvision.models.<name>() (random init); model.train(); optimizer torch.optim.SGD(params, lr) with NO momentum/weight decay (no optimizer state); CrossEntropyLoss; every step runs inside accelerator.amp.autocast(dtype=float_dtype(precision)) and GradScaler(enabled = 'fp16' in precision); input tensor cast to that dtype; tf32 enabled iff 'tf32' in precision; loader 'pytorch' = ImageFolder(FakeImageNet) RandomResizedCrop(224)+HFlip, pin_memory, num_workers<=8; --optim channel_last: model and inputs converted to channels_last; milabench bench 'resnet50', cpu=8.0, perf=29.63 items/s"
mila-H100-resnet50-noio-1-311,milabench,NVIDIA H100 80GB HBM3,81559,torchvision,resnet50,"{""weights"":null}",3x244x244,1,1,SGD,"{""lr"":0.01,""momentum"":0}",CrossEntropyLoss,amp_fp16+tf32,1,1611.0,medium,"benchmarks/torchvision/main.py: model = torchvision.models.<name>() (random init); model.train(); optimizer torch.optim.SGD(params, lr) with NO momentum/weight decay (no optimizer state); CrossEntropyLoss; every step runs inside accelerator.amp.autocast(dtype=float_dtype(precision)) and GradScaler(enabled = 'fp16' in precision); input tensor cast to that dtype; tf32 enabled iff 'tf32' in precision; loader 'pytorch' = ImageFolder(FakeImageNet) RandomResizedCrop(224)+HFlip, pin_memory, num_workers<=8; --optim channel_last: model and inputs converted to channels_last; loader synthetic_fixed: ONE fixed batch of randn(bs,3,244,244) (sic, 244) resident on GPU, target = rand_like(logits) float [bs,1000] (soft-label CE); building it runs one fp32 forward of the full batch with autograd enabled -> that fp32 forward may be the peak; milabench bench 'resnet50-noio', cpu=8.0, perf=30.61 items/s"
mila-H100-t5-1-344,milabench,NVIDIA H100 80GB HBM3,81559,hf,T5ForConditionalGeneration,"{""config"":""AutoConfig t5-small""}",seq1024 (enc) / 1024 labels,1,1,Adam,"{""lr"":0.001}","seq2seq CE (labels random ids, len 1024)",amp_fp16+tf32,0,4201.0,high,"benchmarks/huggingface: transformers.<Category>.from_config(config) (random init); torch.optim.Adam(lr=1e-3) (no weight decay, default foreach); synthetic data: a fixed set of `bs` random samples repeated via DataLoader (CPU -> GPU each step); autocast(fp16)+GradScaler only if 'fp16' in precision; tf32 iff 'tf32' in precision; loss = outputs.loss; milabench bench 't5', cpu=8.0, perf=16.77 items/s"
mila-H100-whisper-1-379,milabench,NVIDIA H100 80GB HBM3,81559,hf,WhisperForAudioClassification,"{""config"":""AutoConfig openai/whisper-tiny""}",input_features 80x3000,1,1,Adam,"{""lr"":0.001}",classification CE,amp_fp16+tf32,0,1525.0,medium,"benchmarks/huggingface: transformers.<Category>.from_config(config) (random init); torch.optim.Adam(lr=1e-3) (no weight decay, default foreach); synthetic data: a fixed set of `bs` random samples repeated via DataLoader (CPU -> GPU each step); autocast(fp16)+GradScaler only if 'fp16' in precision; tf32 iff 'tf32' in precision; loss = outputs.loss; features from WhisperFeatureExtractor on 10000 random samples (padded to 30 s -> 80x3000); milabench bench 'whisper', cpu=8.0, perf=65.45 items/s"
mila-MI325-bert-fp16-16-765,milabench,AMD Instinct MI325X,262144,hf,BertForMaskedLM,"{""config"":""BertConfig() defaults (bert-base: vocab 30522, 768x12, 12 heads, 3072)""}",seq512,16,1,Adam,"{""lr"":0.001,""betas"":[0.9,0.999],""weight_decay"":0}",MLM CE on all 512 positions (labels = random token ids; no -100),amp_fp16,0,11177.0,medium,"AMD ROCm (HIP reported as 'cuda'; fp16 path; rocm-smi/amdsmi used-VRAM); benchmarks/huggingface: transformers.<Category>.from_config(config) (random init); torch.optim.Adam(lr=1e-3) (no weight decay, default foreach); synthetic data: a fixed set of `bs` random samples repeated via DataLoader (CPU -> GPU each step); autocast(fp16)+GradScaler only if 'fp16' in precision; tf32 iff 'tf32' in precision; loss = outputs.loss; batch = {input_ids:[bs,512], labels:[bs,512]} (no attention_mask); milabench bench 'bert-fp16', cpu=1.0, perf=248.1 items/s"
"""

ROWS = {r["id"]: r for r in csv.DictReader(io.StringIO(SAMPLE))}
GROUNDTRUTH = os.environ.get("VEST_GROUNDTRUTH", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "groundtruth"))


def spec(row_id):
    return row_to_spec(ROWS[row_id])


def test_carma_bert_from_config_passes_config_fields():
    s = spec("carma-bert_base-32")
    assert s.model == "hf:BertForMaskedLM"
    assert s.model_kwargs == {"vocab_size": 28996, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                              "intermediate_size": 3072, "max_position_embeddings": 512, "type_vocab_size": 2,
                              "hidden_act": "gelu"}
    assert (s.input, s.batch_size, s.optimizer, s.precision, s.loss) == (InputSpec("tokens", (512,)), 32, "adamw", "fp32", "model")
    assert s.num_gpus == 1


def test_milabench_bert_class_defaults_and_amp():
    s = spec("mila-H100-bert-fp16-1-0")
    assert s.model == "hf:BertForMaskedLM" and s.model_args == ()
    assert (s.optimizer, s.precision, s.loss, s.batch_size) == ("adam", "amp-fp16", "model", 1)


def test_timm_cifar_drops_pretrained_keeps_num_classes():
    s = spec("carma-cifar-efficientNet_cifar100-32")
    assert s.model == "timm:efficientnet_b0" and s.model_kwargs == {"num_classes": 100}
    assert s.input == InputSpec("image", (3, 32, 32)) and s.optimizer == "adamw" and s.loss == "cross-entropy"


def test_timm_note_is_not_a_constructor_argument():
    assert spec("carma-imnet-xception-32").model_kwargs == {"num_classes": 1000}


def test_torchvision_weights_dropped_constructor_args_kept():
    s = spec("carma-imnet-inception_v3-32")
    assert s.model == "torchvision:inception_v3"
    assert s.model_kwargs == {"aux_logits": False, "num_classes": 1000}
    assert s.input == InputSpec("image", (3, 299, 299)) and s.optimizer == "adam"
    s = spec("mila-H100-convnext_large-fp32-1-67")
    assert (s.model, s.model_args, s.optimizer, s.precision) == ("torchvision:convnext_large", (), "sgd", "fp32")


def test_milabench_fp32_turns_cudnn_tf32_off_tf32_rows_keep_it():
    assert spec("mila-H100-convnext_large-fp32-1-67").cudnn_tf32 == "off"
    assert spec("mila-H100-regnet_y_128gf-1-261").cudnn_tf32 == "on"      # amp_fp16+tf32
    assert spec("carma-imnet-inception_v3-32").cudnn_tf32 == "on"         # CARMA: PyTorch's default


def test_timm_train_py_rows_run_cudnn_benchmark_mode():
    assert spec("mila-H100-focalnet-1-149").cudnn_benchmark == "on"     # timm's train.py sets it at import
    assert spec("mila-H100-convnext_large-fp32-1-67").cudnn_benchmark == "off"
    assert spec("carma-imnet-inception_v3-32").cudnn_benchmark == "off"


def test_channels_last_and_244_input():
    s = spec("mila-H100-resnet50-noio-1-311")
    assert s.channels_last and s.input == InputSpec("image", (3, 244, 244)) and s.precision == "amp-fp16"
    assert spec("mila-H100-resnet50-1-296").channels_last


def test_timm_train_default_optimizer_is_sgd_with_momentum_and_bf16():
    s = spec("mila-H100-focalnet-1-149")
    assert (s.model, s.optimizer, s.precision) == ("timm:focalnet_base_lrf", "sgd-momentum", "amp-bf16")


def test_lightning_precision_text_and_unknown_gpu_count():
    s = spec("mila-H100-lightning-1-164")
    assert (s.optimizer, s.precision, s.num_gpus) == ("adam", "amp-bf16", 1)
    # "-gpus" benches: DDP over all GPUs of the node, count not recorded -> data parallel (> 1)
    for rid in ("mila-H100-lightning-gpus-1-179", "mila-H100-resnet152-ddp-gpus-1-278"):
        s = spec(rid)
        assert s.num_gpus > 1 and s.parallelism == "ddp"
    assert spec("mila-H100-resnet152-ddp-gpus-1-278").optimizer == "sgd"


def test_hf_presets_by_checkpoint():
    s = spec("mila-H100-t5-1-344")
    assert s.model == "hf:t5-small" and s.input == InputSpec("tokens", (1024,))
    s = spec("mila-H100-whisper-1-379")   # whisper-tiny's config, built as the row's class
    assert s.model == "hf:WhisperForAudioClassification"
    assert s.model_kwargs["d_model"] == 384 and s.model_kwargs["encoder_layers"] == 4
    assert s.input == InputSpec("tensor", (80, 3000))
    s = spec("mila-H100-reformer-1-247")
    assert s.model == "hf:ReformerForMaskedLM" and s.model_kwargs == {"num_buckets": 128}
    assert s.input == InputSpec("tokens", (4096,))


def test_dataparallel_global_batch_is_split_per_replica_only_when_global():
    s = spec("carma-gpt2_large-8")      # "batch_size = global 8 (4 per replica)"
    assert (s.batch_size, s.num_gpus, s.parallelism) == (4, 2, "dp")
    s = spec("carma-xlnet_base-8")      # "batch_size column = per_device"
    assert (s.batch_size, s.num_gpus, s.parallelism) == (8, 2, "dp")
    assert s.model == "hf:XLNetForSequenceClassification" and s.model_kwargs["num_labels"] == 2
    assert s.model_kwargs["d_model"] == 768 and s.input == InputSpec("tokens", (512,))


def test_smp_unet_maps_to_user_factory():
    s = spec("carma-unet-8")
    assert s.model == "groundtruth:smp_model"
    assert s.model_kwargs == {"arch": "Unet", "encoder_name": "resnet34", "in_channels": 3, "classes": 21}
    assert s.loss == "mse" and s.input == InputSpec("image", (3, 512, 512))


def test_variable_input_is_a_row_skip_with_reason():
    with pytest.raises(RowSkip, match="not a fixed shape"):
        spec("carma-maskrcnn-8")


def test_argv_round_trips_through_the_cli_parser():
    for rid, row in ROWS.items():
        try:
            argv = row_to_argv(row)
        except RowSkip:
            continue
        s = parse_workload_args(argv)
        assert parse_workload_args(s.to_argv()) == s, rid


def test_amd_detection():
    assert is_amd(ROWS["mila-MI325-bert-fp16-16-765"])
    assert not any(is_amd(r) for k, r in ROWS.items() if "MI325" not in k)


def test_unknown_optimizer_and_precision_are_row_skips():
    row = dict(ROWS["carma-imnet-inception_v3-32"])
    with pytest.raises(RowSkip, match="optimizer"):
        row_to_spec({**row, "optimizer": "LAMB"})
    with pytest.raises(RowSkip, match="precision"):
        row_to_spec({**row, "precision": "fp8"})
    with pytest.raises(RowSkip, match="JSON"):
        row_to_spec({**row, "model_args": "{not json"})


def test_mlp_rows_map_the_layer_list():
    row = dict(ROWS["carma-imnet-inception_v3-32"], model_kind="mlp", model_name="mlp_small", input_shape="784",
               model_args=json.dumps({"sequential": [["Linear", 784, 64], ["ReLU"], ["Linear", 64, 10], ["Softmax", 1]],
                                      "n_params": 50890}))
    s = row_to_spec(row)
    assert s.model.startswith("mlp:") and json.loads(s.model[4:])[0] == ["Linear", 784, 64]
    assert s.input == InputSpec("tensor", (784,))


# tests/data/groundtruth-sample.csv: one row of each (source, GPU, model, precision, confidence,
# channels-last) of shared/groundtruth/*.csv, kept with the tests so that they run where shared/ is
# not beside the checkout (CI); the whole files too where they are (shared/, or VEST_GROUNDTRUTH).
SAMPLE = os.path.join(os.path.dirname(__file__), "data", "groundtruth-sample.csv")
GROUNDTRUTH_FILES = [SAMPLE] + sorted(os.path.join(GROUNDTRUTH, n) for n in (
    os.listdir(GROUNDTRUTH) if os.path.isdir(GROUNDTRUTH) else ()) if n.endswith(".csv"))


@pytest.mark.parametrize("path", GROUNDTRUTH_FILES, ids=os.path.basename)
def test_every_nvidia_high_medium_row_of_the_files_maps(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        if r["confidence"] in ("high", "medium") and not is_amd(r):
            row_to_spec(r)   # raises RowSkip on a row that does not map


def test_lightning_precisions_and_float_target_losses_map():
    from groundtruth import _loss, _precision

    assert [_precision(p) for p in ("bf16-mixed", "16-mixed", "bf16-true", "32-true", "amp_bf16 (Lightning)")] == [
        "amp-bf16", "amp-fp16", "bf16", "fp32", "amp-bf16"]
    assert [_loss(x) for x in ("MSELoss", "BCEWithLogitsLoss", "SmoothL1Loss", "DiceLoss", "CrossEntropyLoss")] == [
        "mse", "mse", "mse", "mse", "cross-entropy"]
    with pytest.raises(RowSkip):
        _precision("int8")


def test_fused_and_for_loop_rows_map_to_the_optimizer_impl():
    from groundtruth import _optimizer_impl

    assert _optimizer_impl("adamw_torch_fused", "") == "fused"
    assert _optimizer_impl("torch.optim.AdamW", '{"fused": true}') == "fused"
    assert _optimizer_impl("torch.optim.Adam", '{"foreach": false}') == "for-loop"
    assert _optimizer_impl("torch.optim.Adam", '{"lr": 0.001}') is None   # PyTorch's default: foreach
    assert _optimizer_impl("Adam", "not json") is None
    assert _optimizer_impl("AdamW (HF Trainer default optim; foreach/fused depends on transformers version)", "") is None


def test_optimizer_names_and_settings_map_to_options():
    from groundtruth import _optimizer

    assert _optimizer("torch.optim.Adam", '{"amsgrad": true}') == "adam-amsgrad"
    assert _optimizer("AdamW (HF Trainer default optim)", "{}") == "adamw"
    assert _optimizer("timm train.py default (SGD momentum 0.9, nesterov)", '{"momentum": 0.9}') == "sgd-momentum"
    assert _optimizer("RMSprop", '{"momentum": 0.9}') == "rmsprop-momentum"
    assert _optimizer("RMSprop", '{"centered": true}') == "rmsprop-centered"
    assert [_optimizer(n, "") for n in ("Adagrad", "Adamax", "NAdam", "RAdam", "Adadelta", "ASGD", "Rprop",
                                        "torch.optim.Adafactor")] == [
        "adagrad", "adamax", "nadam", "radam", "adadelta", "asgd", "rprop", "adafactor"]
    assert _optimizer("adamw_torch_fused", "") == "adamw"   # HF Trainer's optim names
    assert [_optimizer(n, "") for n in ("adamw_bnb_8bit", "bnb.optim.AdamW8bit", "Adam8bit")] == [
        "adamw-8bit", "adamw-8bit", "adam-8bit"]
    for name, args in (("Lion", ""), ("RMSprop", '{"momentum": 0.9, "centered": true}'), ("paged_adamw_8bit", ""),
                       ("bnb.optim.PagedAdamW", ""), ("bnb.optim.Lion8bit", "")):
        with pytest.raises(RowSkip):
            _optimizer(name, args)
