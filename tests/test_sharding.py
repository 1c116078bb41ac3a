"""Per-rank shard bytes of every sharded strategy: parameters, gradients, optimizer states and fp32
masters equal to their sizes divided over the ranks, as torch.chunk and DeepSpeed's padding cut them
(uneven sizes included), through the real tracer and the allocator replay."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from vest_slurm.errors import WorkloadError
from vest_slurm.estimate.estimator import trace_for
from vest_slurm.estimate.profiles import get_profile
from vest_slurm.estimate.workload import parse_workload_args

# Every dim 0 uneven over 3 ranks and 4 ranks: 7 = 3+3+1 (4 ranks: 2+2+2+1), 5 = 2+2+1 (2+2+1+0).
MLP = 'mlp:[["Linear",11,7],["ReLU"],["Linear",7,5],["ReLU"],["Linear",5,3]]'
SHAPES = [(7, 11), (7,), (5, 7), (5,), (3, 5), (3,)]


def _spec(parallelism, gpus, *extra):
    return parse_workload_args(["--model", MLP, "--batch-size", "4", "--optimizer", "adamw",
                                "--parallelism", parallelism, "--num-gpus", str(gpus), *extra])


def _summary(spec):
    return trace_for(spec, get_profile("a100-80gb"))


def _rank0_chunk(shape, world):
    """torch.chunk's cut of a real tensor: (rank 0's numel, the padded numel every rank stores)."""
    chunks = torch.chunk(torch.empty(shape), world, dim=0)
    rows = chunks[0].shape[0]
    return chunks[0].numel(), rows * math.prod(shape[1:])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fsdp2_shards_per_parameter(world):
    s = _summary(_spec("fsdp2", world))
    padded = sum(_rank0_chunk(sh, world)[1] for sh in SHAPES)
    local = sum(_rank0_chunk(sh, world)[0] for sh in SHAPES)
    assert s.param_bytes == padded * 4
    assert s.grad_bytes == padded * 4           # views of one padded reduce-scatter output per unit
    assert s.optimizer_state_bytes == 2 * local * 4   # exp_avg, exp_avg_sq of the local shard


def test_fsdp2_mixed_precision_keeps_fp32_shards():
    s = _summary(_spec("fsdp2", 3, "--param-dtype", "bf16", "--reduce-dtype", "fp32"))
    padded = sum(_rank0_chunk(sh, 3)[1] for sh in SHAPES)
    assert s.param_bytes == padded * 4 and s.grad_bytes == padded * 4


@pytest.mark.parametrize("world", [3, 4])
def test_fsdp1_flat_parameter_per_unit(world):
    s = _summary(_spec("fsdp", world))
    # top-level children with parameters are the units: the three Linear layers
    units = [7 * 11 + 7, 5 * 7 + 5, 3 * 5 + 3]
    shard = sum(-(-n // world) for n in units)
    assert s.param_bytes == shard * 4 and s.grad_bytes == shard * 4
    assert s.optimizer_state_bytes == 2 * shard * 4


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_zero_partitions(stage):
    world = 3
    total = sum(math.prod(sh) for sh in SHAPES)
    spec = _spec(stage, world, "--precision", "bf16")
    s = _summary(spec)
    if stage == "zero3":
        part = sum(-(-math.prod(sh) // world) for sh in SHAPES)
        params = part * 2
    else:
        padded = -(-total // (2 * world)) * 2 * world   # stage_1_and_2 pads to 2 x world size
        part = padded // world
        params = total * 2
    assert s.param_bytes == params + part * 4       # bf16 parameters (or their partitions) + fp32 masters
    assert s.optimizer_state_bytes == 2 * part * 4


def test_hsdp_shards_over_the_group():
    s = _summary(_spec("hsdp", 4, "--shard-group-size", "2"))
    padded = sum(_rank0_chunk(sh, 2)[1] for sh in SHAPES)
    assert s.param_bytes == padded * 4


def test_more_gpus_less_memory_and_refusals():
    a = _summary(_spec("fsdp2", 2)).param_bytes
    b = _summary(_spec("fsdp2", 4)).param_bytes
    assert b < a
    with pytest.raises(WorkloadError, match="sharded"):
        parse_workload_args(["--model", MLP, "--batch-size", "2", "--param-dtype", "bf16"])
    with pytest.raises(WorkloadError, match="offload"):
        _summary(_spec("fsdp2", 2, "--offload", "optimizer"))


def test_gather_buffers_go_through_their_streams():
    tr = _summary(_spec("fsdp2", 2, "--param-dtype", "bf16")).trace
    streams = {e.module: e.stream for e in tr.events if e.action == "alloc"}
    assert streams["all_gather_output"] == 1 and streams["reduce_scatter_input"] == 0
    assert 2 in {e.stream for e in tr.events if e.category == "gradient" and e.action == "alloc"}


def test_fsdp2_before_torch_2_5_reduces_from_the_reduce_scatter_stream(monkeypatch):
    """A job on torch before 2.5 ($VEST_JOB_TORCH): FSDP2 allocated the reduce-scatter input on the
    reduce-scatter stream (pytorch PR #129721 moved it to the compute stream), so it is in that
    stream's pool, one at a time; the shards are the same. A value that is no version is refused."""
    new = _summary(_spec("fsdp2", 2, "--param-dtype", "bf16"))
    monkeypatch.setenv("VEST_JOB_TORCH", "2.4.1")
    old = _summary(_spec("fsdp2", 2, "--param-dtype", "bf16"))
    streams = {e.stream for e in old.trace.events if e.module == "reduce_scatter_input" and e.action == "alloc"}
    assert streams == {2}
    assert (old.param_bytes, old.grad_bytes, old.optimizer_state_bytes) == \
        (new.param_bytes, new.grad_bytes, new.optimizer_state_bytes)
    monkeypatch.setenv("VEST_JOB_TORCH", "nightly")
    with pytest.raises(WorkloadError, match="VEST_JOB_TORCH"):
        _summary(_spec("fsdp2", 2, "--param-dtype", "bf16"))


def test_token_inputs_for_a_user_model(tmp_path, monkeypatch):
    """--input seqN on a user factory whose model embeds tokens: integer ids (8 bytes each), not floats."""
    (tmp_path / "lm.py").write_text(
        "from torch import nn\n"
        "class LM(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = nn.Embedding(1000, 32)\n"
        "        self.head = nn.Linear(32, 1000)\n"
        "    def forward(self, ids):\n"
        "        return self.head(self.emb(ids))\n"
        "def make():\n"
        "    return LM()\n")
    monkeypatch.chdir(tmp_path)
    spec = parse_workload_args(["--model", "lm.py:make", "--batch-size", "3", "--input", "seq64"])
    s = trace_for(spec, get_profile("a100-80gb"))
    inputs = [e.size_bytes for e in s.trace.events if e.action == "alloc" and e.category == "input"]
    assert inputs and inputs[0] == 3 * 64 * 8


SITE = """
[gpu.big]
profile = "a100-80gb"
memory_mib = 1000
context_mib = 100
[partition.p]
gpu_types = ["big"]
gpus_per_node = 8
[policy]
headroom_percent = 0
exempt_users = []
"""


def test_advice_names_the_smallest_sharded_configuration_that_fits():
    import json

    from vest_slurm.site.advice import Prober, advise
    from vest_slurm.site.config import parse_site_config
    from vest_slurm.site.placement import NoFit, place
    from vest_slurm.slurm.jobscript import GpuRequest

    site = parse_site_config(SITE)
    prober = Prober.for_site(site, budget_s=600)
    layers = json.dumps([["Linear", 2048, 2048]] * 16)   # 256 MiB of fp32 weights: Adam's states dominate
    spec = parse_workload_args(["--model", "mlp:" + layers, "--input", "2048", "--batch-size", "8",
                                "--optimizer", "adam", "--num-gpus", "2"])
    estimates, _ = prober.estimates(spec)
    nofit = place(estimates, GpuRequest(None, None, 2, 2), (), site)
    assert isinstance(nofit, NoFit)
    sharded = [a for a in advise(spec, site, prober, nofit, 2) if a.kind == "sharded"]
    fsdp2 = next(a for a in sharded if a.change.startswith("#VEST --parallelism fsdp2"))
    assert fsdp2.fits and fsdp2.num_gpus > 2 and "global batch" in fsdp2.text
    cap = prober.capacity("big")
    assert prober.needed(spec.with_(parallelism="fsdp2", num_gpus=fsdp2.num_gpus), "big") <= cap
    assert prober.needed(spec.with_(parallelism="fsdp2", num_gpus=fsdp2.num_gpus // 2), "big") > cap


def test_advice_shards_with_checkpointing_where_activations_keep_plain_sharding_out():
    """A decoder whose activations alone fill the GPU: sharding the states at any count does not
    close the gap, nor does checkpointing alone (the states stay whole); FSDP2 with the model's own
    checkpointing switch does, and advice names its smallest count (each answer an estimate)."""
    from vest_slurm.site.advice import Prober, advise
    from vest_slurm.site.config import parse_site_config
    from vest_slurm.site.placement import NoFit, place
    from vest_slurm.slurm.jobscript import GpuRequest

    site = parse_site_config(SITE.replace("memory_mib = 1000", "memory_mib = 1900"))
    prober = Prober.for_site(site, budget_s=600)
    spec = parse_workload_args(["--model", "hf:tiny-llama", "--batch-size", "4", "--input", "seq1024",
                                "--optimizer", "adam", "--model-arg", "hidden_size=1024", "--model-arg",
                                "intermediate_size=2752", "--model-arg", "num_hidden_layers=8",
                                "--model-arg", "vocab_size=512"])
    estimates, _ = prober.estimates(spec)
    nofit = place(estimates, GpuRequest(None, None, 1, 1), (), site)
    assert isinstance(nofit, NoFit)
    items = advise(spec, site, prober, nofit, 1)
    assert not next(a for a in items if a.kind == "checkpointing").fits
    (sharded,) = [a for a in items if a.kind == "sharded"]   # plain fsdp2 and zero3 would not close it
    n = sharded.num_gpus
    assert sharded.fits and sharded.text.startswith(f"fsdp2 with activation checkpointing over {n} x big")
    assert "--parallelism fsdp2 --num-gpus" in sharded.change and "--gradient-checkpointing on" in sharded.change
    cap = prober.capacity("big")
    variant = spec.with_(parallelism="fsdp2", gradient_checkpointing="on")
    assert prober.needed(variant.with_(num_gpus=n), "big") == sharded.needed_bytes <= cap
    assert n == 2 or prober.needed(variant.with_(num_gpus=n // 2), "big") > cap
    assert prober.needed(spec.with_(parallelism="fsdp2", num_gpus=8), "big") > cap


def test_torchrun_fsdp2_script_agrees_with_its_declarative_spec(monkeypatch):
    """scripts/examples/train_fsdp2.py (its own model class, fully_shard per block and the root,
    MixedPrecisionPolicy bf16/fp32, AdamW) run unmodified as rank 0 of 4 (dynamic/fake_dist.py),
    against the same workload declared: the same shards, the same tensors, peaks within 3%."""
    import os

    from vest_slurm.dynamic.launch import parse_train_command
    from vest_slurm.dynamic.runner import estimate_command
    from vest_slurm.estimate.estimator import estimate

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "examples")
    monkeypatch.chdir(examples)
    h100 = get_profile("h100-80gb")
    cmd = parse_train_command("torchrun --nproc_per_node 4 train_fsdp2.py --dim 256 --layers 3 --seq 256 --batch-size 2")
    (dyn,), run = estimate_command(cmd, [h100], cwd=examples)
    assert run.spec.parallelism == "fsdp2" and run.spec.num_gpus == 4
    assert (run.spec.param_dtype, run.spec.reduce_dtype, run.spec.optimizer) == ("bf16", "fp32", "adamw")
    declared = parse_workload_args(["--model", "train_fsdp2.py:build_model", "--model-arg", "dim=256", "--model-arg",
                                    "layers=3", "--input", "seq256", "--batch-size", "2", "--optimizer", "adamw",
                                    "--parallelism", "fsdp2", "--num-gpus", "4", "--param-dtype", "bf16",
                                    "--reduce-dtype", "fp32"])
    (dec,) = estimate(declared, [h100])
    d, c = dict(dyn.breakdown), dict(dec.breakdown)
    # every parameter of the model, cut by torch.chunk over 4 ranks (rank 0's padded shards), fp32
    model_shapes = [(32000, 256)] + [(768, 256), (256, 256), (256,), (256,), (256,), (256,), (1024, 256),
                                     (256, 1024)] * 3 + [(256,), (256,), (32000, 256)]
    padded = sum(_rank0_chunk(s, 4)[1] for s in model_shapes)
    assert d["parameters"] == c["parameters"] == padded * 4
    for part in ("gradients", "optimizer_state"):
        assert d[part] == c[part], part
    assert abs(d["live_tensor_peak"] - c["live_tensor_peak"]) <= 0.03 * c["live_tensor_peak"]
    assert abs(dyn.peak_bytes - dec.peak_bytes) <= 0.03 * dec.peak_bytes
    assert abs(dyn.required_bytes - dec.required_bytes) <= 0.03 * dec.required_bytes


def _small_gpu_site(tmp_path):
    """The site of the smallest-count tests: a 700 MiB 'small' GPU type, two to a node, and a
    16-layer MLP that needs several of them. Returns the config's path, its text and the layers."""
    import json

    text = SITE.replace("[policy]", '[gpu.small]\nprofile = "a100-40gb"\nmemory_mib = 700\ncontext_mib = 100\n'
                        '[partition.q]\ngpu_types = ["small"]\ngpus_per_node = 2\n[policy]')
    path = tmp_path / "site.toml"
    path.write_text(text)
    return path, text, json.dumps([["Linear", 2048, 2048]] * 16)


def test_vest_check_names_the_smallest_gpu_and_node_count_per_gpu_type(tmp_path, capsys):
    """vest check of a sharded job: per GPU type the smallest GPU count (and nodes of that type's
    partition) at which it fits per rank; one count fewer does not fit there."""
    import json

    from vest_slurm.cli import run
    from vest_slurm.site.advice import Prober
    from vest_slurm.site.config import parse_site_config

    path, text, layers = _small_gpu_site(tmp_path)
    argv = ["--model", "mlp:" + layers, "--input", "2048", "--batch-size", "8", "--optimizer", "adam",
            "--parallelism", "fsdp2", "--num-gpus", "2"]
    assert run(["check", *argv, "--site-config", str(path), "--no-search", "--json"]) in (0, 3)
    rows = {g["gpu"]: g for g in json.loads(capsys.readouterr().out)["gpus"]}
    site = parse_site_config(text)
    prober = Prober.for_site(site, budget_s=600)
    spec = parse_workload_args(argv)
    for gpu, per_node in (("big", 8), ("small", 2)):
        sm = rows[gpu]["smallest_gpus"]
        assert sm is not None, gpu
        n = sm["gpus"]
        assert sm["nodes"] == -(-n // per_node)
        assert prober.needed(spec.with_(num_gpus=n), gpu) <= prober.capacity(gpu)
        if n > 2:
            assert prober.needed(spec.with_(num_gpus=n // 2), gpu) > prober.capacity(gpu)
    assert rows["small"]["smallest_gpus"]["gpus"] >= rows["big"]["smallest_gpus"]["gpus"]


def test_vest_check_num_gpus_auto_estimates_at_the_smallest_count(tmp_path, capsys):
    """vest check --num-gpus auto: the workload is estimated at the fewest GPUs at which some GPU type
    holds it per rank (the smallest of the per-type counts), and placement is shown at that count."""
    import json

    from vest_slurm.cli import run

    path = tmp_path / "site.toml"
    path.write_text(SITE)
    layers = json.dumps([["Linear", 2048, 2048]] * 16)
    argv = ["--model", "mlp:" + layers, "--input", "2048", "--batch-size", "8", "--optimizer", "adam",
            "--parallelism", "fsdp2"]
    assert run(["check", *argv, "--num-gpus", "auto", "--site-config", str(path), "--no-search", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    n = doc["workload"]["num_gpus"]
    assert doc["num_gpus_auto"].startswith(f"--num-gpus auto: {n} GPU(s)")
    assert doc["placement"]["action"] != "refuse"
    counts = [g["smallest_gpus"]["gpus"] for g in doc["gpus"] if g["smallest_gpus"]]
    assert counts and n <= min(counts)   # smallest_gpu_counts doubles (2, 4, ...); auto tries every count on a node
    if n > 1:
        spec = parse_workload_args(argv)
        from vest_slurm.site.advice import Prober
        from vest_slurm.site.config import parse_site_config

        site = parse_site_config(SITE)
        prober = Prober.for_site(site, budget_s=600)
        assert all(prober.needed(spec.with_(num_gpus=n - 1), g.name) > prober.capacity(g.name) for g in site.gpus)


def _whole_and_scaled(spec):
    """(the unit trace of the whole model, the one sharded_trace made: scaled where it could)."""
    from vest_slurm.estimate import sharded_trace as st
    from vest_slurm.estimate import sharding
    from vest_slurm.estimate.models import build_model

    cspec = sharding.unit_spec(spec)
    st.forget_unit_traces()
    made = st.unit_trace(cspec, (9, 0), 80 * 2**30)
    with st._transformers_quiet(cspec):
        whole = st._unit_trace(cspec, build_model(cspec), (9, 0), 80 * 2**30)
    return whole, made


BF16_PARAMS = ("--param-dtype", "bf16", "--reduce-dtype", "fp32")


@pytest.mark.parametrize("extra", [("--parallelism", "fsdp2", *BF16_PARAMS),
                                   ("--parallelism", "fsdp", "--gradient-checkpointing", "on", *BF16_PARAMS),
                                   ("--parallelism", "fsdp2", "--gradient-checkpointing", "on", "--precision", "amp-bf16")])
def test_identical_blocks_scaled_equal_the_whole_trace(extra, monkeypatch, capsys):
    """A stack of 7 identical blocks, traced at 4 and 5 and scaled to 7 (block_scaling.py): the same
    allocations and frees, in the same order, as the trace of all 7 blocks; the per-rank estimate is
    the same to the byte (tolerance 0), and its output says the blocks were scaled. The last case:
    with autocast and checkpointing, autocast's cache of every block's weight casts is emptied at
    once at the forward's end (a sweep over the blocks: block 2's part repeated per copy)."""
    from vest_slurm.estimate import block_scaling as bs
    from vest_slurm.estimate.estimator import estimate
    from vest_slurm.estimate import sharded_trace as st

    spec = parse_workload_args(["--model", "hf:tiny-llama", "--model-arg", "num_hidden_layers=7", "--batch-size", "2",
                                "--input", "seq64", "--optimizer", "adamw", "--num-gpus", "4", *extra])
    whole, made = _whole_and_scaled(spec)
    assert any(n.startswith(bs.SCALED_NOTE) for n in made.notes), made.notes
    assert bs.same(made, whole), bs.first_difference(made, whole)
    h100 = get_profile("h100-80gb")
    (scaled,) = estimate(spec, [h100])
    from vest_slurm.cli import run

    argv = ["--model", "hf:tiny-llama", "--model-arg", "num_hidden_layers=7", "--batch-size", "2", "--input", "seq64",
            "--optimizer", "adamw", "--num-gpus", "4", *extra]
    capsys.readouterr()
    assert run(["estimate", *argv, "--gpu", "h100-80gb", "--json"]) == 0
    import json

    notes = json.loads(capsys.readouterr().out)["trace_notes"]
    scaled_notes = [n for n in notes if n.startswith(bs.SCALED_NOTE)]
    assert len(scaled_notes) == 1 and "7 blocks" in scaled_notes[0], notes
    # (and the per-rank model says what it is, for a sharded workload)
    assert any(" over 4 GPUs, per rank" in n for n in notes), notes
    st.forget_unit_traces()
    monkeypatch.setattr(bs, "MIN_BLOCKS", 99)   # trace it whole
    (full,) = estimate(spec, [h100])
    st.forget_unit_traces()
    assert scaled.breakdown == full.breakdown and scaled.peak_bytes == full.peak_bytes


def test_blocks_that_differ_in_what_they_compute_are_traced_whole():
    """Blocks of the same shapes whose forward depends on their index (every third one does extra
    work): the 4-block trace repeated is not the 5-block trace, so the model is traced whole, and
    the note says why."""
    from vest_slurm.estimate import block_scaling as bs

    model = f"{Path(__file__).parent / 'data' / 'user_models.py'}:index_dependent_blocks"
    spec = parse_workload_args(["--model", model, "--batch-size", "4", "--input", "64", "--optimizer", "adamw",
                                "--parallelism", "fsdp2", "--num-gpus", "2"])
    whole, made = _whole_and_scaled(spec)
    assert any(n.startswith(bs.WHOLE_NOTE) and "not the 5-block trace" in n for n in made.notes), made.notes
    assert bs.same(made, whole)


def test_vest_estimate_num_gpus_auto_names_the_smallest_count_per_gpu_type(tmp_path, capsys):
    """vest estimate --num-gpus auto: per GPU type the fewest GPUs at which the sharded job fits per
    rank (nodes of the type's partition), each row estimated at its count; one fewer does not fit."""
    import json

    from vest_slurm.cli import run
    from vest_slurm.site.advice import Prober
    from vest_slurm.site.config import parse_site_config

    path, text, layers = _small_gpu_site(tmp_path)
    argv = ["--model", "mlp:" + layers, "--input", "2048", "--batch-size", "8", "--optimizer", "adam",
            "--parallelism", "fsdp2"]
    assert run(["estimate", *argv, "--num-gpus", "auto", "--site-config", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["num_gpus"] == "auto"
    rows = {r["gpu"]: r for r in doc["estimates"]}
    site = parse_site_config(text)
    prober = Prober.for_site(site)
    spec = parse_workload_args(argv)
    for gpu, per_node in (("big", 8), ("small", 2)):
        n = rows[gpu]["num_gpus"]
        assert doc["num_gpus_auto"][gpu] == n and rows[gpu]["nodes"] == -(-n // per_node)
        at = spec.with_(num_gpus=n, gpus_per_node=per_node if n > per_node else 0)
        assert rows[gpu]["fits"] and prober.needed(at, gpu) <= prober.capacity(gpu)
        if n > 1:
            assert prober.needed(spec.with_(num_gpus=n - 1), gpu) > prober.capacity(gpu)
    assert rows["small"]["num_gpus"] > 1
    # not sharded: refused with the reason and what to write
    assert run(["estimate", *argv[:-2], "--num-gpus", "auto", "--site-config", str(path)]) != 0
    assert "applies to sharded jobs" in capsys.readouterr().err


# a root's shards, 7 identical blocks' (Llama's 9 tensors a block, as FSDP2 shards them), a last one
_OPT_SHAPES = ((40, 8), (8,)) + ((8, 8), (2, 8), (2, 8), (8, 8), (28, 8), (28, 8), (8, 28), (8,), (8,)) * 7 + ((40, 8),)


@pytest.mark.parametrize("optimizer,impl", [("adamw", "foreach"), ("adamw", "for-loop"), ("adam", "fused"),
                                            ("sgd-momentum", "foreach"), ("adagrad", "foreach"),
                                            ("rmsprop-centered", "for-loop"), ("adam-amsgrad", "foreach")])
def test_optimizer_on_identical_blocks_shards_scaled_equals_the_whole_trace(optimizer, impl, monkeypatch):
    """The optimizer stepped on 7 identical blocks' shards, traced with 4 and 5 of them and scaled
    (optimizer_scaling.py): every field of every event, which allocation each free frees and the
    step cuts, the same as the optimizer traced on all 7; also FSDP1's one flat shard per block."""
    from vest_slurm.estimate import optimizer_scaling as os_
    from vest_slurm.estimate import sharded_trace as st

    spec = parse_workload_args(["--model", "hf:tiny-llama", "--batch-size", "1", "--optimizer", optimizer,
                                "--optimizer-impl", impl])
    calls = []
    real = st._optimizer_events
    monkeypatch.setattr(st, "_optimizer_events", lambda *a: calls.append(len(a[1])) or real(*a))
    for shapes in (_OPT_SHAPES, ((100,),) + ((64,),) * 7 + ((100,),)):
        run = os_.repeated_run(shapes)
        assert run.count == 7 and run.cut(shapes, 4) == shapes[:run.start + 4 * run.period] + shapes[run.start + 7 * run.period:]
        st.optimizer_trace.cache_clear()
        calls.clear()
        made = st.optimizer_trace(spec, shapes, "float32", False)
        assert calls == [len(shapes) - 3 * run.period, len(shapes) - 2 * run.period]   # the 4- and 5-copy lists only
        whole = st._split(*real(spec, shapes, "float32", False))
        flat = lambda o: os_.canonical([*o.construct, *(e for s in o.steps for e in s)],   # noqa: E731
                                       [len(o.construct)] + [len(o.construct) + sum(map(len, o.steps[:i + 1]))
                                                             for i in range(len(o.steps))])
        assert flat(made) == flat(whole)
        assert any(e.action == "alloc" for e in whole.steps[0]) or optimizer == "sgd"


def test_optimizer_that_differs_per_copy_is_traced_whole():
    """A 4-copy trace that scaled to 5 is not the 5-copy trace (here: made up, the fifth copy
    allocates twice) is refused, so the caller traces the whole list."""
    from vest_slurm.estimate import optimizer_scaling as os_
    from vest_slurm.estimate.trace import AllocEvent

    def trace(copies, extra=False):
        ev = [AllocEvent("alloc", 1, 512, phase="optimizer")]
        for c in range(copies):
            ev.append(AllocEvent("alloc", 10 + c, 64, phase="optimizer"))
        if extra:
            ev.append(AllocEvent("alloc", 99, 64, phase="optimizer"))
        ev += [AllocEvent("free", 10 + c, 64, phase="optimizer") for c in reversed(range(copies))]
        return ev, [0, len(ev)]

    events, cuts = os_.scale(trace(4), trace(5), 7)
    assert os_.canonical(events, cuts) == os_.canonical(*trace(7))
    with pytest.raises(os_.NotPeriodic):
        os_.scale(trace(4), trace(5, extra=True), 7)


def test_torchtitan_logits_model_keeps_fp32_logits_through_backward():
    """benchmarks/models/torchtitan_logits.py (the torchtitan PR #165 rows' model at the loss): its
    output is the fp32 logits, alive when backward begins (torchtitan's train.py keeps `pred`), the bf16
    ones dropped; transformers' own model keeps its bf16 logits and upcasts only inside its loss."""
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "models", "torchtitan_logits.py")
    small = ["--model-arg", "hidden_size=48", "--model-arg", "intermediate_size=96", "--model-arg",
             "num_hidden_layers=2", "--model-arg", "num_attention_heads=2", "--model-arg", "num_key_value_heads=2",
             "--model-arg", "vocab_size=1000", "--batch-size", "2", "--input", "seq16", "--optimizer", "adamw",
             "--precision", "bf16"]

    def logits_sized_alive_at_backward(model):
        """(fp32, bf16) logits-sized blocks alive when backward begins."""
        ev = trace_for(parse_workload_args(["--model", model, *small]), get_profile("h100-80gb")).trace.events
        first_bwd = next(i for i, e in enumerate(ev) if e.phase == "backward")
        live = {}
        for e in ev[:first_bwd]:
            if e.action == "alloc":
                live[e.block] = e.size_bytes
            else:
                live.pop(e.block, None)
        n = 2 * 16 * 1000
        return sum(v == 4 * n for v in live.values()), sum(v == 2 * n for v in live.values())

    # the fp32 logits and log_softmax's saved fp32 output; no bf16 logits
    assert logits_sized_alive_at_backward(os.path.abspath(path) + ":llama2_7b") == (2, 0)
    # log_softmax's saved output, and the bf16 logits its output keeps
    assert logits_sized_alive_at_backward("hf:LlamaForCausalLM") == (1, 1)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_gradient_bucket_is_the_reduce_bucket_size_given(stage):
    """contiguous_gradients: ZeRO-2/3 keep one ipg buffer of reduce_bucket_size elements in the model
    dtype (or the model's size, if smaller): DeepSpeed's 5e8 by default, the job's own when it sets
    one (Lightning's DeepSpeedStrategy: 2e8); a bucket larger than the model costs the model's size."""
    total = sum(math.prod(sh) for sh in SHAPES)

    def bucket(*extra):
        tr = _summary(_spec(stage, 3, "--precision", "bf16", *extra)).trace
        (size,) = [e.size_bytes for e in tr.events if e.action == "alloc" and e.module == "zero_ipg_bucket"]
        return size

    assert bucket() == total * 2 == bucket("--reduce-bucket-size", "5e8")
    assert bucket("--reduce-bucket-size", "100") == 100 * 2
    assert bucket("--reduce-bucket-size", "7") == 7 * 2
    with pytest.raises(WorkloadError, match="ZeRO-2/3"):
        parse_workload_args(["--model", MLP, "--batch-size", "2", "--reduce-bucket-size", "2e8"])
    for bad in ("1.5", "inf", "nan", "-1", "2e12", "lots"):
        with pytest.raises(WorkloadError, match="whole number"):
            _spec(stage, 3, "--reduce-bucket-size", bad)


def test_zero3_keeps_the_blocks_it_uses_again_within_the_reuse_distance():
    """DeepSpeed releases a module's gathered parameters after its forward only where they are not
    fetched again within stage3_max_reuse_distance elements (1e9): the last blocks of the forward
    are used again in backward soon after, and stay gathered, more of them for a small model; a
    block whose forward runs again in backward (checkpointing) is fetched twice there. Exactly at
    the distance the block is released (DeepSpeed stops looking before the block's next use)."""
    from vest_slurm.estimate.sharding import Unit, zero3_kept_after_forward

    M = 1_000_000

    def units(block, root=100 * M, n=4, recomputed=False):
        out = [Unit("<root>", ((root,),), 0, 10 * n, 10 * n, 20 * n + 5, is_root=True)]
        for i in range(n):   # forward in order, backward in reverse
            out.append(Unit(f"h.{i}", ((block,),), 10 * i, 10 * i + 5, 10 * n + 10 * (n - 1 - i),
                            10 * n + 10 * (n - i) - 1, recomputed=recomputed))
        return out

    # last block: 100M (the root's output layer) between; h.2: 300 + 100 + 300 = 700M; h.1: 1300M
    assert zero3_kept_after_forward(units(300 * M), 10**9) == {"h.3", "h.2"}
    # recomputed: h.2 has 300 + 100 + 2 x 300 = 1000M between, exactly the distance: released
    assert zero3_kept_after_forward(units(300 * M, recomputed=True), 10**9) == {"h.3"}
    assert zero3_kept_after_forward(units(10 * M, n=8), 10**9) == {f"h.{i}" for i in range(8)}
    assert zero3_kept_after_forward(units(300 * M), 0) == set()

    # through the per-rank trace: every block of this small model stays gathered from its forward
    # to its backward (one all-gather each per step), unless the distance is 0
    def gathers(*extra):
        tr = _summary(_spec("zero3", 2, *extra)).trace
        return sum(e.action == "alloc" and e.module == "unsharded_params" for e in tr.events)

    kept, released = gathers(), gathers("--max-reuse-distance", "0")
    assert released > kept
    assert any("ZeRO-3 keeps" in n for n in _summary(_spec("zero3", 2)).trace.notes)
    with pytest.raises(WorkloadError, match="ZeRO-3"):
        _spec("fsdp2", 2, "--max-reuse-distance", "0")
    with pytest.raises(WorkloadError, match="whole number"):
        _spec("zero3", 2, "--max-reuse-distance", "lots")


def test_zero3_parameter_offload_is_flagged_not_silent():
    """ZeRO-3's offloaded parameters leave a working set on the GPU that the model does not size
    (a published run came out 31% above the estimate): such an estimate carries a flag, shown in
    the table and the JSON; ZeRO-3 without parameter offload, and optimizer offload, do not."""
    import json

    from vest_slurm.estimate.estimator import estimate
    from vest_slurm.estimate.report import estimate_json, estimate_table
    from vest_slurm.estimate.workload import ZERO3_OFFLOAD_FLAG

    spec = _spec("zero3", 2, "--offload", "params")
    assert spec.flags == (ZERO3_OFFLOAD_FLAG,)
    assert _spec("zero3", 2, "--offload", "optimizer").flags == () == _spec("zero3", 2).flags
    est = estimate(spec, [get_profile("a100-80gb")])
    assert json.loads(estimate_json(spec, est))["flags"] == [ZERO3_OFFLOAD_FLAG]
    assert "FLAGGED: " + ZERO3_OFFLOAD_FLAG in estimate_table(spec, est)


def test_the_job_pythons_torch_decides_the_fsdp_schedule(monkeypatch, tmp_path):
    """A job whose command runs another Python: its torch (asked of it) is the one FSDP is modelled
    as ($VEST_JOB_TORCH set for that estimate, dropped for the next job that runs this Python); the
    site's or the user's own setting is kept."""
    import os
    import sys

    from vest_slurm.estimate import sharding

    monkeypatch.delenv("VEST_JOB_TORCH", raising=False)
    python = tmp_path / "env" / "bin" / "python"   # a Python that answers as a torch 2.4.1 build does
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho \'["2.4.1+cu124", "12.4", 90100, [3, 11]]\'\n')
    python.chmod(0o755)
    note = sharding.use_job_torch(str(python))
    assert "2.4.1+cu124" in note and sharding.job_torch_version() == (2, 4)
    assert sharding.use_job_torch(sys.executable) == "" and "VEST_JOB_TORCH" not in os.environ
    monkeypatch.setenv("VEST_JOB_TORCH", "2.3")
    assert sharding.use_job_torch(str(python)) == "" and sharding.job_torch_version() == (2, 3)


def test_gpu_types_of_one_class_share_the_unit_trace(monkeypatch):
    """The A100 and the H100 (both sm80+) build every GPU count of a sharding alternative from one
    trace of the unsharded model, as they share a job's trace on one GPU; the V100 makes its own."""
    from vest_slurm.estimate import sharded_trace as st

    made = []
    real = st._traced_units
    monkeypatch.setattr(st, "_traced_units", lambda *a: made.append(a[1:]) or real(*a))
    st.forget_unit_traces()
    spec = parse_workload_args(["--model", "hf:tiny-llama", "--batch-size", "2", "--input", "seq64", "--optimizer",
                                "adamw", "--parallelism", "fsdp2", "--param-dtype", "bf16", "--reduce-dtype", "fp32"])
    for n, gpu in ((2, "a100-40gb"), (4, "h100-80gb"), (2, "h100-80gb"), (2, "v100-16gb")):
        p = get_profile(gpu)
        st.trace_sharded(spec.with_(num_gpus=n), p.capability, p.total_bytes)
    st.forget_unit_traces()
    assert made == [((8, 0), get_profile("a100-40gb").total_bytes), ((7, 0), get_profile("v100-16gb").total_bytes)]


@pytest.mark.parametrize("optimizer,resized", [("adamw", True), ("adamw-8bit", False)])
def test_optimizer_traces_of_further_gpu_counts_are_resized_where_two_counts_agree(optimizer, resized, monkeypatch):
    """The optimizer's trace on one rank's shards at GPU counts 2, 4, 8, 16: where the trace at 2,
    its sizes mapped tensor by tensor, is the trace at 4 exactly (AdamW: states and temporaries of
    its tensors' shapes), 8 and 16 are resized from it, not traced, and equal what tracing them
    gives. bitsandbytes' 8-bit AdamW keeps per-block scales whose sizes are no tensor's: never
    resized, every count traced."""
    from vest_slurm.estimate import sharded_trace as st
    from vest_slurm.estimate.sharding import shard_layout, unit_spec

    spec = parse_workload_args(["--model", "hf:tiny-llama", "--model-arg", "num_hidden_layers=7", "--batch-size", "2",
                                "--input", "seq64", "--optimizer", optimizer, "--parallelism", "fsdp2",
                                "--num-gpus", "2"])
    ut = st.unit_trace(unit_spec(spec), (9, 0), 80 * 2**30)
    traced, real = [], st._traced_optimizer
    monkeypatch.setattr(st, "_traced_optimizer", lambda *a: traced.append(a) or real(*a))
    monkeypatch.setattr(st, "_FAMILIES", {})
    st.optimizer_trace.cache_clear()
    for n in (2, 4, 8, 16):
        sp = spec.with_(num_gpus=n)
        layout = shard_layout(ut.units, sp)
        args = (sp.with_(num_gpus=1, parallelism="none"), layout.optimizer_tensors, layout.optimizer_dtype, False)
        made = st.optimizer_trace(*args)
        assert st._canonical(made) == st._canonical(real(*args))
    assert len(traced) == (2 if resized else 4)
    st.optimizer_trace.cache_clear()


@pytest.mark.parametrize("parallelism, extra", [("fsdp", ()), ("fsdp2", ("--param-dtype", "bf16")),
                                                ("zero2", ("--precision", "bf16"))])
def test_gradient_accumulation_keeps_what_the_earlier_micro_batches_leave(parallelism, extra):
    """`--grad-accum 4` with a sharded strategy was traced as one micro-batch with nothing of the
    others (and the unit trace ran all four through one set of unit marks): the accumulating ranks'
    gradients were missing. FSDP keeps each unit's unsharded gradient in the param dtype under
    no_sync (accelerate's and the Trainer's accumulation) from the last micro-batch's forward to
    its reduce-scatter; ZeRO-2 its reduced partition. Said in the trace's notes."""
    one = _summary(_spec(parallelism, 3, *extra))
    four = _summary(_spec(parallelism, 3, "--grad-accum", "4", *extra))
    units = [7 * 11 + 7, 5 * 7 + 5, 3 * 5 + 3]
    acc = [e for e in four.trace.events if e.action == "alloc" and e.module.endswith("(accumulated)")]
    if parallelism.startswith("fsdp"):
        itemsize = 2 if "bf16" in extra else 4
        assert sorted(e.size_bytes for e in acc) == sorted(n * itemsize for n in units * 2)   # each step's
        assert any("unsharded on each rank (FSDP's no_sync" in n for n in four.trace.notes)
        assert four.trace.live_peak_bytes() > one.trace.live_peak_bytes()
    else:
        assert not acc
        kept = [e for e in four.trace.events if e.action == "alloc" and e.category == "gradient" and e.phase == "forward"]
        assert len(kept) == 2 * len(units), "the reduced partitions are there from the forward on"
        assert four.trace.live_peak_bytes() >= one.trace.live_peak_bytes()
    forwards = [e for e in one.trace.events if e.phase == "forward" and e.action == "alloc"]
    assert len([e for e in four.trace.events if e.phase == "forward" and e.action == "alloc"
                and not e.module.endswith("(accumulated)") and e.category != "gradient"]) == len(forwards)
