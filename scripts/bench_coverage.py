#!/usr/bin/env python3
"""Which models vest can trace: a sweep over the model zoos, with a check that no memory escaped.

    scripts/bench_coverage.py [--family torchvision,timm,hf] [--gpu h100-80gb] [--workers 2]
        [--filter REGEX] [--out benchmarks/coverage-results.csv]

The accuracy benchmark (bench_accuracy.py) can only cover models that someone measured. This one
covers the rest: every torchvision classification, segmentation and video model, one timm model of
each architecture family and one transformers model of each common architecture (default configs,
built on the meta device, never downloaded), each in fp32 and in AMP, at a small batch. Per
workload it writes whether the trace and the estimate ran (the reason where not), the estimate,
the seconds, and a diagnostic for lost memory:

- ``host_ops``: ops that took a fake CUDA tensor and returned a non-scalar fake *CPU* tensor
  (more than 1,000 elements). On a GPU such an output is device memory; in the trace it would be
  missing, and the CPU code path would follow from it (how the options()-built tensors of
  Tensor.type_as were found). A copy to the host that the script asks for can count too (where
  C++ makes it with a copy op), so a nonzero count is a lead to read, not a verdict.

Torchvision detection models are listed as refused (models.py says why). A workload that fails is a
bug to fix or a limit to document: the exit status is 1 when any workload fails.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import csv
import multiprocessing as mp
import os
import re
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# The benchmarks time the work itself: no trace cache and no stored cuDNN answers (tracecache.py).
os.environ["VEST_CACHE_DIR"] = "off"

from tabulate import tabulate  # noqa: E402

MiB = 1 << 20

# timm: one model per architecture family (CNNs, vision transformers, hybrids, MLPs, RNN mixers)
TIMM = """resnet50 resnext50_32x4d efficientnet_b0 tf_efficientnetv2_s mobilenetv3_large_100 mobilenetv4_conv_small
convnext_tiny convnextv2_atto vit_base_patch16_224 deit_small_patch16_224 swin_tiny_patch4_window7_224
swinv2_tiny_window8_256 beit_base_patch16_224 eva02_tiny_patch14_224 maxvit_tiny_tf_224 coatnet_0_rw_224 regnety_016
densenet121 inception_v4 xception41 dla34 hrnet_w18 nfnet_f0 dm_nfnet_f0 cspdarknet53 ghostnet_100 levit_128 pvt_v2_b0
poolformer_s12 mixer_b16_224 resmlp_12_224 crossvit_tiny_240 cait_xxs24_224 tnt_s_patch16_224 twins_pcpvt_small
volo_d1_224 edgenext_small mobilevit_s efficientformer_l1 fastvit_t8 repvgg_a2 rexnet_100 tinynet_a gernet_s
sebotnet33ts_256 halonet26t lambda_resnet26t focalnet_tiny_srf davit_tiny gcvit_xxtiny hiera_tiny_224 convmixer_768_32
nest_tiny xcit_tiny_12_p16_224 coat_tiny visformer_tiny sequencer2d_s res2net50_26w_4s selecsls42b senet154 tresnet_m
ese_vovnet19b_dw efficientvit_b0 inception_next_tiny rdnet_tiny starnet_s1 vit_small_patch16_384
deit3_small_patch16_224 mambaout_femto nextvit_small fasternet_t0 vitamin_small_224 resnetv2_50x1_bit regnetz_b16
eca_nfnet_l0 mobileone_s0 efficientnet_b3 vgg16 inception_resnet_v2 nasnetalarge pnasnet5large dpn68 hgnetv2_b0
ghostnetv2_100""".split()

# transformers: one model class per common architecture, default config
HF = """BertForMaskedLM RobertaForMaskedLM DistilBertForMaskedLM AlbertForMaskedLM ElectraForMaskedLM DebertaV2ForMaskedLM
DebertaForMaskedLM XLNetLMHeadModel GPT2LMHeadModel GPTNeoForCausalLM GPTNeoXForCausalLM OPTForCausalLM
BloomForCausalLM LlamaForCausalLM MistralForCausalLM MixtralForCausalLM Qwen2ForCausalLM Qwen3ForCausalLM
Qwen3MoeForCausalLM Gemma2ForCausalLM GemmaForCausalLM PhiForCausalLM Phi3ForCausalLM FalconForCausalLM
T5ForConditionalGeneration BartForConditionalGeneration MBartForConditionalGeneration PegasusForConditionalGeneration
MarianMTModel WhisperForConditionalGeneration WhisperForAudioClassification Wav2Vec2ForCTC HubertForCTC
ViTForImageClassification DeiTForImageClassification SwinForImageClassification ConvNextForImageClassification
BeitForImageClassification SegformerForImageClassification LongformerForMaskedLM BigBirdForMaskedLM
ReformerForMaskedLM FunnelForMaskedLM MPNetForMaskedLM ModernBertForMaskedLM GPTJForCausalLM CodeGenForCausalLM
StableLmForCausalLM OlmoForCausalLM MambaForCausalLM Dinov2ForImageClassification ResNetForImageClassification
BertForSequenceClassification GPT2ForSequenceClassification LlamaForSequenceClassification XLMRobertaForMaskedLM
MobileBertForMaskedLM ConvBertForMaskedLM GPTBigCodeForCausalLM Gemma3ForCausalLM GraniteForCausalLM
Starcoder2ForCausalLM OlmoeForCausalLM SwitchTransformersForConditionalGeneration LEDForConditionalGeneration
Swinv2ForImageClassification LevitForImageClassification MobileViTForImageClassification
EfficientNetForImageClassification RegNetForImageClassification""".split()

# what a job with these models sets beside the default config: raw audio and a loss of its own on
# the CTC heads' scores, without SpecAugment (its boolean mask sizes outputs by value); a pad token
# for classifying sequences; Reformer's axial positions fix its sequence length (64 x 64 = 4096)
HF_EXTRA = {
    "Wav2Vec2ForCTC": "--input tensor:32000 --loss cross-entropy --model-arg mask_time_prob=0",
    "HubertForCTC": "--input tensor:32000 --loss cross-entropy --model-arg mask_time_prob=0",
    "GPT2ForSequenceClassification": "--input seq256 --model-arg pad_token_id=0",
    "LlamaForSequenceClassification": "--input seq256 --model-arg pad_token_id=0",
    "ReformerForMaskedLM": "--input seq4096",
}


def workloads(families: set[str]) -> list[tuple[str, str]]:
    """(family, vest workload arguments) for every model of the sweep, fp32 and AMP."""
    out = []
    if "torchvision" in families:
        import torchvision.models as tvm

        for name in tvm.list_models(module=tvm):
            size = "3x299x299" if name == "inception_v3" else "3x224x224"
            for prec in ("fp32", "amp-fp16"):
                out.append(("torchvision", f"--model torchvision:{name} --batch-size 4 --input {size} --precision {prec}"))
        for name in tvm.list_models(module=tvm.segmentation):
            for prec in ("fp32", "amp-fp16"):
                out.append(("torchvision", f"--model torchvision:{name} --batch-size 2 --input 3x256x256 --precision {prec}"))
        for name in tvm.list_models(module=tvm.video):
            out.append(("torchvision", f"--model torchvision:{name} --batch-size 2 --input tensor:3x16x224x224 --precision amp-fp16"))
        for name in tvm.list_models(module=tvm.detection):
            out.append(("torchvision", f"--model torchvision:{name} --batch-size 2 --input 3x512x512 --precision amp-fp16"))
    if "timm" in families:
        import timm

        for name in TIMM:
            if timm.is_model(name):
                for prec in ("fp32", "amp-bf16"):
                    out.append(("timm", f"--model timm:{name} --batch-size 4 --input default --precision {prec}"))
    if "hf" in families:
        import transformers

        for name in HF:
            cls = getattr(transformers, name, None)
            if cls is None:
                continue
            main = getattr(cls, "main_input_name", "input_ids")
            extra = HF_EXTRA.get(name, "--input seq256" if main == "input_ids" else "--input default")
            for prec in ("fp32", "amp-bf16"):
                out.append(("hf", f"--model hf:{name} --batch-size 2 {extra} --precision {prec}"))
    return out


# ------------------------------------------------------------------ worker side

_HOST_OPS: collections.Counter = collections.Counter()


def _init_worker() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils import _pytree as pytree

    from vest_slurm.estimate import _fakecuda as fc

    torch.set_num_threads(1)
    dispatch = fc.FakeCudaMode.__torch_dispatch__

    def is_fake(t, device: str) -> bool:
        return isinstance(t, FakeTensor) and t.fake_device.type == device

    def counting_dispatch(self, func, types, args=(), kwargs=None):
        out = dispatch(self, func, types, args, kwargs)
        if self._depth == 0 and any(is_fake(t, "cuda") for t in pytree.tree_leaves((args, kwargs))):
            if any(is_fake(t, "cpu") and t.dim() > 0 and t.numel() > 1000 for t in pytree.tree_leaves(out)):
                _HOST_OPS[str(func)] += 1
        return out

    fc.FakeCudaMode.__torch_dispatch__ = counting_dispatch


def run_one(args: str, gpu: str) -> dict:
    from vest_slurm.errors import VestError
    from vest_slurm.estimate.estimator import estimate
    from vest_slurm.estimate.profiles import get_profile
    from vest_slurm.estimate.workload import parse_workload_args

    _HOST_OPS.clear()
    t0 = time.perf_counter()
    rec = {"status": "ok", "reason": ""}
    try:
        spec = parse_workload_args(shlex.split(args))
        est = estimate(spec, [get_profile(gpu)])[0]
        parts = dict(est.breakdown)
        rec.update(peak_mib=round(est.peak_bytes / MiB), required_mib=round(est.required_bytes / MiB),
                   params_mib=round(parts["parameters"] / MiB, 1), live_tensor_mib=round(parts["live_tensor_peak"] / MiB))
    except VestError as e:
        first = str(e).splitlines()[0]
        rec.update(status="refused" if "not supported" in first else "error", reason=first)
    except Exception as e:  # an estimator bug: keep its type
        rec.update(status="error", reason=f"internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    rec["host_ops"] = sum(_HOST_OPS.values())
    rec["host_op_names"] = " ".join(f"{k}x{v}" for k, v in _HOST_OPS.most_common(4))
    return rec


# ------------------------------------------------------------------ main side

COLUMNS = ["family", "args", "status", "reason", "peak_mib", "required_mib", "params_mib", "live_tensor_mib",
           "seconds", "host_ops", "host_op_names"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="torchvision,timm,hf", help="comma-separated: torchvision, timm, hf")
    ap.add_argument("--gpu", default="h100-80gb", help="GPU type to estimate for (default h100-80gb)")
    ap.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--filter", default=None, help="only workloads whose arguments match this regex")
    ap.add_argument("--out", default="benchmarks/coverage-results.csv")
    a = ap.parse_args(argv)
    families = {f.strip() for f in a.family.split(",") if f.strip()}
    unknown = families - {"torchvision", "timm", "hf"}
    if unknown:
        ap.error(f"unknown family {', '.join(sorted(unknown))}: use torchvision, timm, hf")
    todo = workloads(families)
    if a.filter:
        todo = [w for w in todo if re.search(a.filter, w[1])]
    print(f"{len(todo)} workloads, {a.workers} workers, estimated for {a.gpu}", file=sys.stderr)
    rows: list[dict] = []
    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    pending = list(todo)
    attempts: collections.Counter = collections.Counter()
    while pending:
        with cf.ProcessPoolExecutor(max_workers=max(1, a.workers), mp_context=ctx, initializer=_init_worker) as pool:
            futs = {pool.submit(run_one, w[1], a.gpu): w for w in pending}
            pending = []
            for fut in cf.as_completed(futs):
                fam, args = futs[fut]
                try:
                    rec = fut.result()
                except cf.process.BrokenProcessPool:   # a worker died in native code: retry once
                    attempts[args] += 1
                    if attempts[args] < 2:
                        pending.append((fam, args))
                        continue
                    rec = {"status": "error", "reason": "worker process died while tracing", "seconds": 0, "host_ops": 0}
                rows.append({"family": fam, "args": args, **rec})
                print(f"\r  {len(rows)}/{len(todo)}  {time.perf_counter() - t0:6.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    wall = time.perf_counter() - t0
    order = {w[1]: i for i, w in enumerate(todo)}
    rows.sort(key=lambda r: order[r["args"]])
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)

    table = []
    for fam in sorted({r["family"] for r in rows}):
        rs = [r for r in rows if r["family"] == fam]
        secs = [r["seconds"] for r in rs if r["status"] == "ok"]
        table.append([fam, len(rs), sum(r["status"] == "ok" for r in rs), sum(r["status"] == "refused" for r in rs),
                      sum(r["status"] == "error" for r in rs), sum(r.get("host_ops", 0) > 0 for r in rs),
                      f"{statistics.median(secs):.1f}" if secs else "-", f"{max(secs):.1f}" if secs else "-"])
    print(tabulate(table, headers=["family", "workloads", "ok", "refused", "failed", "with host ops", "median s", "max s"]))
    for r in rows:
        if r["status"] != "ok" or r.get("host_ops"):
            note = r["reason"] or f"host ops: {r.get('host_op_names', '')}"
            print(f"  {r['status']:8} {r['args']}\n           {note}")
    print(f"\n{len(rows)} workloads in {wall:.0f} s wall with {a.workers} workers; results: {a.out}")
    return 1 if any(r["status"] == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
