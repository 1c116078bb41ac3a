"""Tracer tests with real torch: exact parameter/gradient/optimizer-state bytes, lifetimes, AMP."""

from __future__ import annotations

import bitsandbytes  # noqa: F401  (the 8-bit optimizer tests trace it: a [test] dependency)
import pytest
import torch

from bnb_state import adam_8bit_state_bytes
from vest_slurm.estimate import steady
from vest_slurm.estimate.models import build_model
from vest_slurm.estimate.tracing import trace_training
from vest_slurm.estimate.workload import parse_workload_args

USER = "tests/data/user_models.py"


def spec(*argv):
    return parse_workload_args(list(argv))


def live_at_end(trace, category):
    live = {}
    for e in trace.events:
        if e.action == "alloc":
            live[e.block] = e
        else:
            live.pop(e.block, None)
    return sum(e.size_bytes for e in live.values() if e.category == category)


def allocated(trace, category, phase=None):
    return sum(e.size_bytes for e in trace.events
               if e.action == "alloc" and e.category == category and (phase is None or e.phase == phase))


def param_bytes(s):
    m = build_model(s).module
    elem = {"fp32": 4, "tf32": 4, "amp-fp16": 4, "amp-bf16": 4, "bf16": 2, "fp16": 2}[s.precision]
    return sum(p.numel() for p in m.parameters()) * elem, sum(b.numel() * b.element_size() for b in m.buffers())


# model, optimizer, optimizer states per parameter element
CASES = [
    ("torchvision:resnet18", "adam", 2, "3x64x64"),
    ("torchvision:resnet18", "sgd-momentum", 1, "3x64x64"),
    ("torchvision:resnet18", "sgd", 0, "3x64x64"),
    ("timm:efficientnet_b0", "adamw", 2, "3x32x32"),
    ('mlp:[["Linear",784,256],["ReLU"],["Linear",256,10]]', "adam", 2, "784"),
    ("hf:tiny-llama", "adamw", 2, "seq64"),
] + [   # torch.optim's per-parameter state tensors (its docs' algorithms): the MLP, each optimizer
    ('mlp:[["Linear",784,256],["ReLU"],["Linear",256,10]]', opt, states, "784")
    for opt, states in (("adam-amsgrad", 3), ("adamw-amsgrad", 3), ("rmsprop", 1), ("rmsprop-momentum", 2),
                        ("rmsprop-centered", 2), ("adagrad", 1), ("adamax", 2), ("nadam", 2), ("radam", 2),
                        ("adadelta", 2), ("rprop", 2))
]


@pytest.mark.parametrize("model,opt,states,inp", CASES)
def test_parameter_gradient_state_bytes_exact(model, opt, states, inp):
    s = spec("--model", model, "--batch-size", "4", "--optimizer", opt, "--input", inp)
    trace = trace_training(s)
    p_bytes, buf_bytes = param_bytes(s)
    assert live_at_end(trace, "parameter") == p_bytes + buf_bytes
    # each of the 2 iterations allocates one full set of gradients (zero_grad sets them to None)
    assert allocated(trace, "gradient") == 2 * p_bytes
    assert live_at_end(trace, "optimizer_state") == states * p_bytes


MLP = 'mlp:[["Linear",784,256],["ReLU"],["Linear",256,10]]'
MLP_SHAPES = [(256, 784), (256,), (10, 256), (10,)]


@pytest.mark.parametrize("impl", ["foreach", "for-loop"])
def test_steps_that_read_device_scalars_trace_their_exact_state(impl):
    """Adafactor reads each parameter's RMS and ASGD its step count through .item(); the values
    only scale the learning rate, so the step traces, with torch.optim's exact state tensors."""
    s = spec("--model", MLP, "--batch-size", "4", "--input", "784", "--optimizer-impl", impl)
    # Adafactor: a row and a column vector per matrix, the full size for 1-D parameters
    factored = sum((sh[0] + sh[1] if len(sh) == 2 else sh[0]) * 4 for sh in MLP_SHAPES)
    assert live_at_end(trace_training(s.with_(optimizer="adafactor")), "optimizer_state") == factored
    # ASGD: ax, the parameter's size, and two device scalars per parameter (eta, mu; step too)
    p_bytes, _ = param_bytes(s)
    asgd = trace_training(s.with_(optimizer="asgd"))
    assert live_at_end(asgd, "optimizer_state") == p_bytes + 3 * 4 * len(MLP_SHAPES)


@pytest.mark.parametrize("opt", ["adam-8bit", "adamw-8bit"])
def test_bitsandbytes_8bit_state_is_exact(opt):
    """bitsandbytes' 8-bit Adam: two uint8 states per element plus an fp32 absmax per block of 256
    for tensors of 4,096 elements and more; smaller ones keep two fp32 states."""
    model = 'mlp:[["Linear",128,64],["ReLU"],["Linear",64,10]]'
    s = spec("--model", model, "--batch-size", "4", "--input", "128", "--optimizer", opt)
    sizes = [128 * 64, 64, 64 * 10, 10]
    assert live_at_end(trace_training(s), "optimizer_state") == adam_8bit_state_bytes(sizes)


