"""Sharded training scripts run unmodified as one rank of a fake process group (dynamic/fake_dist.py):
FSDP1 (FullyShardedDataParallel with an auto-wrap policy, MixedPrecision, each sharding strategy)
and FSDP2 scripts that check what fully_shard made of their model, each against the same workload
declared (estimate/sharding.py): the same shards exactly, peaks within 3%."""

from __future__ import annotations

import os

import pytest

from vest_slurm.dynamic.launch import parse_train_command
from vest_slurm.dynamic.runner import estimate_command
from vest_slurm.errors import EstimateError
from vest_slurm.estimate.estimator import estimate
from vest_slurm.estimate.profiles import get_profile
from vest_slurm.estimate.sharding import flat_shard_numel
from vest_slurm.estimate.workload import parse_workload_args

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "scripts")


def _agree(dyn, dec, bound=0.03):
    d, c = dict(dyn.breakdown), dict(dec.breakdown)
    for part in ("parameters", "gradients", "optimizer_state"):
        assert d[part] == c[part], (part, d[part], c[part])
    for part in ("live_tensor_peak", "allocator_peak_reserved"):
        assert abs(d[part] - c[part]) <= bound * c[part], (part, d[part], c[part])
    assert abs(dyn.peak_bytes - dec.peak_bytes) <= bound * dec.peak_bytes
    assert abs(dyn.required_bytes - dec.required_bytes) <= bound * dec.required_bytes


def _fsdp1_unit_numels(width=256, blocks=3, features=48, classes=100):
    """FSDP1's flat parameter per unit: each residual block, and the root's stem, final norm, head."""
    block = 2 * 2 * width + (3 * width * width + width * width) + (2 * width * width + 2 * width) + (width * width + width)
    root = (features * width + width) + 2 * width + (width * classes + classes)
    return [root] + [block] * blocks


@pytest.mark.parametrize("strategy,sharding,nproc,gpus", [
    ("FULL_SHARD", "full-shard", 4, 4),
    ("SHARD_GRAD_OP", "shard-grad-op", 4, 4),
    ("HYBRID_SHARD", "hybrid-shard", 2, 4),    # torchrun --nnodes 2 --nproc_per_node 2: shard group of 2
])
def test_torchrun_fsdp1_script_agrees_with_its_declarative_spec(monkeypatch, strategy, sharding, nproc, gpus):
    monkeypatch.chdir(SCRIPTS)
    h100 = get_profile("h100-80gb")
    cmd = parse_train_command(f"torchrun --nnodes {gpus // nproc} --nproc_per_node {nproc} fsdp1_train.py "
                              f"--strategy {strategy} --width 256 --blocks 3 --batch-size 8")
    (dyn,), run = estimate_command(cmd, [h100], num_gpus=gpus, cwd=SCRIPTS)
    s = run.spec
    assert (s.parallelism, s.sharding, s.num_gpus) == ("fsdp", sharding, gpus)
    assert (s.param_dtype, s.reduce_dtype, s.optimizer, s.weight_decay) == ("bf16", "fp32", "adamw", 0.1)
    group = nproc if sharding.startswith("hybrid") else gpus
    extra = ["--shard-group-size", str(nproc)] if sharding.startswith("hybrid") else []
    declared = parse_workload_args(["--model", "fsdp1_train.py:build_model", "--model-arg", "width=256",
                                    "--model-arg", "blocks=3", "--input", "64x48", "--batch-size", "8",
                                    "--optimizer", "adamw", "--weight-decay", "0.1", "--parallelism", "fsdp",
                                    "--sharding", sharding, *extra, "--num-gpus", str(gpus),
                                    "--param-dtype", "bf16", "--reduce-dtype", "fp32"])
    (dec,) = estimate(declared, [h100])
    shard = sum(flat_shard_numel(n, group) for n in _fsdp1_unit_numels())
    assert dict(dyn.breakdown)["parameters"] == shard * 4   # fp32 flat shards, padded per unit
    _agree(dyn, dec)
    if sharding.startswith("hybrid"):   # the replicate group's communicator besides the shard group's
        assert dict(dyn.breakdown)["nccl"] == 2 * dict(
            estimate(declared.with_(sharding="full-shard", shard_group_size=0), [h100])[0].breakdown)["nccl"]


