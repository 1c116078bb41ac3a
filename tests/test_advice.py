"""advice: the batch search (pure, against known need curves) and the advice on a real refused job."""

from __future__ import annotations

import random

import bitsandbytes  # noqa: F401  (the 8-bit optimizer advice traces it: a [test] dependency)
import pytest
import torch  # noqa: F401
import transformers  # noqa: F401

from vest_slurm.site.advice import (Prober, advise, amp_precision, bisection_search, resolution, search_largest_batch,
                                   site_profiles)
from vest_slurm.slurm.jobscript import GpuRequest
from vest_slurm.site.placement import NoFit, place
from vest_slurm.estimate.profiles import get_profile
from vest_slurm.site.config import parse_site_config
from vest_slurm.units import MiB
from vest_slurm.estimate.workload import parse_workload_args


def _truth(need, cap, max_batch):
    return max((b for b in range(1, max_batch + 1) if need(b) <= cap), default=None)


@pytest.mark.parametrize("seed", range(5))
def test_search_finds_the_boundary_to_its_resolution_on_step_curves(seed):
    rng = random.Random(seed)
    for _ in range(300):
        base, per, step = rng.randint(0, 5000), rng.randint(1, 100), rng.choice([1, 64, 512, 4096])
        need = lambda b: base + -(-per * b // step) * step  # noqa: E731  allocator-like rounding
        cap, start, top = rng.randint(0, 40000), rng.randint(1, 500), 500
        s = search_largest_batch(need, cap, start, max_batch=top)
        truth = _truth(need, cap, top)
        if truth is None or truth < 64:
            assert s.batch == truth
        else:   # never above the truth, and within 1/64 of it
            assert s.batch <= truth < s.batch + resolution(s.batch)
        assert s.complete
        assert s.exact or s.batch is None
        if s.batch is not None:
            assert s.needed_bytes == need(s.batch)


@pytest.mark.parametrize("seed", range(3))
def test_affine_search_answers_as_the_bisection_does_within_the_resolution(seed):
    # Both answers are within one resolution step below the truth; where the line holds the new
    # search needs four probes at most, where it does not (steps) it falls back and still answers.
    rng = random.Random(100 + seed)
    for _ in range(300):
        base, per, step = rng.randint(0, 5000), rng.randint(1, 100), rng.choice([1, 64, 512, 4096])
        need = lambda b: base + -(-per * b // step) * step  # noqa: E731
        cap, start, top = rng.randint(0, 40000), rng.randint(1, 500), 500
        new, old = search_largest_batch(need, cap, start, max_batch=top), bisection_search(need, cap, start, max_batch=top)
        if old.batch is None or new.batch is None:
            assert old.batch == new.batch
        else:
            assert abs(new.batch - old.batch) < max(resolution(new.batch), resolution(old.batch))
        if step == 1 and new.method == "affine":
            assert len(new.probes) <= 4, (base, per, cap, start, new.probes)


def test_affine_search_confirms_the_line_with_two_probes():
    need = lambda b: 600 * MiB + b * 3 * MiB  # noqa: E731
    s = search_largest_batch(need, 16000 * MiB, 8)
    assert s.method == "affine" and s.exact and s.probes[:2] == (8, 16) and len(s.probes) == 4
    assert need(s.batch) <= 16000 * MiB < need(s.batch + resolution(s.batch))
    # a line that does not hold (a 2 GiB step past batch 3000) costs probes, not a wrong answer
    stepped = lambda b: need(b) + (2048 * MiB if b > 3000 else 0)  # noqa: E731
    t = search_largest_batch(stepped, 16000 * MiB, 8)
    assert t.method == "bisection" and t.exact and t.batch == max(b for b in range(1, 6000) if stepped(b) <= 16000 * MiB) \
        or stepped(t.batch) <= 16000 * MiB < stepped(t.batch + resolution(t.batch))


def test_a_floor_above_the_capacity_answers_none_with_no_probe():
    calls = []
    s = search_largest_batch(lambda b: calls.append(b) or 10 * b, 100, 64, floor_bytes=101)
    assert s.batch is None and s.complete and s.exact and s.method == "floor" and calls == []


def test_resolution():
    assert [resolution(b) for b in (1, 63, 64, 128, 6400)] == [1, 1, 1, 2, 100]


def test_search_uses_few_probes_on_linear_memory():
    need = lambda b: 600 * MiB + b * 3 * MiB  # noqa: E731
    up = search_largest_batch(need, 16000 * MiB, 8)
    assert up.batch <= (16000 - 600) // 3 < up.batch + resolution(up.batch) and up.exact
    assert len(up.probes) <= 4, up.probes
    down = search_largest_batch(need, 2000 * MiB, 1024)
    assert down.batch <= (2000 - 600) // 3 < down.batch + resolution(down.batch) and down.exact
    assert len(down.probes) <= 4, down.probes


def test_search_reports_nothing_fits_and_the_cap():
    assert search_largest_batch(lambda b: 10 + b, 5, 64).batch is None
    capped = search_largest_batch(lambda b: b, 10**9, 4, max_batch=1000)
    assert capped.batch == 1000 and capped.capped and capped.text() == ">=1000"


def test_search_stops_at_the_budget_with_a_lower_bound():
    calls = []

    def need(b):
        if len(calls) >= 2:
            return None
        calls.append(b)
        return b

    s = search_largest_batch(need, 1000, 10)
    assert not s.complete and not s.exact and s.batch == 20 and s.text() == ">=20"


def test_amp_precision_by_capability():
    assert amp_precision(get_profile("v100-16gb")) == "amp-fp16"
    assert amp_precision(get_profile("a100-40gb")) == "amp-bf16"


TINY_SITE = """
# context_mib pinned: the tests size these GPUs around a 420 MiB CUDA context, whatever the
# profiles' calibrated defaults are
[gpu.tiny]
profile = "v100-16gb"
memory_mib = 700
context_mib = 420
[gpu.small]
profile = "a100-40gb"
memory_mib = 650
context_mib = 440
[partition.tiny]
gpu_types = ["tiny"]
gpus_per_node = 4
[partition.small]
gpu_types = ["small"]
gpus_per_node = 2
[policy]
headroom_percent = 0
exempt_users = []
"""
MLP = 'mlp:[["Linear",1024,1024],["ReLU"],["Linear",1024,10]]'


def test_site_memory_overrides_the_profile_capacity():
    site = parse_site_config(TINY_SITE)
    profiles = site_profiles(site)
    assert profiles["tiny"].usable_bytes == 700 * MiB and profiles["tiny"].capability == (7, 0)


@pytest.mark.slow
def test_advice_on_a_refused_job_is_verified_by_the_estimator():
    site = parse_site_config(TINY_SITE)
    spec = parse_workload_args(["--model", MLP, "--input", "1024", "--batch-size", "32768"])
    prober = Prober.for_site(site, budget_s=120)
    estimates, failed = prober.estimates(spec)
    assert not failed
    nofit = place(estimates, GpuRequest(None, None, 0, 0), (), site)
    assert isinstance(nofit, NoFit) and nofit.reason == "no-fit"
    before = prober.traces_made
    items = {a.kind: a for a in advise(spec, site, prober, nofit)}
    advice_traces = prober.traces_made - before
    batch = items["batch"]
    assert batch.fits and batch.gpu_type == "tiny" and 1 <= batch.batch_size < 32768
    # the answer is the boundary to the search's resolution: it fits, a resolution step more does not
    b = batch.batch_size
    assert prober.needed(spec.with_(batch_size=b), "tiny") <= 700 * MiB
    assert prober.needed(spec.with_(batch_size=b + resolution(b)), "tiny") > 700 * MiB
    amp = items["amp"]
    assert amp.precision in ("amp-fp16", "amp-bf16")
    if amp.fits:
        assert prober.needed(spec.with_(precision=amp.precision), amp.gpu_type) <= prober.capacity(amp.gpu_type)
    gpus = items["gpus"]
    if gpus.fits:
        variant = spec.with_(num_gpus=gpus.num_gpus, batch_size=gpus.batch_size)
        assert prober.needed(variant, gpus.gpu_type) <= prober.capacity(gpus.gpu_type)
    else:
        assert "do not help" in gpus.text
    # bounded: the batch search, AMP (one trace per GPU class) and the GPU counts reuse traces
    assert advice_traces <= 16, advice_traces


@pytest.mark.slow
def test_checkpointing_advice_is_offered_where_the_model_has_a_switch():
    site = parse_site_config(TINY_SITE)
    spec = parse_workload_args(["--model", "hf:tiny-llama", "--model-arg", "vocab_size=512", "--input", "seq512",
                                "--batch-size", "8", "--optimizer", "sgd"])
    prober = Prober.for_site(site, budget_s=120)
    estimates, failed = prober.estimates(spec)
    nofit = place(estimates, GpuRequest(None, None, 0, 0), (), site)
    assert not failed and isinstance(nofit, NoFit) and nofit.reason == "no-fit"
    ckpt = {a.kind: a for a in advise(spec, site, prober, nofit)}["checkpointing"]
    assert ckpt.fits and "--gradient-checkpointing on" in ckpt.change
    variant = spec.with_(gradient_checkpointing="on")
    assert prober.needed(variant, ckpt.gpu_type) == ckpt.needed_bytes <= prober.capacity(ckpt.gpu_type)
    assert ckpt.needed_bytes < prober.needed(spec, ckpt.gpu_type)
    # the smallest GPU type on which it fits
    smaller = [t for t in site.gpu_names if prober.capacity(t) < prober.capacity(ckpt.gpu_type)]
    assert all(prober.needed(variant, t) > prober.capacity(t) for t in smaller)
    # a model without a switch gets no such advice, and the probe's refusal does not break the advice
    mlp = parse_workload_args(["--model", MLP, "--input", "1024", "--batch-size", "32768"])
    kinds = [a.kind for a in advise(mlp, site, prober, nofit)]
    assert "checkpointing" not in kinds and "batch" in kinds


@pytest.mark.slow
def test_8bit_optimizer_advice_where_the_adam_state_is_what_does_not_fit():
    site = parse_site_config(TINY_SITE)
    big_mlp = 'mlp:[["Linear",4096,4096],["ReLU"],["Linear",4096,1024]]'   # 84 MiB of fp32 weights
    spec = parse_workload_args(["--model", big_mlp, "--input", "4096", "--batch-size", "8", "--optimizer", "adamw"])
    prober = Prober.for_site(site, budget_s=120)
    estimates, failed = prober.estimates(spec)
    nofit = place(estimates, GpuRequest(None, None, 0, 0), (), site)
    assert not failed and isinstance(nofit, NoFit) and nofit.reason == "no-fit"
    items = {a.kind: a for a in advise(spec, site, prober, nofit)}
    eight = items["optimizer"]
    assert eight.fits and "--optimizer adamw-8bit" in eight.change and "AdamW8bit" in eight.change
    variant = spec.with_(optimizer="adamw-8bit")
    assert prober.needed(variant, eight.gpu_type) == eight.needed_bytes <= prober.capacity(eight.gpu_type)
    assert not items["batch"].fits   # even batch 1 does not fit with AdamW's fp32 states
    # a job without Adam's state gets no such advice
    sgd = spec.with_(optimizer="sgd", batch_size=32768)
    assert "optimizer" not in [a.kind for a in advise(sgd, site, prober, nofit)]


# TINY_SITE with the V100 the smaller type, and a third, too small for anything, for the user to choose
SLOW_SITE = TINY_SITE.replace("memory_mib = 700", "memory_mib = 640").replace(
    "exempt_users = []", 'exempt_users = []\non_user_choice_too_small = "refuse"') + """
[gpu.mig]
profile = "a100-40gb"
memory_mib = 100
[partition.mig]
gpu_types = ["mig"]
gpus_per_node = 4
"""


@pytest.mark.parametrize("precision,where", [("amp-bf16", "small"), ("amp-fp16", "tiny")])
def test_advice_names_gpus_where_the_job_runs_slow_last(precision, where):
    """A job too big for the partition the user chose: "as it is, the job fits ..." names the GPU
    placement would choose, the smallest, except where its bf16 runs emulated (the V100), as
    placement orders them."""
    site = parse_site_config(SLOW_SITE)
    spec = parse_workload_args(["--model", MLP, "--input", "1024", "--batch-size", "64", "--precision", precision])
    prober = Prober.for_site(site, budget_s=120)
    estimates, failed = prober.estimates(spec)
    assert not failed and all(e.fits for t, e in estimates.items() if t != "mig")
    nofit = place(estimates, GpuRequest(None, None, 0, 0), ("mig",), site, slow=prober.slow_types(spec))
    assert isinstance(nofit, NoFit) and nofit.reason == "user-choice-too-small"
    (as_is,) = advise(spec, site, prober, nofit)
    assert as_is.kind == "as-is" and as_is.gpu_type == where


@pytest.mark.slow
def test_a_siblings_floor_is_below_every_variants_need_and_saves_its_trace():
    """Prober.floor_needed: parameters, gradients and optimizer state of an estimated sibling bound
    from below the need of another batch, optimizer, checkpointing, DDP count or FSDP shard count,
    each checked against the variant's own estimate; a variant whose floor is over the GPU is
    answered with no trace."""
    site = parse_site_config(TINY_SITE)
    big_mlp = 'mlp:[["Linear",4096,4096],["ReLU"],["Linear",4096,2048]]'   # 96 MiB of fp32 weights
    spec = parse_workload_args(["--model", big_mlp, "--input", "4096", "--batch-size", "8", "--optimizer", "adamw"])
    prober = Prober.for_site(site, budget_s=300)
    estimates, failed = prober.estimates(spec)
    assert not failed
    parts = dict(estimates["small"].breakdown)
    assert parts["gradients"] == parts["parameters"] and parts["optimizer_state"] == 2 * parts["parameters"]
    variants = [spec.with_(batch_size=1), spec.with_(batch_size=256), spec.with_(optimizer="sgd"),
                spec.with_(optimizer="sgd-momentum"), spec.with_(optimizer="adamw-8bit"),
                spec.with_(optimizer="rmsprop", optimizer_impl="for-loop"), spec.with_(num_gpus=2),
                spec.with_(parallelism="fsdp2", num_gpus=2), spec.with_(parallelism="fsdp2", num_gpus=4)]
    big = Prober.for_site(parse_site_config(TINY_SITE.replace("memory_mib = 650", "memory_mib = 65000")), budget_s=300)
    big.estimates(spec)
    for v in variants:
        floor = big.floor_needed(v, "small")
        assert floor is not None, v
        truth = big.needed(v, "small")   # over the floor: a real estimate
        assert not big.is_floor(v, "small") and floor <= truth, (v, floor, truth)
    # a DDP sibling is no floor for DeepSpeed's layouts or CPU offload
    assert big.floor_needed(spec.with_(parallelism="zero3", num_gpus=2), "small") is None
    assert big.floor_needed(spec.with_(parallelism="fsdp2", num_gpus=2, offload="optimizer"), "small") is None
    # on the 650 MiB GPU the 8-bit state's floor (440 MiB of context, 2 x 96 + 48 MiB) is over: no trace
    eight = spec.with_(optimizer="adamw-8bit", batch_size=4096)
    floor = prober.floor_needed(eight, "small")
    assert floor > prober.capacity("small")
    before = prober.traces_made
    assert prober.needed(eight, "small") == floor and prober.is_floor(eight, "small") and prober.traces_made == before


@pytest.mark.slow
def test_sharded_alternatives_searched_beside_one_another_answer_as_one_after_another(monkeypatch):
    """The sharded variants built from different unsharded traces (with and without activation
    checkpointing) are searched in a forked child beside this process (Prober.in_groups): the same
    advice and the same trace counts as searched one after another, the child's traces made there."""
    from vest_slurm.estimate import ahead
    from vest_slurm.estimate import sharded_trace as st
    from vest_slurm.estimate.sharding import unit_spec

    monkeypatch.setattr(ahead, "cores", lambda: 2)
    monkeypatch.setattr(ahead, "_idle_cores", lambda: 1.0)
    # a job whose states (a 256k-token vocabulary's embeddings and AdamW's two states) are what
    # does not fit: sharded over 8 GPUs it does, with checkpointing and without
    site = parse_site_config('[gpu.v100]\nprofile = "v100-16gb"\nmemory_mib = 2500\ncontext_mib = 300\n'
                             '[partition.v100]\ngpu_types = ["v100"]\ngpus_per_node = 8\n'
                             '[policy]\nheadroom_percent = 0\nexempt_users = []\n')
    spec = parse_workload_args(["--model", "hf:tiny-llama", "--model-arg", "vocab_size=256000", "--input", "seq128",
                                "--batch-size", "2", "--optimizer", "adamw"])
    ckpt_unit = unit_spec(spec.with_(parallelism="fsdp2", num_gpus=2, gradient_checkpointing="on"))
    runs = {}
    for beside in ("0", "1"):
        monkeypatch.setenv("VEST_TRACE_AHEAD", beside)
        st.forget_unit_traces()
        prober = Prober.for_site(site, budget_s=600)
        estimates, failed = prober.estimates(spec)
        nofit = place(estimates, GpuRequest(None, None, 0, 0), (), site)
        assert not failed and isinstance(nofit, NoFit)
        advice = advise(spec, site, prober, nofit)
        made_here = {k[0] for k in st._UNIT_TRACES}
        runs[beside] = ([(a.kind, a.text) for a in advice], prober.traces_made, ckpt_unit in made_here)
    alone, beside = runs["0"], runs["1"]
    sharded = [text for kind, text in alone[0] if kind == "sharded"]
    assert any("activation checkpointing" in t for t in sharded) and len(sharded) >= 2, alone[0]
    assert beside[:2] == alone[:2]
    assert alone[2] and not beside[2]   # the checkpointed variant's unsharded trace was made in the child


@pytest.mark.slow
def test_gpu_counts_below_the_answer_are_ruled_out_by_a_bound_without_a_replay(monkeypatch):
    """The sharded advice asks of each GPU count below its answer only whether the job fits: where
    the trace's bound without the allocator's replay (estimator.need_at_least) is above the GPU,
    no replay is made. The advice is the same as with every count replayed, the bound is never
    above the replayed need, and fewer replays are made."""
    from vest_slurm.estimate import estimator
    from vest_slurm.site.placement import estimate_need, needed_bytes

    site = parse_site_config('[gpu.v100]\nprofile = "v100-16gb"\nmemory_mib = 2500\ncontext_mib = 300\n'
                             '[partition.v100]\ngpu_types = ["v100"]\ngpus_per_node = 8\n'
                             '[policy]\nheadroom_percent = 0\nexempt_users = []\n')
    spec = parse_workload_args(["--model", "hf:tiny-llama", "--model-arg", "vocab_size=256000", "--input", "seq128",
                                "--batch-size", "2", "--optimizer", "adamw"])
    monkeypatch.setenv("VEST_TRACE_AHEAD", "0")
    real_estimate, real_bound = estimator.estimate_from_trace, estimator.need_at_least
    runs = {}
    for bound in (False, True):
        replays = []
        monkeypatch.setattr(estimator, "estimate_from_trace",
                            lambda s, sp, p, replays=replays: replays.append(sp) or real_estimate(s, sp, p))
        monkeypatch.setattr(estimator, "need_at_least", real_bound if bound else (lambda s, sp, p: 0))
        prober = Prober.for_site(site, budget_s=600)
        estimates, failed = prober.estimates(spec)
        nofit = place(estimates, GpuRequest(None, None, 0, 0), (), site)
        runs[bound] = ([(a.kind, a.text) for a in advise(spec, site, prober, nofit)], replays, prober)
    assert runs[True][0] == runs[False][0]
    assert any(kind == "sharded" for kind, _ in runs[True][0])
    assert len(runs[True][1]) < len(runs[False][1])
    prober = runs[False][2]
    for sharded in {s for s in runs[False][1] if s.parallelism == "fsdp2"}:   # every count replayed
        summary = prober.summary(sharded, prober.profiles["v100"])
        low = real_bound(summary, sharded, prober.profiles["v100"])
        assert 0 < low <= estimate_need(prober.estimate(sharded, "v100"))
        assert needed_bytes(low, 0, 0) <= prober.needed(sharded, "v100")


def test_a_peak_above_the_gpu_rules_a_count_out_without_the_capacity_search(monkeypatch):
    """Where the uncapped replay's peak is above the GPU but the live tensors are not, the
    estimate's peak is the GPU's usable memory or more (the capacity search decides which); with
    the site's headroom that is above the GPU. So a GPU count the sharded advice only asks whether
    it fits is ruled out from the uncapped replay (estimator.peak_at_least), without the search,
    and the full estimate agrees. The bound is never above the estimate's need, on GPUs of any size."""
    from vest_slurm.estimate import allocator, estimator, replaycache
    from vest_slurm.site.placement import estimate_need

    spec = parse_workload_args(["--model", "torchvision:resnet18", "--batch-size", "16", "--input", "3x64x64",
                                "--optimizer", "adam"])

    def site(mib):
        return parse_site_config(f'[gpu.g]\nprofile = "a100-40gb"\nmemory_mib = {mib}\ncontext_mib = 300\n'
                                 '[partition.g]\ngpu_types = ["g"]\ngpus_per_node = 8\n'
                                 '[policy]\nheadroom_percent = 5\nexempt_users = []\n')

    big = Prober.for_site(site(40960), budget_s=600)
    profile = big.profiles["g"]
    summary = big._trace(spec, profile, False)
    live = estimator.need_at_least(summary, spec, profile)
    uncapped = estimator.peak_at_least(summary, spec, profile)   # below the usable memory: the uncapped peak
    assert live + 8 * MiB < uncapped < profile.usable_bytes
    reserved_mib = profile.total_mib - profile.usable_bytes // MiB
    mid = (live + uncapped) // 2 // MiB + reserved_mib   # live tensors fit, the uncapped peak does not
    searched = []
    monkeypatch.setattr(replaycache, "min_capacity_bytes",
                        lambda *a, **k: searched.append(1) or allocator.min_capacity_bytes(*a, **k))
    quick = Prober.for_site(site(mid), budget_s=600)
    bound = quick.needed(spec, "g", fits_only=True)
    assert bound > quick.capacity("g") and quick.is_floor(spec, "g") and not searched
    full = Prober.for_site(site(mid), budget_s=600)
    assert full.needed(spec, "g") >= bound and searched
    for mib in (live // MiB + reserved_mib - 4, mid, uncapped // MiB + reserved_mib + 4, 40960):
        p = Prober.for_site(site(mib), budget_s=600)
        pr = p.profiles["g"]
        assert estimator.peak_at_least(summary, spec, pr) <= estimate_need(estimator.estimate_from_trace(summary, spec, pr))