def test_mlp_on_images_flattens_them_without_a_copy():
    """An MLP row with an image input (input_shape 1x28x28, the script does x.view(B, -1)): the same
    allocations as with the flat 784 features."""
    flat = trace_training(spec("--model", MLP, "--batch-size", "8", "--input", "784"))
    image = trace_training(spec("--model", MLP, "--batch-size", "8", "--input", "1x28x28"))
    assert [(e.action, e.size_bytes) for e in image.events] == [(e.action, e.size_bytes) for e in flat.events]


def test_a_library_optimizer_takes_no_impl_setting():
    from vest_slurm.errors import WorkloadError

    s = spec("--model", MLP, "--batch-size", "2", "--input", "784", "--optimizer", "adamw-8bit",
             "--optimizer-impl", "for-loop")
    with pytest.raises(WorkloadError, match="runs bitsandbytes.optim's own kernels"):
        trace_training(s)


def test_a_library_optimizer_that_is_not_installed_says_what_to_install():
    from vest_slurm.errors import WorkloadError
    from vest_slurm.estimate.tracing import _library_optimizer

    s = spec("--model", MLP, "--batch-size", "2", "--input", "784", "--optimizer", "adamw-8bit")
    with pytest.raises(WorkloadError, match="needs no_such_library, which is not installed") as e:
        _library_optimizer(s, "no_such_library.optim:AdamW8bit")
    assert "pip install no_such_library" in e.value.fix


def test_model_code_that_reads_a_device_value_stays_data_dependent_after_an_optimizer_step():
    """The stand-in values of the optimizer step end with it: the next forward's .item() fails."""
    from vest_slurm.errors import EstimateError

    s = spec("--model", f"{USER}:data_dependent_later", "--batch-size", "8", "--input", "8", "--optimizer", "adafactor")
    with pytest.raises(EstimateError, match="depend on the data"):
        trace_training(s)
    assert trace_training(s.with_(steps=1)).events   # one step: the model never reads a value


def test_fused_is_refused_where_torch_has_no_fused_optimizer():
    from vest_slurm.errors import WorkloadError

    s = spec("--model", 'mlp:[["Linear",8,4]]', "--batch-size", "2", "--input", "8", "--optimizer", "adadelta",
             "--optimizer-impl", "fused")
    for opt in ("adadelta", "adagrad"):   # none; one whose kernel does not run on fake tensors
        with pytest.raises(WorkloadError, match="fused is traced for SGD, Adam and AdamW"):
            trace_training(s.with_(optimizer=opt))
    assert trace_training(s.with_(optimizer="adam")).events   # Adam has one


def test_bf16_weights_halve_parameter_bytes():
    s32 = spec("--model", "torchvision:resnet18", "--batch-size", "2", "--input", "3x32x32")
    s16 = s32.with_(precision="bf16")
    p32 = live_at_end(trace_training(s32), "parameter")
    p16 = live_at_end(trace_training(s16), "parameter")
    # BatchNorm's num_batches_tracked stays int64 (8 bytes x 20 layers); everything else halves.
    assert p16 < p32 * 0.51 and p16 > p32 * 0.49


def test_optimizer_state_appears_in_first_step():
    trace = trace_training(spec("--model", "torchvision:resnet18", "--batch-size", "2", "--input", "3x32x32", "--optimizer", "adam"))
    first_opt = [e for e in trace.events if e.action == "alloc" and e.category == "optimizer_state"]
    assert first_opt and all(e.phase == "optimizer" for e in first_opt)
    # all states are created in iteration 0: the second step allocates none
    idx = [i for i, e in enumerate(trace.events) if e.phase == "optimizer"]
    second_step_start = next(i for i in idx if i > idx[0] and trace.events[i - 1].phase != "optimizer")
    assert not [e for e in trace.events[second_step_start:] if e.action == "alloc" and e.category == "optimizer_state"]


def test_saved_activations_are_released_during_backward():
    trace = trace_training(spec("--model", "torchvision:resnet18", "--batch-size", "8", "--input", "3x64x64"))
    acts = {e.block for e in trace.events if e.action == "alloc" and e.category == "activation"}
    assert acts
    freed_phase = {e.block: e.phase for e in trace.events if e.action == "free" and e.block in acts}
    in_backward = sum(1 for b in acts if freed_phase.get(b) == "backward")
    # nearly every activation saved in the forward is released by the backward that uses it;
    # the exceptions are the model output and loss, kept until the next iteration rebinds them
    assert in_backward >= 0.9 * len(acts)


def saved_activation_bytes(trace):
    return allocated(trace, "activation", "forward")


@pytest.mark.parametrize("amp", ["amp-fp16", "amp-bf16"])
def test_amp_roughly_halves_saved_activations(amp):
    base = spec("--model", "torchvision:vgg11", "--batch-size", "4", "--input", "3x64x64", "--optimizer", "sgd")
    fp32 = saved_activation_bytes(trace_training(base))
    half = saved_activation_bytes(trace_training(base.with_(precision=amp)))
    # conv/linear outputs (and what ReLU/pooling save of them) become 2-byte; the input image
    # and a few fp32 outputs (loss, softmax) stay: between 45% and 65% of fp32
    assert 0.45 * fp32 < half < 0.65 * fp32, (fp32, half)