def test_torchruns_nodes_count_in_the_world(monkeypatch):
    """torchrun --nnodes 2 --nproc_per_node 2 is 4 ranks, sharding over 4 (the world was taken as
    one node's 2, and each rank's shards twice their size); --nnodes $SLURM_NNODES without the job's
    GPU count is estimated over one node, and flagged."""
    monkeypatch.chdir(SCRIPTS)
    h100 = get_profile("h100-80gb")
    args = "fsdp1_train.py --strategy FULL_SHARD --width 256 --blocks 3 --batch-size 8"
    (two,), run = estimate_command(parse_train_command(f"torchrun --nnodes 2 --nproc_per_node 2 {args}"), [h100],
                                   cwd=SCRIPTS)
    assert run.spec.num_gpus == 4 and not run.spec.flags
    assert dict(two.breakdown)["parameters"] == sum(flat_shard_numel(n, 4) for n in _fsdp1_unit_numels()) * 4
    (one,), run = estimate_command(parse_train_command(f"torchrun --nnodes $SLURM_NNODES --nproc_per_node 2 {args}"),
                                   [h100], cwd=SCRIPTS)
    assert run.spec.num_gpus == 2 and any("give --num-gpus" in f for f in run.spec.flags)
    assert dict(one.breakdown)["parameters"] == sum(flat_shard_numel(n, 2) for n in _fsdp1_unit_numels()) * 4


def test_fsdp1_no_shard_is_refused_with_the_data_parallel_advice(monkeypatch):
    monkeypatch.chdir(SCRIPTS)
    cmd = parse_train_command("torchrun --nproc_per_node 2 fsdp1_train.py --strategy NO_SHARD --steps 3")
    with pytest.raises(EstimateError) as e:
        estimate_command(cmd, [get_profile("h100-80gb")], cwd=SCRIPTS)
    assert "NO_SHARD" in e.value.what and e.value.kind == "vest-unsupported" and "--num-gpus" in e.value.fix


def test_fsdp2_script_on_meta_checks_fsdp_module_and_agrees_with_its_declarative_spec(monkeypatch):
    """fully_shard makes the module an FSDPModule (a class FSDP<Net>), its parameters answer Shard(0)
    placements, and to_empty on the GPU materializes them (pytorch/examples' FSDP2 example does all
    three): estimated, and the same as the workload declared (the loss is the model's own output)."""
    monkeypatch.chdir(SCRIPTS)
    h100 = get_profile("h100-80gb")
    cmd = parse_train_command("torchrun --nproc_per_node 2 fsdp2_meta_train.py --layers 4 --dim 192 --batch-size 16")
    (dyn,), run = estimate_command(cmd, [h100], cwd=SCRIPTS)
    assert (run.spec.parallelism, run.spec.num_gpus, run.spec.optimizer) == ("fsdp2", 2, "adam")
    declared = parse_workload_args(["--model", "fsdp2_meta_train.py:build_model", "--model-arg", "dim=192",
                                    "--model-arg", "layers=4", "--input", "seq128", "--batch-size", "16",
                                    "--optimizer", "adam", "--parallelism", "fsdp2", "--num-gpus", "2"])
    (dec,) = estimate(declared, [h100])
    d, c = dict(dyn.breakdown), dict(dec.breakdown)
    for part in ("parameters", "gradients", "optimizer_state"):
        assert d[part] == c[part], part
    assert abs(dyn.peak_bytes - dec.peak_bytes) <= 0.03 * dec.peak_bytes


def test_accelerate_launch_with_an_fsdp_config_file(monkeypatch):
    """``accelerate launch --config_file accelerate_fsdp.yaml``: accelerate's own launcher code turns the
    config into the script's environment (dynamic/accelerate_env.py), Accelerator().prepare wraps the
    model with FSDP1 as configured (FULL_SHARD, LlamaDecoderLayer units, bf16 MixedPrecision), over the
    config's 4 processes; the same shards as the workload declared. The live-tensor peak is higher than
    the declared one by the fp32 logits accelerate's autocast leaves for the loss (batch x seq x vocab
    x 4 B), which the declarative compute spec (bf16 weights, no autocast) does not make."""
    monkeypatch.chdir(SCRIPTS)
    h100 = get_profile("h100-80gb")
    cmd = parse_train_command("accelerate launch --config_file accelerate_fsdp.yaml accelerate_fsdp_train.py --batch-size 4")
    (dyn,), run = estimate_command(cmd, [h100], cwd=SCRIPTS)
    s = run.spec
    assert (s.parallelism, s.sharding, s.num_gpus, s.param_dtype, s.reduce_dtype) == ("fsdp", "full-shard", 4, "bf16", "bf16")
    declared = parse_workload_args(["--model", "accelerate_fsdp_train.py:build_model", "--input", "seq128",
                                    "--batch-size", "4", "--optimizer", "adamw", "--weight-decay", "0",
                                    "--parallelism", "fsdp", "--num-gpus", "4", "--param-dtype", "bf16",
                                    "--reduce-dtype", "bf16"])
    (dec,) = estimate(declared, [h100])
    d, c = dict(dyn.breakdown), dict(dec.breakdown)
    for part in ("parameters", "gradients", "optimizer_state"):
        assert d[part] == c[part], part
    logits_fp32 = 4 * 128 * 4000 * 4
    assert 0 <= d["live_tensor_peak"] - c["live_tensor_peak"] <= 1.05 * logits_fp32
    assert abs(dyn.peak_bytes - dec.peak_bytes) <= 0.03 * dec.peak_bytes


def test_accelerate_launch_options_take_their_values():
    """accelerate launch's many valued options (--fsdp_sharding_strategy X, --zero_stage 2) are not
    taken for the script; the config file and the options are kept for the child."""
    cmd = parse_train_command("accelerate launch --use_fsdp --fsdp_sharding_strategy FULL_SHARD --num_processes 2 "
                              "--config_file a.yaml train.py --lr 1")
    assert cmd.script == "train.py" and cmd.args == ("--lr", "1") and cmd.nproc == 2
    assert cmd.config_file == "a.yaml"
    assert cmd.launcher_args == ("--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD", "--num_processes", "2",
                                 "--config_file", "a.yaml")


def test_hf_trainer_with_fsdp_arguments(monkeypatch):
    """transformers' Trainer with --fsdp "full_shard auto_wrap" --fsdp_config (its arguments from the
    command line, torchrun over 4): the Trainer leaves the model on the CPU and accelerate shards it with
    fully_shard (FSDP2, bf16 policy), which moves it to the GPU; the same shards and optimizer states as
    the workload declared. accelerate keeps its tail units (final norm, LM head) unsharded after forward
    and reshards its blocks: each unit is modelled with its own setting (they were all modelled as
    off, which kept every block gathered into backward: +12.6% on a 13M GPT-2): the declared workload
    with every unit resharding is its peak."""
    monkeypatch.chdir(SCRIPTS)
    h100 = get_profile("h100-80gb")
    cmd = parse_train_command("torchrun --nproc_per_node 4 hf_trainer_args_train.py --output_dir out --fsdp "
                              "'full_shard auto_wrap' --fsdp_config hf_fsdp_config.json --bf16 "
                              "--per_device_train_batch_size 4 --max_steps 10")
    (dyn,), run = estimate_command(cmd, [h100], cwd=SCRIPTS)
    s = run.spec
    assert (s.parallelism, s.num_gpus, s.param_dtype, s.optimizer, s.reshard_after_forward) == \
        ("fsdp2", 4, "bf16", "adamw", "on")
    declared = {raf: parse_workload_args(["--model", "hf_trainer_args_train.py:build_model", "--input", "seq128",
                                          "--batch-size", "4", "--optimizer", "adamw", "--optimizer-impl",
                                          s.optimizer_impl, "--weight-decay", str(s.weight_decay), "--parallelism",
                                          "fsdp2", "--num-gpus", "4", "--param-dtype", "bf16", "--reduce-dtype",
                                          s.reduce_dtype, "--reshard-after-forward", raf]) for raf in ("on", "off")}
    (on,), (off,) = (estimate(declared[raf], [h100]) for raf in ("on", "off"))
    d, c = dict(dyn.breakdown), dict(on.breakdown)
    for part in ("parameters", "optimizer_state"):
        assert d[part] == c[part], part
    assert abs(dyn.peak_bytes - on.peak_bytes) <= 0.03 * on.peak_bytes, (dyn.peak_bytes, on.peak_bytes, off.peak_bytes)