def test_linear_amp_saves_half_precision_inputs():
    s = spec("--model", 'mlp:[["Linear",1024,4096],["ReLU"],["Linear",4096,4096],["ReLU"],["Linear",4096,10]]',
             "--batch-size", "256", "--optimizer", "sgd")
    fp32 = saved_activation_bytes(trace_training(s))
    bf16 = saved_activation_bytes(trace_training(s.with_(precision="amp-bf16")))
    assert 0.45 * fp32 < bf16 < 0.75 * fp32, (fp32, bf16)


def test_events_are_consistent():
    trace = trace_training(spec("--model", f"{USER}:small_cnn", "--batch-size", "4", "--input", "3x16x16"))
    live = set()
    for e in trace.events:
        if e.action == "alloc":
            assert e.block not in live
            live.add(e.block)
        else:
            assert e.block in live, "free of a block that is not live"
            live.remove(e.block)
    kinds = {(e.phase, e.category) for e in trace.events if e.action == "alloc"}
    assert ("forward", "activation") in kinds and ("backward", "gradient") in kinds
    # one cuBLAS workspace per thread that runs a matmul: the main thread's, and autograd's
    blas = [e for e in trace.events if e.category == "workspace" and e.module == "cublas"]
    assert [e.phase for e in blas] == ["forward", "backward"]
    assert any(e.category == "workspace" and e.module == "cudnn" for e in trace.events)


def _scratch(trace, name):
    """Sizes of the kernel-scratch allocations named `name`, checking each is freed right away."""
    events = list(trace.events)
    sizes = []
    for i, e in enumerate(events):
        if e.action == "alloc" and e.category == "workspace" and e.module == name:
            freed = [j for j in range(i + 1, len(events)) if events[j].action == "free" and events[j].block == e.block]
            assert freed, "scratch must be freed"
            # before the op returns: nothing but this op's own scratch happens in between
            between = events[i + 1:freed[0]]
            assert all(x.module == name or x.action == "free" for x in between), "scratch must be freed before the op returns"
            sizes.append(e.size_bytes)
    return sizes


# BERT with 2 layers of 4 heads x 24 dims (hidden 96), sequence 200, batch 3: the backward of each
# attention takes flash's softmax_d [3, 4, 256] fp32 and dq_accum [3, 256, 4, 32] fp32
# (seq rounded to 128, head dim to 32: flash_api.cpp mha_bwd) in AMP, and the memory-efficient
# kernel's delta [3, 4, 200] fp32 and gradQ accumulator (tiles of 64 x 64 fp32 + 16 B header:
# ceil(200/64) x ceil(24/64) = 4 tiles per batch x head) in fp32.
_TINY_BERT = ("--model", "hf:BertForMaskedLM", "--input", "seq200", "--batch-size", "3", "--optimizer", "sgd",
              "--model-args", '{"hidden_size": 96, "num_attention_heads": 4, "num_hidden_layers": 2, '
              '"intermediate_size": 128, "vocab_size": 1000}')