def test_fsdp2_units_keep_their_own_reshard_after_forward():
    """Blocks resharded after forward and a small tail unit kept unsharded (accelerate's wrapping):
    modelled per unit, the tail costs its own unsharded size, not every block's (the one setting for
    all units was off, and the eight 1 MiB blocks stayed gathered into backward)."""
    h100 = get_profile("h100-80gb")
    live = {}
    for flag in ("", "--uniform"):
        cmd = parse_train_command(f"torchrun --nproc_per_node 2 fsdp2_mixed_reshard_train.py {flag}".strip())
        (est,), run = estimate_command(cmd, [h100], cwd=SCRIPTS)
        assert run.spec.reshard_after_forward == "on"
        live[flag] = dict(est.breakdown)["live_tensor_peak"]
    tail = 4 * (512 + 512 + 512 * 16 + 16)   # the norm's and the head's parameters, unsharded
    assert 0 <= live[""] - live["--uniform"] <= 2 * tail, live
    # what of the script's own schedule the per-rank model does not follow is flagged with the estimate
    cmd = parse_train_command("torchrun --nproc_per_node 2 fsdp2_mixed_reshard_train.py --prefetch")
    (est,), run = estimate_command(cmd, [h100], cwd=SCRIPTS)
    assert any("forward prefetch" in f and "not modelled" in f for f in run.flags), run.flags


def test_deepspeed_initialize_and_ray_init_in_the_script_are_refused_with_the_reason(tmp_path):
    """A script that builds its DeepSpeed config in the code and calls deepspeed.initialize, with no
    DeepSpeed on its command line (DeepSpeedExamples' cifar): DeepSpeed then built its ops with nvcc
    (116 s), skipped every step on fake overflow checks, or ran ZeRO-3 untraced as such, labelled
    data parallel. The post-import hook refuses the call with the workload its config describes."""
    import types

    from vest_slurm.dynamic.deepspeed_plan import plan_of_initialize
    from vest_slurm.dynamic.post_import import HOOKS
    from vest_slurm.errors import NotSupportedHere

    deepspeed = types.ModuleType("deepspeed")   # (its initialize, as the installed package has it)
    HOOKS["deepspeed"](deepspeed)
    config = {"train_batch_size": 16, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(NotSupportedHere) as e:
        deepspeed.initialize(args=None, model=None, model_parameters=[], config=config)
    assert "deepspeed.initialize" in str(e.value)
    assert "--parallelism zero3 --offload optimizer --precision bf16" in str(e.value)
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true}}')
    assert plan_of_initialize(None, types.SimpleNamespace(deepspeed_config=str(path))).vest_line.startswith(
        "#VEST --model ... --parallelism zero2 --precision fp16")
    assert plan_of_initialize(None).stage is None   # not read: said so, the stage asked of the user
    # Ray (Train's TorchTrainer, Tune): its workers run the training in processes of their own
    ray = types.ModuleType("ray")
    HOOKS["ray"](ray)
    with pytest.raises(NotSupportedHere, match="worker processes"):
        ray.init()


@pytest.mark.parametrize("command,line,gpus", [
    ("torchrun --nproc_per_node 4 hf_trainer_args_train.py --output_dir out --deepspeed ds_zero3.json --bf16",
     "--parallelism zero3 --offload optimizer --precision bf16", 4),
    ("accelerate launch --config_file accelerate_deepspeed.yaml accelerate_fsdp_train.py",
     "--parallelism zero2 --precision bf16", 4),
    # a script that builds its DeepSpeed config from its own switches (DeepSpeed-Chat's main.py):
    # the line said that stage as "zero2 (its stage: 1, 2 or 3)" whatever --zero_stage was
    ("deepspeed --num_gpus 2 hf_trainer_args_train.py --deepspeed --zero_stage 3 --offload --dtype bf16",
     "--parallelism zero3 --offload params --precision bf16", 2),
    ("torchrun --nproc_per_node 2 hf_trainer_args_train.py --deepspeed --zero_stage 0", "--parallelism ddp", 2),
])
def test_deepspeed_is_refused_with_its_declarative_zero_workload(monkeypatch, command, line, gpus):
    """DeepSpeed is not traced (dynamic/deepspeed_plan.py): a Trainer's --deepspeed ds.json and an
    accelerate DeepSpeed config are refused before any run, as vest's gap, with the #VEST line of the
    ZeRO stage, offload and precision they ask for (the per-rank model of estimate/sharding.py)."""
    monkeypatch.chdir(SCRIPTS)
    with pytest.raises(EstimateError) as e:
        estimate_command(parse_train_command(command), [get_profile("h100-80gb")], cwd=SCRIPTS)
    assert e.value.kind == "vest-unsupported" and "DeepSpeed" in e.value.what
    assert line in e.value.fix
    # the job's GPU count, where the launch says it (the batch, where the command does)
    assert f"--num-gpus {gpus} " in e.value.fix, e.value.fix


def test_a_deepspeed_configs_reduce_bucket_is_in_its_vest_line(tmp_path):
    """reduce_bucket_size from the DeepSpeed JSON (a number, often written 2e8) is carried into the
    #VEST line of ZeRO-2/3, whose gradient bucket it sizes; "auto" (transformers' hidden_size^2) and
    ZeRO-1 leave it out, and the line parses back into that workload."""
    from vest_slurm.dynamic.deepspeed_plan import _from_ds_json
    from vest_slurm.estimate.workload import parse_vest_line

    def line(zero):
        return _from_ds_json({"zero_optimization": zero, "bf16": {"enabled": True}}, "ds.json").vest_line

    assert "--reduce-bucket-size 200000000" in line({"stage": 3, "reduce_bucket_size": 2e8})
    assert "--reduce-bucket-size" not in line({"stage": 3, "reduce_bucket_size": "auto"})
    assert "--reduce-bucket-size" not in line({"stage": 1, "reduce_bucket_size": 2e8})
    words = line({"stage": 2, "reduce_bucket_size": 50000000}).split()
    spec = parse_vest_line(" ".join(["--model", "hf:gpt2", "--batch-size", "2", "--num-gpus", "4",
                                     *words[words.index("--parallelism"):words.index("--num-gpus")]]))
    assert spec.reduce_bucket_size == 50_000_000 and spec.parallelism == "zero2"
    # ZeRO-3's stage3_max_reuse_distance likewise (0 is a setting: release after every use)
    words = line({"stage": 3, "stage3_max_reuse_distance": 0}).split()
    assert "--max-reuse-distance 0" in " ".join(words)
    assert "--max-reuse-distance" not in line({"stage": 3}) + line({"stage": 2, "stage3_max_reuse_distance": 0})
    spec = parse_vest_line(" ".join(["--model", "hf:gpt2", "--batch-size", "2", "--num-gpus", "4",
                                     *words[words.index("--parallelism"):words.index("--num-gpus")]]))
    assert spec.max_reuse_distance == 0 and spec.parallelism == "zero3"


def test_a_mesh_reached_through_another_import_path_is_the_stand_in():
    """init_device_mesh imported from torch.distributed._tensor.device_mesh (bound before the run
    started) is the stand-in too, as is init_process_group where device_mesh.py binds it: before,
    the real DeviceMesh waited for the second rank until the time limit and the user was told to
    make the script reach its step sooner. The tensor-parallel example it stands for is estimated."""
    import time

    t0 = time.monotonic()
    (e,), run = estimate_command(parse_train_command(["torchrun", "--nproc_per_node", "2", "tp_mesh_alias.py"]),
                                 [get_profile("a100-80gb")], cwd=SCRIPTS)
    assert time.monotonic() - t0 < 60   # not the 120 s limit
    # Linear(10, 32) column-parallel and Linear(32, 5) row-parallel over 2 ranks, fp32
    assert dict(e.breakdown)["parameters"] == 4 * ((16 * 10 + 16) + (5 * 16 + 5))


def _tp_parts(command, gpu="h100-80gb"):
    from vest_slurm.estimate.estimator import DDP_BUCKET_BLOCK, _events_for, summarize

    (e,), run = estimate_command(parse_train_command(command), [get_profile(gpu)], cwd=SCRIPTS)
    s = script_spec_of(run)
    # a multi-rank script that wraps nothing in DDP gets no DDP buckets from the estimator
    assert not any(ev.block == DDP_BUCKET_BLOCK for ev in _events_for(run.trace.events, get_profile(gpu), s,
                                                                     summarize(run.trace, 0.0)))
    return dict(e.breakdown), e, run