def test_flash_attention_backward_scratch_sizes():
    tr = trace_training(spec(*_TINY_BERT, "--precision", "amp-fp16"), capability=(9, 0))
    sizes = _scratch(tr, "flash_attention")
    one_step = [3 * 4 * 256 * 4, 3 * 256 * 4 * 32 * 4]
    assert sizes == one_step * (len(sizes) // 2) and len(sizes) == 2 * 2 * tr.iterations


def test_efficient_attention_backward_scratch_sizes():
    tr = trace_training(spec(*_TINY_BERT, "--precision", "fp32"), capability=(9, 0))
    sizes = _scratch(tr, "efficient_attention")
    workspace = 3 * 4 * (4 * (64 * 64 * 4 + 16) // 4) * 4
    assert sizes == [3 * 4 * 200 * 4, workspace] * (len(sizes) // 2) and len(sizes) == 2 * 2 * tr.iterations
    assert not _scratch(tr, "flash_attention")


def test_attention_backward_copies_what_is_not_contiguous_for_the_kernel():
    # Whisper makes q, k and v contiguous in [batch, heads, seq, dim]: flash attention's output takes
    # that layout, so its backward copies `out` into [batch, seq, heads, dim] (attention_backward.cu
    # _flash_attention_backward); the incoming gradient is already contiguous there (the model's
    # .transpose(1, 2).contiguous() of the output hands it back so). BERT keeps q, k, v as views of
    # [batch, seq, heads, dim]: no copy (test above).
    tr = trace_training(spec("--model", "hf:WhisperForAudioClassification", "--input", "tensor:80x3000",
                             "--batch-size", "1", "--optimizer", "sgd", "--precision", "amp-fp16", "--loss", "model",
                             "--model-args", '{"d_model": 64, "encoder_attention_heads": 2, "encoder_layers": 1, '
                             '"encoder_ffn_dim": 128, "decoder_layers": 1, "decoder_attention_heads": 2, '
                             '"decoder_ffn_dim": 128}'), capability=(9, 0))
    sizes = _scratch(tr, "flash_attention")
    out_copy = 1 * 2 * 1500 * 32 * 2                         # fp16 [1, 1500, 2, 32]
    one_step = [out_copy, 1 * 2 * 1536 * 4, 1 * 1536 * 2 * 32 * 4]
    assert sizes == one_step * tr.iterations


@pytest.mark.parametrize("transpose", [True, False])
def test_layer_norm_copies_an_input_that_is_not_contiguous(transpose):
    """The CUDA LayerNorm takes ``input.expect_contiguous()`` in forward and again in backward
    (layer_norm_kernel.cu): a transient copy of a transposed input in each pass, none otherwise."""
    batch, features, length = 8, 32, 48
    tr = trace_training(spec("--model", f"{USER}:norm_of_transposed", "--model-args", f'{{"transpose": {str(transpose).lower()}}}',
                             "--batch-size", str(batch), "--input", f"{length}x{features}", "--loss", "mse",
                             "--optimizer", "sgd", "--steps", "2"))
    sizes = _scratch(tr, "layer_norm")
    phases = [e.phase for e in tr.events if e.action == "alloc" and e.module == "layer_norm"]
    if transpose:
        assert sizes == [batch * features * length * 4] * 2 * tr.iterations
        assert phases == ["forward", "backward"] * tr.iterations
    else:
        assert sizes == []


def test_live_tensor_peak_leaves_out_kernel_scratch():
    """The live-tensor peak is the FakeTensor / MemTracker count the accuracy benchmark compares
    against: tensors only, not the scratch the tracer adds for what CUDA kernels allocate."""
    from vest_slurm.estimate.trace import AllocEvent, AllocTrace

    events = (AllocEvent("alloc", 1, 100, category="activation"),
              AllocEvent("alloc", -1, 50, category="workspace", module="layer_norm"),
              AllocEvent("free", -1, 50), AllocEvent("alloc", 2, 30, category="activation"),
              AllocEvent("free", 1, 100), AllocEvent("free", 2, 30))
    assert AllocTrace(events).live_peak_bytes() == 130


@pytest.mark.parametrize("slice_", [True, False])
def test_convolution_copies_what_cudnn_needs_dense(slice_):
    """cuDNN convolutions take operands dense in one memory format (Convolution.cpp
    input.contiguous(backend format); ConvShared.cpp grad_output.to(input.suggest_memory_format())).
    A channel slice of a channels-last activation (FocalNet's context) is copied in forward and for
    the weight gradient; the product's gradient arrives NCHW for a channels-last input, so it is
    converted too."""
    batch, channels = 8, 32
    tr = trace_training(spec("--model", f"{USER}:conv_of_channel_slice", "--model-args", f'{{"slice_": {str(slice_).lower()}}}',
                             "--batch-size", str(batch), "--input", "3x32x32", "--loss", "mse", "--optimizer", "sgd",
                             "--steps", "2"), capability=(9, 0))
    activation = batch * channels * 32 * 32 * 4
    copies = [(e.phase, e.size_bytes) for e in tr.events if e.action == "alloc" and e.module == "conv_scratch"]
    one_step = [("forward", activation), ("backward", activation), ("backward", activation)] if slice_ else \
        [("backward", activation)]
    assert copies == one_step * tr.iterations
    assert _scratch(tr, "conv_scratch") == [size for _, size in copies]


@pytest.mark.parametrize("log", [False, True])
def test_softmax_backward_takes_grad_times_output(log):
    """The CUDA softmax backward computes ``tmp = grad * output`` before its kernel
    (SoftMax.cu softmax_backward_cuda_out): a transient of the probabilities' size each step.
    log_softmax's backward has none for contiguous tensors."""
    batch, classes = 64, 1000
    tr = trace_training(spec("--model", f"{USER}:probabilities", "--model-args", f'{{"log": {str(log).lower()}}}',
                             "--batch-size", str(batch), "--input", "16", "--loss", "mse", "--optimizer", "sgd",
                             "--steps", "2"))
    sizes = _scratch(tr, "softmax")
    assert sizes == ([] if log else [batch * classes * 4] * tr.iterations)


def test_embedding_backward_scratch_of_the_sorting_kernel():
    """More than 3,072 indices: the CUDA embedding backward sorts them and sums partial segments
    (Embedding.cu, EmbeddingBackwardKernel.cu): int64 buffers of the indices' and segments' counts
    and a float buffer of (n / 10 + min(n, vocab)) rows. Tiny BERT at batch 16 x 200 tokens: the
    word embedding (vocab 1000) and the token-type embedding (2 types) take it; the position
    embedding (200 indices) takes the direct kernel."""
    tr = trace_training(spec(*_TINY_BERT[:4], "--batch-size", "16", *_TINY_BERT[6:]))
    sizes = _scratch(tr, "embedding")
    n = 16 * 200
    for vocab in (1000, 2):
        segments = min(n, vocab)
        partial = n // 10 + segments
        one = [n * 8] * 3 + [segments * 8] * 2 + [partial * 8, partial * 96 * 4]
        assert sizes.count(partial * 96 * 4) == tr.iterations
        assert all(sizes.count(s) >= tr.iterations for s in one)
    assert len(sizes) == 2 * 7 * tr.iterations


@pytest.mark.parametrize("argv", [
    ("--model", "torchvision:resnet18", "--batch-size", "4", "--input", "3x64x64", "--optimizer", "adam", "--steps", "3"),
    ("--model", "hf:GPT2LMHeadModel", "--model-args", "{\"n_layer\": 2, \"n_embd\": 64, \"n_head\": 2}", "--batch-size", "2", "--input", "seq32", "--loss", "model", "--precision", "amp-fp16", "--steps", "3"),
])
def test_step_ends_mark_repeatable_iterations(argv):
    """The tracer marks where each training step ends; the steps after the first have the same
    events, and the last can be repeated by steady.extend (blocks carried over pair up)."""
    trace = trace_training(spec(*argv))
    ends = trace.step_ends
    assert len(ends) == 3 and 0 < ends[0] < ends[1] < ends[2] <= len(trace.events)
    second, third = trace.events[ends[0]:ends[1]], trace.events[ends[1]:ends[2]]
    assert [(e.action, e.size_bytes) for e in second] == [(e.action, e.size_bytes) for e in third]
    extended, copies = steady.extend(trace.events, ends)
    assert copies >= steady.PATIENCE
    assert len(extended) == len(trace.events) + copies * len(third)


def _live_during(trace, phase):
    """Largest live bytes at an allocation made in ``phase`` of the last step."""
    start = trace.step_ends[-2]
    live, sizes, best = 0, {}, 0
    for i, e in enumerate(trace.events):
        if e.action == "alloc":
            sizes[e.block] = e.size_bytes
            live += e.size_bytes
            if i >= start and e.phase == phase:
                best = max(best, live)
        else:
            live -= sizes.pop(e.block, 0)
    return best


def test_zero_grad_placement():
    """--zero-grad before-backward (timm's train.py, Lightning) keeps the previous step's gradients
    through the forward; after-step frees them first; never accumulates into them in place."""
    mlp = 'mlp:[["Linear",2048,2048],["ReLU"],["Linear",2048,2048],["ReLU"],["Linear",2048,10]]'
    base = spec("--model", mlp, "--batch-size", "64", "--input", "2048", "--optimizer", "sgd")
    grads, _ = param_bytes(base)
    after = trace_training(base)
    before = trace_training(base.with_(zero_grad="before-backward"))
    never = trace_training(base.with_(zero_grad="never"))
    assert _live_during(before, "forward") - _live_during(after, "forward") == grads
    assert _live_during(never, "forward") - _live_during(after, "forward") == grads
    # after-step frees the gradients at the end of each step; the other two keep the last ones
    assert live_at_end(after, "gradient") == 0
    assert live_at_end(before, "gradient") == live_at_end(never, "gradient") == grads
    assert [e.phase for e in before.events if e.action == "free" and e.category == "gradient"].count("zero_grad") > 0
    for t in (before, never):   # gradients carried into the next step pair up with the ones it frees
        assert steady.extend(t.events, t.step_ends)[1] >= steady.PATIENCE
    with pytest.raises(Exception, match="zero-grad"):
        spec("--model", mlp, "--batch-size", "2", "--zero-grad", "sometimes")


def test_torchvision_segmentation_builds_without_downloading_and_trains(monkeypatch):
    """Segmentation builders default to pretrained ImageNet backbones (weights_backbone); the
    estimate must not fetch them, and their dict output ({"out", "aux"}) gets a per-pixel loss."""
    import torch.hub

    def no_download(*args, **kwargs):
        raise AssertionError(f"tried to download {args[:1]}")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", no_download)
    s = spec("--model", "torchvision:fcn_resnet50", "--model-args", '{"aux_loss": true, "num_classes": 21}',
             "--batch-size", "2", "--input", "3x64x64", "--optimizer", "sgd")
    trace = trace_training(s)
    p_bytes, _ = param_bytes(s)
    assert allocated(trace, "gradient") == 2 * p_bytes   # the aux head trains too
    # both heads' per-pixel scores (2 x 21 x 64 x 64 fp32) are in the forward
    scores = 2 * 21 * 64 * 64 * 4
    assert sum(1 for e in trace.events if e.action == "alloc" and e.phase == "forward" and e.size_bytes == scores) >= 4


def test_torchvision_detection_is_refused_with_a_reason():
    from vest_slurm.errors import WorkloadError

    with pytest.raises(WorkloadError, match="detection model .* not supported"):
        build_model(spec("--model", "torchvision:fasterrcnn_resnet50_fpn", "--batch-size", "2", "--input", "3x320x320"))


def test_bare_encoder_decoder_config_gets_a_decoder_start_token():
    # T5Config() leaves decoder_start_token_id unset (every checkpoint sets it); the labels are
    # shifted right behind it, so without one the model cannot make its decoder inputs
    built = build_model(spec("--model", "hf:T5ForConditionalGeneration", "--batch-size", "2", "--input", "seq16",
                             "--model-args", '{"num_layers": 1, "num_decoder_layers": 1, "d_model": 32, "d_ff": 64, "num_heads": 2, "d_kv": 16}'))
    assert built.module.config.decoder_start_token_id == 0


def test_hf_model_with_an_explicit_loss_on_its_scores():
    # a head without a loss of its own (CTC without labels): --loss cross-entropy puts the job's
    # loss on the model's scores, and the model gets no labels
    from vest_slurm.errors import EstimateError

    args = ["--model", "hf:Wav2Vec2ForCTC", "--batch-size", "2", "--input", "tensor:4000", "--model-args",
            '{"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, '
            '"conv_dim": [16, 16, 16, 16, 16, 16, 16], "num_conv_pos_embeddings": 16, "vocab_size": 40, '
            '"mask_time_prob": 0}']
    with pytest.raises(EstimateError, match="returned no loss"):
        trace_training(spec(*args))
    trace = trace_training(spec(*args, "--loss", "cross-entropy"))
    frames = 12   # 4000 samples through the 7 strided convolutions (4000 / 320, rounded down by each)
    scores = 2 * frames * 40 * 4   # [batch, frames, vocab] fp32
    assert sum(1 for e in trace.events if e.action == "alloc" and e.phase == "forward" and e.size_bytes == scores) >= 2
    # SpecAugment on (the default mask_time_prob): a boolean mask selects frames by value; the
    # error says so and how to go on, instead of blaming the input
    with pytest.raises(EstimateError, match="size depends on the data") as err:
        trace_training(spec(*[a.replace(', "mask_time_prob": 0', "") for a in args], "--loss", "cross-entropy"))
    assert "mask_time_prob=0" in err.value.fix


@pytest.mark.parametrize("model,args", [
    ("LongformerForMaskedLM", {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                               "num_attention_heads": 2, "attention_window": 16, "vocab_size": 500}),
    ("LEDForConditionalGeneration", {"encoder_layers": 1, "decoder_layers": 1, "d_model": 32,
                                     "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "encoder_attention_heads": 2,
                                     "decoder_attention_heads": 2, "attention_window": 16, "vocab_size": 500}),
])
def test_sliding_window_attention_asks_its_padded_mask_for_global_attention(model, args):
    # Longformer and LED pad to the attention window and ask `mask.any().item()` whether any
    # token attends globally: known without data (no global attention mask is given), so they trace
    import json

    s = spec("--model", f"hf:{model}", "--batch-size", "2", "--input", "seq24", "--model-args", json.dumps(args))
    trace = trace_training(s)
    assert trace.live_peak_bytes() > 0
    # the padded sequence (24 -> 32 tokens) is what the layers see: [2, 32, 32] fp32 hidden states
    assert any(e.action == "alloc" and e.phase == "forward" and e.size_bytes == 2 * 32 * 32 * 4 for e in trace.events)


def test_layerdrop_is_traced_with_every_layer_kept():
    # Wav2Vec2's encoder skips each layer with probability `layerdrop` (a host draw per layer):
    # the estimate is that of the steps that keep them all, and the same every time
    def peak(layerdrop):
        args = ["--model", "hf:Wav2Vec2ForCTC", "--batch-size", "2", "--input", "tensor:4000", "--loss", "cross-entropy",
                "--model-args", '{"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, '
                '"num_attention_heads": 2, "conv_dim": [16, 16, 16, 16, 16, 16, 16], "num_conv_pos_embeddings": 16, '
                f'"vocab_size": 40, "mask_time_prob": 0, "layerdrop": {layerdrop}}}']
        return trace_training(spec(*args)).live_peak_bytes()

    kept = peak(0.0)
    assert peak(0.9) == kept == peak(0.9)


def test_bare_sequence_classifier_config_gets_a_pad_token():
    # GPT2Config() has no pad token, and GPT-2's sequence classifier refuses a batch > 1 without
    # one (it pools at each row's last non-pad token); fine-tuning configs set the end-of-text token
    s = spec("--model", "hf:GPT2ForSequenceClassification", "--batch-size", "2", "--input", "seq16",
             "--model-args", '{"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 1000, "eos_token_id": 999}')
    assert build_model(s).module.config.pad_token_id == 999
    assert trace_training(s).live_peak_bytes() > 0


@pytest.mark.parametrize("hook,expected", [(False, 3), (True, 4)])
def test_gradients_of_a_reused_tensor_accumulate_in_place(hook, expected):
    """A tensor used by three layers gets three gradients. On the GPU autograd adds them in place
    into the first (input_buffer.cpp accumulate: old_var.add_(var)); under the fake mode the engine
    takes old_var + var, which the tracer folds back. A Python hook's own ``grad + grad`` is a real
    allocation and stays."""
    batch, hidden = 16, 512
    s = spec("--model", f"{USER}:fan_out", "--model-args", f'{{"hook": {str(hook).lower()}}}',
             "--batch-size", str(batch), "--input", "32", "--loss", "mse", "--optimizer", "sgd", "--steps", "2")
    trace = trace_training(s)
    grads_of_h = [e for e in trace.events
                  if e.action == "alloc" and e.phase == "backward" and e.size_bytes == batch * hidden * 4]
    assert len(grads_of_h) == expected * trace.iterations
    live = set()
    for e in trace.events:   # the folded sum is freed once, under the block that holds it
        if e.action == "alloc":
            assert e.block not in live
            live.add(e.block)
        else:
            assert e.block in live
            live.remove(e.block)


@pytest.mark.parametrize("by_hand,expected", [(False, 1), (True, 2)])
def test_linears_bias_on_a_transposed_input_is_added_in_place(by_hand, expected):
    """nn.functional.linear on a 3-D input that is not contiguous (nn.MultiheadAttention's
    in-projection of a batch_first input) adds its bias to the matmul's output in place on the GPU
    (Linear.cpp: output.add_(bias)), out of place under the fake mode; the tracer folds the copy
    back. ``x @ w.t() + b`` written in Python allocates the sum on the GPU too, and keeps it."""
    batch, length, hidden = 8, 16, 256
    s = spec("--model", f"{USER}:project_transposed", "--model-args", f'{{"by_hand": {str(by_hand).lower()}}}',
             "--batch-size", str(batch), "--input", f"{length}x32", "--loss", "mse", "--optimizer", "sgd", "--steps", "2")
    trace = trace_training(s)
    outputs = [e for e in trace.events
               if e.action == "alloc" and e.phase == "forward" and e.size_bytes == batch * length * hidden * 4
               and e.op != "zeros.default"]   # (the loss's target)
    assert len(outputs) == expected * trace.iterations, [e.op for e in outputs]


@pytest.mark.parametrize("pick,expected", [("gather", 2), ("max", 1)])
def test_backward_formulas_fill_their_zeros_in_place(pick, expected):
    """gather_backward and max's backward fill zeros of the scores' size: in place on the GPU
    (scatter_add_ / scatter_), out of place under the fake mode (every tensor is subclass-like
    there); the tracer folds the copy back. Per step the scores-sized gradients are then the
    zeros (and, for gather, log_softmax's own gradient)."""
    batch, vocab = 64, 4096
    s = spec("--model", f"{USER}:pick_from_scores", "--model-args", f'{{"pick": "{pick}"}}',
             "--batch-size", str(batch), "--input", "8x16", "--loss", "mse", "--optimizer", "sgd", "--steps", "2")
    trace = trace_training(s)
    scores_sized = [e for e in trace.events
                    if e.action == "alloc" and e.phase == "backward" and e.size_bytes == batch * 8 * vocab * 4]
    assert len(scores_sized) == expected * trace.iterations


@pytest.mark.parametrize("model,args", [("hf:tiny-llama", ["--batch-size", "4", "--input", "seq128", "--model-arg", "vocab_size=512"]),
                                        ("timm:vit_tiny_patch16_224", ["--batch-size", "32"])])
def test_gradient_checkpointing_keeps_block_inputs_and_recomputes_in_backward(model, args):
    base = spec("--model", model, "--optimizer", "sgd", *args)
    plain, ckpt = trace_training(base), trace_training(base.with_(gradient_checkpointing="on"))
    # the forward keeps only each block's input: a lower live-tensor peak ...
    assert ckpt.live_peak_bytes() < 0.8 * plain.live_peak_bytes()
    # ... and the backward runs the blocks' forwards again: more allocated there than without
    assert allocated(ckpt, "activation", "backward") + allocated(ckpt, "temporary", "backward") > \
        allocated(plain, "activation", "backward") + allocated(plain, "temporary", "backward")
    # parameters, gradients and optimizer state do not change
    assert live_at_end(ckpt, "parameter") == live_at_end(plain, "parameter")
    assert allocated(ckpt, "gradient") == allocated(plain, "gradient")


def test_gradient_checkpointing_is_refused_without_a_switch():
    from vest_slurm.errors import WorkloadError

    s = spec("--model", "torchvision:resnet18", "--batch-size", "2", "--input", "3x32x32",
             "--gradient-checkpointing", "on")
    with pytest.raises(WorkloadError, match="no activation checkpointing switch"):
        trace_training(s)
    assert s.to_argv()[-2:] == ["--gradient-checkpointing", "on"]


def test_transformers_warnings_about_the_built_config_stay_quiet():
    """A GPT-2 built from a config has no loss_type: transformers warns of it at each loss. That
    speaks of the estimator's call, not the user's job: not emitted; the verbosity is put back."""
    import logging

    from transformers.utils import logging as hf_logging

    class Seen(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    seen, root = Seen(), logging.getLogger("transformers")
    before = hf_logging.get_verbosity()
    getattr(logging.Logger.warning_once, "cache_clear", lambda: None)()   # transformers says it once a process
    root.addHandler(seen)
    try:
        trace_training(parse_workload_args(["--model", "hf:GPT2LMHeadModel", "--model-arg", "n_layer=1",
                                            "--model-arg", "n_embd=32", "--model-arg", "n_head=2",
                                            "--batch-size", "1", "--input", "seq16"]))
        assert hf_logging.get_verbosity() == before
        hf_logging.get_logger("transformers.modeling_utils").warning("after the trace")
    finally:
        root.removeHandler(seen)
    assert not any("loss_type" in m for m in seen.messages) and "after the trace" in seen.messages


def test_the_trace_says_whether_the_run_computes_in_bf16():
    """AMP bf16 and bf16 weights make bfloat16 tensors on the GPU: the trace notes it (placement takes
    GPUs that emulate bf16 last); fp32 and fp16 AMP do not."""
    from vest_slurm.estimate.trace import BF16_NOTE

    def notes(precision):
        return trace_training(parse_workload_args(["--model", 'mlp:[["Linear",64,32],["ReLU"],["Linear",32,10]]',
                                                   "--input", "64", "--batch-size", "4",
                                                   "--precision", precision])).notes

    assert BF16_NOTE in notes("amp-bf16") and BF16_NOTE in notes("bf16")
    assert BF16_NOTE not in notes("fp32") and BF16_NOTE not in notes("amp-fp16")


def test_a_trace_that_fails_leaves_no_module_hook_behind():
    """The tracer's global forward pre-hook (it notes RNNs that cuDNN would run) lives only while a
    trace runs: a failed trace, e.g. a model input that does not fit, removes it too, so a long-lived
    process (the bridge's directive worker) does not gather hooks."""
    from torch.nn.modules import module as nn_module

    from vest_slurm.errors import EstimateError

    before = dict(nn_module._global_forward_pre_hooks)
    ok = trace_training(spec("--model", 'mlp:[["Linear",64,32],["ReLU"],["Linear",32,10]]', "--input", "64",
                             "--batch-size", "4"))
    assert ok.events and dict(nn_module._global_forward_pre_hooks) == before
    with pytest.raises(EstimateError):
        trace_training(spec("--model", 'mlp:[["Linear",64,32],["ReLU"],["Linear",32,10]]', "--input", "48",
                            "--batch-size", "4"))
    assert dict(nn_module._global_forward_pre_hooks) == before


@pytest.mark.parametrize("cls, kernel", [(torch.nn.LSTM, "aten.mkldnn_rnn_layer.default"),
                                         (torch.nn.GRU, "aten.addmm.default")])
def test_rnns_on_fake_cuda_take_atens_cpu_kernels_as_the_note_says(cls, kernel):
    """CUDNN_RNN_NOTE's account: a fake CUDA tensor is not is_cuda() to ATen's C++, so nn.LSTM runs
    oneDNN's LSTM layer and nn.GRU the CPU cell, never cuDNN's RNN (what the GPU runs). A torch that
    chooses otherwise fails this test, and the note must be revisited."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vest_slurm.estimate import _fakecuda as fc
    from vest_slurm.estimate.tracing import Tracer

    ops = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    tracer = Tracer()
    model = cls(16, 32)
    with (fc.cuda_answers(total_memory_bytes=1 << 34, capability=(8, 0), scalar_draws_at_the_top=True), tracer,
          fc.FakeCudaMode(tracer.recorder), fc.CudaFactoryMode()):
        fc.materialize(model, torch.float32, False)
        x = torch.randn(5, 2, 16, device=fc.DEVICE)
        with Log():
            model(x)
    assert kernel in ops and not any("cudnn" in op or "_thnn_fused" in op for op in ops), sorted(set(ops))


def test_a_model_that_asks_where_its_tensors_are_is_told_the_gpu():
    """``is_cuda``, ``is_cpu``, ``get_device()``, ``type()`` read the C++ tensor, which answers as
    the host for a fake CUDA tensor: the model's GPU branch was skipped. And its GRU's weights are
    flattened into cuDNN's one buffer when they reach the GPU (flatten_parameters asks is_cuda and
    each weight's data_ptr, which are distinct per storage as on a GPU), as parameters."""
    s = spec("--model", f"{USER}:asks_its_device", "--batch-size", "8", "--input", "tensor:20x32", "--loss", "mse")
    trace = trace_training(s)
    hidden = 64
    assert any(e.size_bytes == 8 * 4 * hidden * 4 and e.module.endswith("gpu_path")
               for e in trace.events if e.action == "alloc"), "the GPU branch was not taken"
    gru = 3 * hidden * (32 + hidden) + 2 * 3 * hidden
    assert any(e.size_bytes == 4 * gru and e.category == "parameter" for e in trace.events if e.action == "alloc")
    params, buffers = param_bytes(s)
    assert live_at_end(trace, "parameter") == params + buffers


@pytest.mark.parametrize("form", ["tensor", "dict", "tuple"])
def test_loss_model_takes_a_loss_returned_as_a_tensor_a_dict_or_first_in_a_tuple(form):
    """``--loss model`` took only an output's ``.loss`` (transformers'); a model returning its loss
    itself (a diffusion model's forward) was refused. Its backward is traced: the weights get
    gradients of their size."""
    s = spec("--model", f"{USER}:returns_its_loss", "--model-arg", f"form={form}", "--batch-size", "8",
             "--input", "tensor:64", "--loss", "model")
    trace = trace_training(s)
    params, _ = param_bytes(s)
    assert sum(e.size_bytes for e in trace.events if e.action == "alloc" and e.category == "gradient") >= params