def script_spec_of(run):
    from vest_slurm.dynamic.runner import script_spec

    return script_spec(parse_train_command("torchrun --nproc_per_node 4 tp_train.py"), run, 4, "")


@pytest.mark.parametrize("extra", ["", "--sp", "--heads 8"])
def test_tensor_parallel_script_holds_one_ranks_shards(monkeypatch, extra):
    """parallelize_module with torch's ParallelStyles (dynamic/fake_tp.py): the rank's parameters,
    gradients and AdamW states are exactly its shards (uneven sizes: the first rank's ceil(n/4)), and
    every part equals the same rank built by hand from modules of the local sizes with each
    collective's new tensor made explicitly; with sequence parallelism, a wrong layout anywhere
    breaks the shapes of the residual stream. --heads: q/k/v kept as DTensors (use_local_output=False)
    and viewed to the model's 8 heads, as the TP tutorial's attention does (2 heads per rank)."""
    monkeypatch.chdir(SCRIPTS)
    tp, e, run = _tp_parts(f"torchrun --nproc_per_node 4 tp_train.py {extra}")
    hand, h, _ = _tp_parts(f"torchrun --nproc_per_node 4 tp_train.py {extra} --by-hand")
    d, hidden, vocab = 256, 258, 501   # 1032 and 2001 over 4 ranks, the latter rounded up
    block = 2 * d + (hidden * d + hidden) + (d * hidden + d) + (4 * (d // 4) * d if extra == "--heads 8" else 0)
    params = 4 * (vocab * d + 2 * block + 2 * d + vocab * d)
    assert tp["parameters"] == params and tp["gradients"] == params and tp["optimizer_state"] == 2 * params
    for part in ("parameters", "gradients", "optimizer_state", "live_tensor_peak", "nccl"):
        assert tp[part] == hand[part], part
    # the allocator's segments: the tensor-parallel run first made the whole model on the GPU, as the
    # script does (model.cuda(), then parallelize_module), the one by hand never did
    assert abs(tp["allocator_peak_reserved"] - hand["allocator_peak_reserved"]) <= 2 * 2**20
    assert tp["nccl"] > 0 and abs(e.peak_bytes - h.peak_bytes) <= 2 * 2**20
    assert any("tensor parallelism (parallelize_module) over 4 ranks" in n for n in run.trace.notes)
    if extra == "--sp":
        assert any("SequenceParallel x3" in n for n in run.trace.notes)


@pytest.mark.parametrize("sp", ["", "--sp"])
def test_fsdp2_over_a_2d_mesh_with_tensor_parallelism_shards_the_tensor_parallel_shards(monkeypatch, sp):
    """fully_shard over mesh["dp"] of a model parallelize_module sharded over mesh["tp"] (the 2-D
    recipe): each rank holds FSDP2's dim-0 shard (over dp, padded) of its tensor-parallel shard, the
    job takes dp x tp GPUs, and NCCL a communicator per dimension."""
    monkeypatch.chdir(SCRIPTS)
    (e,), run = estimate_command(parse_train_command(f"torchrun --nproc_per_node 4 tp_train.py --dp 2 {sp}"),
                                 [get_profile("h100-80gb")], cwd=SCRIPTS)
    (one,), _ = estimate_command(parse_train_command("torchrun --nproc_per_node 2 tp_train.py"),
                                 [get_profile("h100-80gb")], cwd=SCRIPTS)
    s = run.spec
    assert (s.parallelism, s.num_gpus, s.tensor_parallel) == ("fsdp2", 4, 2)
    d, hidden, vocab = 256, 516, 1001   # the tensor-parallel shards over 2 ranks

    def fsdp2(*shape):   # Shard(0) over dp=2, padded to even chunks
        n = -(-shape[0] // 2)
        for x in shape[1:]:
            n *= x
        return n

    block = 2 * fsdp2(d) + fsdp2(hidden, d) + fsdp2(hidden) + fsdp2(d, hidden) + fsdp2(d)
    params = 4 * (fsdp2(vocab, d) + 2 * block + 2 * fsdp2(d) + fsdp2(vocab, d))
    parts, alone = dict(e.breakdown), dict(one.breakdown)
    assert parts["parameters"] == params and parts["gradients"] == params and parts["optimizer_state"] == 2 * params
    assert parts["nccl"] == 2 * alone["nccl"]
    assert any("2 data-parallel x 2 tensor-parallel" in n for n in run.trace.notes)


def test_a_row_parallel_layer_of_uneven_features_fails_as_on_a_gpu(monkeypatch):
    """DTensor.from_local takes a rank's input features as an even shard: 1030 over 4 ranks fails on
    GPUs (sharding propagation, a and b must have same reduction dim), so the script's own error,
    not an estimate."""
    monkeypatch.chdir(SCRIPTS)
    with pytest.raises(EstimateError) as e:
        estimate_command(parse_train_command("torchrun --nproc_per_node 4 tp_train.py --hidden 1030"),
                         [get_profile("h100-80gb")], cwd=SCRIPTS)
    assert e.value.kind == "script-error" and "1030 input features" in str(e.value), str(e.value)


@pytest.mark.parametrize("source,api", [
    ("from torch.distributed.tensor import distribute_tensor, Shard\n"
     "w = distribute_tensor(torch.randn(64, 64, device='cuda'), mesh, [Shard(0)])\n",
     "torch.distributed.tensor.distribute_tensor"),
    ("from torch.distributed.tensor.parallel import parallelize_module, ParallelStyle\n"
     "class Mine(ParallelStyle):\n    def _apply(self, module, mesh):\n        return module\n"
     "m = parallelize_module(nn.Linear(8, 8).cuda(), mesh, Mine())\n", "the ParallelStyle __main__.Mine"),
    ("from torch.distributed.fsdp import fully_shard\n"
     "from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel\n"
     "m = nn.Sequential(nn.Linear(8, 8)).cuda()\nfully_shard(m, mesh=mesh)\n"
     "parallelize_module(m, mesh, {'0': ColwiseParallel()})\n", "parallelize_module of a model under fully_shard"),
    ("from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel\n"
     "m = parallelize_module(nn.Sequential(nn.Linear(8, 8)).cuda(), mesh, {'0': ColwiseParallel(use_local_output=False)})\n"
     "m(torch.randn(4, 8, device='cuda')).view(-1)\n", "a view of a DTensor to (32,)"),
])
def test_dtensor_uses_not_modelled_are_refused_naming_the_api(tmp_path, source, api):
    (tmp_path / "t.py").write_text("import torch\nfrom torch import nn\n"
                                   "from torch.distributed.device_mesh import init_device_mesh\n"
                                   "mesh = init_device_mesh('cuda', (2,))\n" + source)
    with pytest.raises(EstimateError) as e:
        estimate_command(parse_train_command("torchrun --nproc_per_node 2 t.py"), [get_profile("h100-80gb")],
                         cwd=str(tmp_path))
    assert e.value.kind == "vest-unsupported" and api in str(e.value), str(e.value)


def test_every_binding_of_a_patched_torch_api_is_patched():
    import torch.distributed as dist
    import torch.distributed.device_mesh  # noqa: F401
    from vest_slurm.dynamic.standins import _aliases

    new = object()
    got = {(m.__name__, a) for m, a, n in _aliases([(dist, "init_process_group", new)]) if n is new}
    assert ("torch.distributed.distributed_c10d", "init_process_group") in got
    assert ("torch.distributed.device_mesh", "init_process_group") in got   # DeviceMesh's set-up calls it


def test_a_mesh_unflattened_and_flattened_as_torchtitan_builds_it():
    """DeviceMesh._unflatten of a 1-D world mesh into named dimensions and _flatten of a sub-mesh
    (torchtitan's ParallelDims.build_mesh) were refused by name; the mesh they make is the one
    init_device_mesh makes, and so is the per-rank estimate of FSDP2 over it."""
    def run(*args):
        cmd = parse_train_command(["torchrun", "--nproc_per_node", "2", "mesh_reshape_train.py", *args])
        (est,), r = estimate_command(cmd, [get_profile("h100-80gb")], cwd=SCRIPTS)
        return dict(est.breakdown), r

    reshaped, r = run()
    plain, _ = run("--plain")
    assert r.spec.parallelism == "fsdp2" and r.spec.num_gpus == 2
    assert reshaped == plain and reshaped["parameters"] == 4 * (256 * 1024 + 1024 + 1024 * 256 + 256) * 4 // 2


FSDP1_ACCUMULATING = """import os, contextlib, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))

    def forward(self, x):
        return x + self.f(x)

model = FSDP(nn.Sequential(*[Block() for _ in range(4)]).cuda(), auto_wrap_policy=ModuleWrapPolicy({Block}),
             use_orig_params=True)
decay = [p for p in model.parameters() if p.ndim > 1]
rest = [p for p in model.parameters() if p.ndim <= 1]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                        lr=1e-4, weight_decay=0.0)
ACCUM = int(os.environ.get("ACCUM", "4"))
for step in range(4):
    for micro in range(ACCUM):
        with model.no_sync() if micro < ACCUM - 1 else contextlib.nullcontext():
            (model(torch.randn(8, 512, device="cuda")).square().mean() / ACCUM).backward()
    opt.step(); opt.zero_grad()
"""


def test_fsdp_gradient_accumulation_in_a_script_keeps_the_unsharded_gradients(tmp_path, monkeypatch):
    """The Alpaca recipe's accumulation (FSDP1 full shard, no_sync over the micro-batches): each rank
    keeps the whole unsharded gradients between syncs. The script's per-rank estimate ignored the
    accumulation (4 micro-batches gave what 1 gave) and read the weight decay from the optimizer's
    defaults (0) rather than its groups (0.1)."""
    (tmp_path / "train.py").write_text(FSDP1_ACCUMULATING)
    cmd = parse_train_command("torchrun --nproc_per_node 2 train.py")
    got = {}
    for accum in ("1", "4"):
        monkeypatch.setenv("ACCUM", accum)
        (est,), run = estimate_command(cmd, [get_profile("h100-80gb")], cwd=str(tmp_path))
        got[accum] = (run, est)
    one, four = got["1"][0], got["4"][0]
    assert four.spec.grad_accum == 4 and one.spec.grad_accum == 1 and four.spec.weight_decay == 0.1
    acc = [e for e in four.trace.events if e.action == "alloc" and e.module.endswith("(accumulated)")]
    block = 2 * 512 * 2048 + 2048 + 512
    assert sorted({e.size_bytes for e in acc}) == [block * 4]   # each block's unsharded fp32 gradient
    assert four.trace.live_peak_bytes() > one.trace.live_peak_bytes()
    assert any("gradient accumulation over 4 micro-batches" in n for n in four.trace.notes)


FSDP1_CHECKPOINT = """import os, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))

    def forward(self, x):
        return x + self.f(x)

model = FSDP(nn.Sequential(*[Block() for _ in range(4)]).cuda(), auto_wrap_policy=ModuleWrapPolicy({Block}))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for epoch in range(3):
    for step in range(2):
        model(torch.randn(8, 256, device="cuda")).square().mean().backward()
        opt.step(); opt.zero_grad()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):   # accelerate's save_fsdp_optimizer
        assert FSDP.get_state_dict_type(model).state_dict_type is not None
        osd = FSDP.optim_state_dict(model, opt)
        torch.save({"model": model.state_dict(), "optim": osd}, "ckpt.pt")
    saved = torch.load("ckpt.pt")
    opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, saved["optim"]))
"""


def test_an_fsdp1_checkpoint_of_the_optimizer_round_trips(tmp_path):
    """FSDP.optim_state_dict under FSDP.state_dict_type (accelerate's save_fsdp_optimizer, the
    Trainer's checkpoint at an epoch's end) failed in the stand-in ("no attribute
    '_state_dict_type'"), blamed on the script."""
    (tmp_path / "train.py").write_text(FSDP1_CHECKPOINT)
    (est,), run = estimate_command(parse_train_command("torchrun --nproc_per_node 2 train.py"),
                                   [get_profile("h100-80gb")], cwd=str(tmp_path))
    assert run.steps == 3 and run.spec.parallelism == "fsdp"
