"""Fake CUDA keeps on the GPU what a GPU run keeps there, and records it (vest_slurm/estimate/_fakecuda.py).

The fake device answers ``cpu`` to C++'s device query (the autograd engine needs that), so C++
code that builds a tensor from another's ``options()`` would put it on the CPU, out of the
recorder's sight. These tests run real torch ops on fake CUDA tensors and check the device, and
the allocations the recorder sees, against what PyTorch does on a GPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from vest_slurm.errors import FailsOnAGpu
from vest_slurm.estimate import _fakecuda as fc
from vest_slurm.estimate.tracing import trace_training
from vest_slurm.estimate.workload import parse_workload_args

DATA = __import__("pathlib").Path(__file__).parent / "data"


class Seen:
    """What the recorder sees: the sizes of the storages allocated and not yet freed."""

    def __init__(self):
        self.live: dict[int, int] = {}
        self.allocated: list[int] = []
        self.recorder = fc.Recorder(self._alloc, self._free)

    def _alloc(self, block, nbytes, _storage):
        self.live[block] = nbytes
        self.allocated.append(nbytes)

    def _free(self, block):
        self.live.pop(block, None)

    def since(self, mark: int) -> list[int]:
        return self.allocated[mark:]


@contextlib.contextmanager
def fake_gpu(scalar_stand_in: bool = False, capability: tuple[int, int] = (9, 0)):
    """The declarative tracer's fake GPU, or with ``scalar_stand_in`` dynamic analysis's."""
    seen = Seen()
    with (fc.cuda_answers(total_memory_bytes=80 << 30, capability=capability, scalar_draws_at_the_top=not scalar_stand_in),
          fc.FakeCudaMode(seen.recorder, scalar_stand_in=scalar_stand_in), fc.CudaFactoryMode()):
        yield seen


def test_type_as_and_to_other_stay_on_the_gpu_and_are_recorded():
    with fake_gpu() as seen:
        x = torch.empty(4, 256, device="cuda")
        half = torch.empty(2, device="cuda", dtype=torch.float16)
        for convert in (lambda: x.type_as(half), lambda: x.to(half)):
            mark = len(seen.allocated)
            y = convert()
            assert y.device.type == "cuda" and y.dtype == torch.float16
            assert seen.since(mark) == [4 * 256 * 2]


@pytest.mark.parametrize("stand_in", [False, True])
def test_to_the_gpu_of_a_tensor_on_the_gpu_is_the_tensor_itself(stand_in):
    """ATen's to() returns self when nothing changes; C++ reads a fake tensor's device as the host's
    and made a copy the GPU never makes (transformers' mask.to(x.device), bitsandbytes' maps)."""
    with fake_gpu(stand_in) as seen:
        x = torch.empty(4, 256, device="cuda")
        cl = torch.empty(2, 3, 8, 8, device="cuda").to(memory_format=torch.channels_last)
        mark = len(seen.allocated)
        for same in (lambda: x.to("cuda"), lambda: x.to(x.device), lambda: x.to(torch.device("cuda", 0)),
                     lambda: x.to("cuda", torch.float32), lambda: x.to(device="cuda", non_blocking=True),
                     x.cuda, lambda: x.to(x), lambda: cl.to("cuda", memory_format=torch.channels_last)):
            y = same()
            assert y is x or y is cl
        assert seen.since(mark) == []
        for change in (lambda: x.to("cuda", torch.float16), lambda: x.to("cuda", copy=True),
                       lambda: cl.to("cuda", memory_format=torch.contiguous_format)):
            mark = len(seen.allocated)
            assert change() is not x and len(seen.since(mark)) == 1


def test_copies_the_script_asks_for_go_to_the_host():
    with fake_gpu() as seen:
        x = torch.empty(4, 256, device="cuda")
        host = torch.zeros(1)   # a host tensor
        for copy in (x.cpu, lambda: x.to("cpu"), lambda: x.to(torch.device("cpu")), lambda: x.to(device="cpu"),
                     lambda: x.to("cpu", torch.float16), lambda: x.type_as(host), lambda: x.to(host),
                     lambda: x.type_as(host.half())):
            mark = len(seen.allocated)
            y = copy()
            assert y.device.type == "cpu" and y is not x
            assert seen.since(mark) == []   # nothing on the GPU


def test_a_host_copy_does_not_hold_the_gpu_tensor():
    # a loop that keeps .cpu() copies of its outputs holds host memory, not GPU memory
    with fake_gpu() as seen:
        kept = []
        for _ in range(3):
            out = torch.empty(1024, device="cuda")
            kept.append(out.detach().cpu())
            del out
        assert seen.live == {}


def test_softmax_with_float_dtype_of_half_input_takes_no_converted_copy():
    # SoftMax.cpp: a CUDA half input with dtype=float runs the half-to-float kernel directly;
    # bfloat16 (and anything else) is converted first
    with fake_gpu() as seen:
        for fn in (F.softmax, F.log_softmax):
            x = torch.empty(8, 1024, device="cuda", dtype=torch.float16, requires_grad=True)
            mark = len(seen.allocated)
            y = fn(x, -1, dtype=torch.float32)
            assert y.device.type == "cuda" and y.dtype == torch.float32
            assert seen.since(mark) == [8 * 1024 * 4]
            b = torch.empty(8, 1024, device="cuda", dtype=torch.bfloat16)
            mark = len(seen.allocated)
            assert fn(b, -1, dtype=torch.float32).device.type == "cuda"
            assert seen.since(mark) == [8 * 1024 * 4, 8 * 1024 * 4]   # the converted copy, then the output


def test_dropout_after_type_as_takes_the_gpu_path():
    # transformers 4.x T5: softmax(scores.float()).type_as(scores), then dropout: on the GPU a
    # bool mask (native_dropout), saved for backward
    with fake_gpu() as seen:
        scores = torch.empty(2, 8, 64, 64, device="cuda", dtype=torch.float16, requires_grad=True)
        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        mark = len(seen.allocated)
        dropped = F.dropout(weights, p=0.1, training=True)
        assert dropped.device.type == "cuda"
        assert type(dropped.grad_fn).__name__ == "NativeDropoutBackward0"
        n = 2 * 8 * 64 * 64
        assert sorted(seen.since(mark)) == [n, 2 * n]   # the bool mask, the fp16 output


def test_gradient_cloned_to_the_parameter_layout_is_a_gpu_allocation():
    # AccumulateGrad: a gradient whose strides differ from the parameter's is cloned into the
    # parameter's layout (new_empty_strided), as after a channels_last convolution's backward
    with fake_gpu() as seen:
        p = torch.nn.Parameter(torch.empty(16, 32, device="cuda"))
        loss = (p.t().contiguous() * 2).sum()
        mark = len(seen.allocated)
        loss.backward()
        assert p.grad.device.type == "cuda" and p.grad.stride() == p.stride()
        assert 16 * 32 * 4 in seen.since(mark)
        assert seen.live   # the gradient is held


def test_new_tensor_on_the_fake_gpu():
    with fake_gpu() as seen:
        x = torch.empty(3, device="cuda", dtype=torch.float16)
        mark = len(seen.allocated)
        y = x.new_tensor([1.0, 2.0, 3.0, 4.0])
        assert y.device.type == "cuda" and y.dtype == torch.float16 and tuple(y.shape) == (4,)
        assert seen.since(mark) == [8]


class _Holder(torch.nn.Module):
    def __init__(self, emb):
        super().__init__()
        self.embed_tokens = emb   # the same module object a second time in the tree


class _SharedEmbedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Embedding(100, 16)
        self.encoder = _Holder(self.shared)
        self.head = torch.nn.Linear(16, 100, bias=False)
        self.head.weight = self.shared.weight


def test_materialize_keeps_a_shared_submodule_tied():
    with torch.device("meta"):
        model = _SharedEmbedding()
    with fake_gpu() as seen:
        fc.materialize(model, torch.float32, False)
    assert model.head.weight is model.shared.weight is model.encoder.embed_tokens.weight
    assert model.shared.weight.device.type == "cuda"
    assert seen.allocated == [100 * 16 * 4]   # one storage, as model.cuda() keeps one


def test_module_to_in_the_step_converts_memoized_parameters_as_the_gpu_does():
    # FakeTensorMode keeps weak references to the fake tensors it memoizes, and Module._apply
    # swaps fake parameters, which swap_tensors refuses for a weakly referenced tensor.
    # SwitchTransformers' router calls self.classifier.to(self.dtype) in every forward.
    import weakref

    with fake_gpu() as seen:
        lin = torch.nn.Linear(64, 32, device="cuda")
        weight = lin.weight
        memo = weakref.ref(weight)   # as FakeTensorMode's memo holds it
        mark = len(seen.allocated)
        assert lin.to(torch.float32) is lin
        assert lin.weight is weight and lin.weight.dtype == torch.float32
        assert seen.since(mark) == []   # a conversion to its own dtype allocates nothing
        lin.to(torch.bfloat16)   # on a GPU: weight.data = converted, the same Parameter
        assert lin.weight is weight and memo() is weight
        assert weight.dtype == torch.bfloat16 and weight.device.type == "cuda"
        assert sorted(seen.since(mark)) == [32 * 2, 64 * 32 * 2]
        assert sorted(seen.live.values()).count(64 * 32 * 4) == 0   # the fp32 weight is freed


def _trace_bytes(attention):
    spec = parse_workload_args(["--model", f"{DATA / 'user_models.py'}:{attention}", "--batch-size", "4",
                                "--input", "64x32", "--loss", "mse", "--precision", "amp-fp16"])
    trace = trace_training(spec)
    return trace.live_peak_bytes(), [e.size_bytes for e in trace.events if e.action == "alloc"]


def test_type_as_traces_as_to_dtype():
    # the same attention written with .type_as(scores) and with .to(scores.dtype): the GPU run
    # allocates the same, and so must the trace
    peak_type_as, sizes_type_as = _trace_bytes("attention_type_as")
    peak_to, sizes_to = _trace_bytes("attention_to_dtype")
    assert peak_type_as == peak_to
    assert sorted(sizes_type_as) == sorted(sizes_to)
    assert 4 * 4 * 64 * 64 in sizes_type_as   # the dropout's bool mask over [B, heads, L, L]


def test_values_known_without_data_steer_the_step():
    # transformers 4.x builds an all-ones attention mask when none is given and asks
    # torch.all(mask == 1) to pick the attention kernel: a fill's value is known exactly
    from torch._subclasses.fake_tensor import DataDependentOutputException

    with fake_gpu():
        mask = torch.ones(2, 8, device="cuda")
        assert bool(torch.all(mask == 1)) is True
        assert bool(torch.any(mask.to(torch.float16) == 0)) is False
        assert bool((torch.zeros(3, device="cuda") < 1).all()) is True
        assert bool((torch.full((2,), 0.5, device="cuda") == 0.5).all()) is True
        mask[:, 0] = 0   # written: no longer known
        with pytest.raises(DataDependentOutputException):
            bool(torch.all(mask == 1))
        data = torch.empty(2, 8, device="cuda")
        with pytest.raises(DataDependentOutputException):
            bool(torch.all(data == 1))


def test_a_padded_mask_answers_whether_it_has_global_attention():
    # Longformer: ones padded with 0 to the window, clamped, cast, gathered with arange indices,
    # made 0 / min by where, written at (mask == 2), then asked `(m > 0).any().item()`
    from torch._subclasses.fake_tensor import DataDependentOutputException

    with fake_gpu():
        mask = F.pad(torch.ones(2, 6, device="cuda"), (0, 2), value=0)
        allowed = torch.clamp(mask, min=0, max=1).to(torch.bool)
        kv = torch.arange(8, device="cuda")
        assert bool((kv >= 0).all()) is True
        gathered = allowed[torch.arange(2, device="cuda")[:, None], kv[None, :]]
        ext = torch.where(gathered, torch.tensor(0.0, device="cuda"), torch.finfo(torch.float32).min)
        ext[mask == 2] = torch.finfo(torch.float32).max   # selects nothing: mask is 0 or 1
        assert bool((ext > 0).flatten().any()) is False
        with pytest.raises(DataDependentOutputException):   # padding: both answers possible
            bool((ext < 0).any())
        ext[mask == 1] = 1.0   # a write the values cannot rule out
        with pytest.raises(DataDependentOutputException):
            bool((ext > 0).any())
        # compared in the tensor's type, as the kernel converts the scalar: 0.1 in fp16 is 0.1
        tenth = torch.full((4,), 0.1, device="cuda", dtype=torch.float16)
        assert bool((tenth == 0.1).all()) is True
        assert bool(((tenth * 0 + 1.5) == 1.5).all()) is True   # exact results are followed
        with pytest.raises(DataDependentOutputException):   # 1 + fp16(0.1) rounds: not followed
            bool(((tenth + 1.0) > 0).all())
        with pytest.raises(DataDependentOutputException):   # the same bits read as integers
            bool((torch.ones(2, device="cuda").view(torch.int32) == 1).all())


def test_known_values_only_ever_widen():
    # each rule keeps every value an element could hold (vest_slurm/estimate/_known.py)
    import operator

    from vest_slurm.estimate import _known as kn

    assert kn.cast(kn.Span(1, 5), torch.bool) == {True}
    assert kn.cast(kn.Span(-1, 1), torch.bool) == {False, True}
    assert kn.cast(kn.Span(0, 0), torch.bool) == {False}
    assert kn.cast(kn.Span(0.5, 2.5), torch.int64) == kn.Span(0, 2)
    assert kn.cast(frozenset({float("inf")}), torch.int64) is None
    assert kn.compare(kn.Span(0, 511), operator.ge, 0) == {True}
    assert kn.compare(kn.Span(0, 511), operator.lt, 256) == {False, True}
    assert kn.compare(kn.Span(0, 511), operator.eq, 600) == {False}
    assert kn.compare(kn.Span(0, 511), operator.eq, 7) == {False, True}
    assert kn.arange((10, 0, -2), {}) == kn.Span(2, 10)
    assert kn.arange((0, 1, 0.25), {}) == kn.Span(0, 0.75)
    assert kn.arange((5, 5), {}) == frozenset()
    assert kn.reduce(frozenset({0.0, 2.0}), any, 8) == {False, True}   # data decides
    assert kn.reduce(frozenset({0.0, 2.0}), any, 0) == {False}
    assert kn.union(frozenset(range(10)), frozenset(range(10, 20))) == kn.Span(0, 19)   # too many: kept as a span
    assert kn.where_truthy(frozenset({0.0, 1.0}), -9.0) == {0.0, -9.0}
    assert kn.where_truthy(kn.Span(1, 3), -9.0) == {-9.0}
    # values are kept as the tensor's type holds them: a compare answers as the kernel would
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for v in (0.1, 1 / 3, 70000.0, 1e39, -3.4028234663852886e38):
            assert kn.cast(frozenset({v}), dtype) == {torch.tensor(v, dtype=torch.float64).to(dtype).item()}
    assert kn.cast(frozenset({300}), torch.uint8) is None   # would wrap


def test_an_inverted_mask_keeps_its_zeros_where_the_mask_attends():
    # LED / transformers' _prepare_4d_attention_mask_inverted: 1 - m, masked_fill where it is
    # nonzero, times m: 0 where m attends, -0.0 where padded; never positive
    from torch._subclasses.fake_tensor import DataDependentOutputException

    with fake_gpu():
        m = F.pad(torch.ones(2, 6, device="cuda", dtype=torch.long), (0, 2), value=0)
        expanded = m[:, None, None, :].expand(2, 1, 8, 8).to(torch.float32)
        inverted = 1.0 - expanded
        filled = inverted.masked_fill(inverted.to(torch.bool), torch.finfo(torch.float32).min)
        assert bool((filled.mul(expanded) > 0).any()) is False
        # the same with the source written between the cast and the fill: no longer known
        inverted2 = 1.0 - expanded
        truth = inverted2.to(torch.bool)
        inverted2.add_(0.5)
        filled2 = inverted2.masked_fill(truth, torch.finfo(torch.float32).min)
        with pytest.raises(DataDependentOutputException):
            bool((filled2.mul(expanded) > 0).any())


def test_host_random_numbers_take_the_step_with_the_most_memory():
    # LayerDrop, `if torch.rand([]) < self.layerdrop: skip`, on the host: the draw keeps every
    # layer (a long run reaches that step); other draws repeat from one estimate to the next
    with fake_gpu() as seen:
        r = torch.rand([])
        assert 0.0 <= float(r) < 1.0
        assert bool(r < 0.999) is False and bool(r < 1.0) is True
        first = int(torch.randint(0, 1000, ()))
        assert seen.allocated == []
    with fake_gpu():
        assert int(torch.randint(0, 1000, ())) == first
    # the same for Python's and NumPy's scalar draws (Wav2Vec2's adapter: np.random.random() >
    # layerdrop; MusicGen: random.uniform(0, 1) < layerdrop); arrays of draws stay random
    import random

    import numpy as np

    draws = (random.random, random.uniform, np.random.random, np.random.uniform)
    with fake_gpu():
        assert random.random() > 0.999 and random.uniform(0, 1) > 0.999 and random.uniform(2, 4) > 3.999
        assert np.random.random() > 0.999 and np.random.uniform() > 0.999 and np.random.rand() > 0.999
        assert np.random.uniform(0.0, 1.0) > 0.999 and np.random.random(size=None) > 0.999
        assert np.random.random(1000).min() < 0.5 and np.random.uniform(0, 1, size=1000).min() < 0.5
    assert (random.random, random.uniform, np.random.random, np.random.uniform) == draws


class _PaddingWarning(torch.nn.Module):
    """transformers 4.x PreTrainedModel.warn_if_padding_and_no_attention_mask, as it reads values
    (5.x skips the check on traced tensors itself)."""

    def warn_if_padding_and_no_attention_mask(self, input_ids, attention_mask):
        if attention_mask is None and 0 in input_ids[:, [-1, 0]]:
            raise AssertionError("not reached on fake tensors")


def test_hf_padding_warning_reads_no_values():
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from vest_slurm.estimate.models import _skip_value_checks

    model = torch.nn.Sequential(_PaddingWarning())
    with fake_gpu():
        ids = torch.empty(2, 16, dtype=torch.long, device="cuda")
        with pytest.raises(DataDependentOutputException):
            model[0].warn_if_padding_and_no_attention_mask(ids, None)
        _skip_value_checks(model)
        model[0].warn_if_padding_and_no_attention_mask(ids, None)


# Representative ops of each CUDA autocast policy, copied by hand from torch 2.14.1's
# torch/include/ATen/autocast_mode.h (the torch install.sh pins), with the size of each list counted
# there: AT_FORALL_LOWER_PRECISION_FP 33 entries, AT_FORALL_FP32 59, AT_FORALL_FP32_SET_OPT_DTYPE 11,
# AT_FORALL_PROMOTE 11. "name.overload" where the header writes _(name, overload).
AUTOCAST_2_14 = {
    "LOWER_PRECISION_FP": (33, ("conv2d", "conv_transpose2d.input", "_convolution.deprecated", "mm", "bmm", "addmm",
                                "baddbmm", "linear", "matmul", "einsum", "prelu", "lstm_cell",
                                "scaled_dot_product_attention")),
    "FP32": (59, ("layer_norm", "native_layer_norm", "rms_norm", "group_norm", "exp", "log", "rsqrt", "softplus",
                  "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "frobenius_norm.dim", "nll_loss", "mse_loss",
                  "binary_cross_entropy_with_logits", "cdist", "logsumexp", "upsample_bilinear2d",
                  "_upsample_bicubic2d_aa")),
    "FP32_SET_OPT_DTYPE": (11, ("softmax.int", "log_softmax.int", "sum", "sum.dim_IntList", "cumsum", "prod.dim_int",
                                "linalg_vector_norm", "linalg_matrix_norm.str_ord")),
    "PROMOTE": (11, ("addcmul", "addcdiv", "atan2", "cross", "index_put", "scatter_add", "tensordot")),
}
NO_POLICY = ("relu", "gelu", "add.Tensor", "mul.Tensor", "embedding", "dropout", "softmax", "pow")


def test_autocast_policy_is_the_installed_torchs(tmp_path):
    """The CUDA autocast lists the fake mode applies are those of the installed torch's
    autocast_mode.h: checked against ops copied from that header by hand (AUTOCAST_2_14), not
    against the code's own parse of it."""
    import os

    header = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "autocast_mode.h")
    assert os.path.exists(header), header   # torch's wheels ship it; install.sh pins 2.14.1
    policy = fc.installed_autocast_policy()
    used = {"LOWER_PRECISION_FP": fc.LOWER_PRECISION_FP, "FP32": fc.FP32,
            "FP32_SET_OPT_DTYPE": fc.FP32_SET_OPT_DTYPE, "PROMOTE": fc.PROMOTE}
    for name, (count, ops) in AUTOCAST_2_14.items():
        for lists in (policy, used):
            assert len(lists[name]) == count, (name, lists[name])
            assert set(ops) <= set(lists[name]), (name, set(ops) - set(lists[name]))
            others = {op for other, (_, o) in AUTOCAST_2_14.items() if other != name for op in o}
            assert not others & set(lists[name]), (name, others & set(lists[name]))
            assert not set(NO_POLICY) & set(lists[name]), name
    older = tmp_path / "autocast_mode.h"   # the form of an older release, before rms_norm joined fp32
    older.write_text("#define AT_FORALL_LOWER_PRECISION_FP(_) \\\n  _(conv2d) \\\n  _(conv_transpose2d, input)\n\n"
                     "#define AT_FORALL_FP32(_) \\\n  _(layer_norm) \\\n  _(group_norm)\n\n"
                     "#define AT_FORALL_FP32_SET_OPT_DTYPE(_) \\\n  _(softmax, int)\n\n"
                     "#define AT_FORALL_PROMOTE(_) \\\n  _(addcmul)\n#endif\n")
    assert fc.installed_autocast_policy(str(older)) == {
        "LOWER_PRECISION_FP": ("conv2d", "conv_transpose2d.input"), "FP32": ("layer_norm", "group_norm"),
        "FP32_SET_OPT_DTYPE": ("softmax.int",), "PROMOTE": ("addcmul",)}
    (tmp_path / "broken.h").write_text("nothing here")
    assert fc.installed_autocast_policy(str(tmp_path / "broken.h")) is None


def test_rms_norm_runs_in_fp32_under_autocast():
    # torch 2.14's CUDA autocast puts rms_norm on its fp32 list (timm's RmsNorm calls it); the
    # torch that install.sh pins is 2.14.1, so this holds wherever the tests run
    with fake_gpu():
        x = torch.empty(4, 64, device="cuda", dtype=torch.float16)
        with torch.autocast("cuda", dtype=torch.float16):
            assert F.rms_norm(x, (64,)).dtype == torch.float32
            assert F.layer_norm(x, (64,)).dtype == torch.float32
            assert F.linear(torch.empty(4, 64, device="cuda"), torch.empty(8, 64, device="cuda")).dtype == torch.float16


def test_checks_on_values_read_as_a_healthy_run_in_dynamic_analysis_only():
    # dynamic analysis answers a script's checks as a healthy run would (the loss is finite),
    # through all/any/not and a host copy; the declarative tracer calls such a check data-dependent
    from torch._subclasses.fake_tensor import DataDependentOutputException

    with fake_gpu(scalar_stand_in=True):
        loss = torch.empty((), device="cuda")
        assert bool(torch.isfinite(loss)) is True
        assert bool(torch.isnan(loss).any()) is False
        assert bool(torch.isinf(loss).logical_not().all()) is True
        assert bool(torch.isfinite(loss).cpu()) is True
    with fake_gpu():
        loss = torch.empty((), device="cuda")
        with pytest.raises(DataDependentOutputException):
            bool(torch.isfinite(loss))


def test_grouped_mm_of_fp32_matrices_runs_as_on_the_gpu():
    # MoE experts (transformers' grouped_mm path) with fp32 weights: torch's meta kernel takes only
    # bf16/fp16, the CUDA op takes fp32 on its fallback path; the output's last dim is padded to
    # 16 bytes (create_grouped_gemm_output_tensor), and the backward runs it again for the grads
    with fake_gpu() as seen:
        x = torch.empty(10, 8, device="cuda", requires_grad=True)
        w = torch.empty(3, 8, 6, device="cuda", requires_grad=True)
        offs = torch.empty(3, dtype=torch.int32, device="cuda")
        mark = len(seen.allocated)
        y = torch.nn.functional.grouped_mm(x, w, offs=offs)
        assert y.shape == (10, 6) and y.dtype == torch.float32 and y.device.type == "cuda"
        assert y.stride() == (8, 1)
        assert seen.since(mark) == [(9 * 8 + 6) * 4]
        y.backward(torch.empty(10, 6, device="cuda"))
        assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_mixtral_traces_under_amp():
    spec = parse_workload_args(["--model", "hf:MixtralForCausalLM", "--batch-size", "2", "--input", "seq32",
                                "--precision", "amp-bf16", "--model-args",
                                '{"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, '
                                '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, '
                                '"num_local_experts": 4, "num_experts_per_tok": 2}'])
    trace = trace_training(spec)
    # the experts' up/gate projection of every routed token: 2 x 32 tokens x 2 experts each, 2 x 128 wide
    assert any(e.size_bytes == 2 * 32 * 2 * 2 * 128 * 4 for e in trace.events if e.action == "alloc")


def test_conv_workspace_key_expands_one_value_to_every_spatial_dim():
    # aten.convolution takes padding=[0] for a 2-d convolution (HF EfficientNet does): ATen
    # expands it to both dimensions, and so must the workspace key
    import json

    with fake_gpu():
        x = torch.empty(2, 3, 33, 33, device="cuda")
        w = torch.empty(8, 3, 3, 3, device="cuda")
        args = (x, w, None, [2], [0], [1], False, [0], 1)
        key = fc.conv_workspace_keys(torch.ops.aten.convolution.default, args)
    _kind, _x, _w, stride, padding, dilation = json.loads(key[0])[:6]
    assert (stride, padding, dilation) == ([2, 2], [0, 0], [1, 1])


def test_depthwise_convolution_of_a_channels_last_slice_runs_on_cudnn():
    """A channel slice of a channels-last activation (FocalNet's context) is not dense, but it
    suggests channels-last (c10's stride rule), so cuDNN takes the depthwise convolution in
    channels-last after a copy; an NCHW bf16 depthwise convolution takes ATen's kernel (no key)."""
    import json

    assert fc.suggests_channels_last((4, 96, 56, 56), (614656, 1, 10976, 196))
    assert not fc.suggests_channels_last((4, 96, 56, 56), (301056, 3136, 56, 1))
    assert not fc.suggests_channels_last((8, 2048, 1, 1), (2048, 1, 1, 1))   # ambiguous: NCHW
    with fake_gpu():
        h = torch.empty(4, 196, 56, 56, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
        w = torch.empty(96, 1, 3, 3, device="cuda", dtype=torch.bfloat16)
        sliced = (h[:, :96], w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 96)
        nchw = (torch.empty(4, 96, 56, 56, device="cuda", dtype=torch.bfloat16), *sliced[1:])
        keys = fc.conv_workspace_keys(torch.ops.aten.convolution.default, sliced)
        assert fc.conv_workspace_keys(torch.ops.aten.convolution.default, nchw) == []
    assert len(keys) == 1 and json.loads(keys[0])[7] is True   # channels_last


def test_grouped_query_attention_takes_flash_attention_with_its_expanded_gradients():
    """enable_gqa with fewer key/value heads: the GPU runs flash attention on them as they are
    (torch >= 2.5), whose backward sums the per-query-head key/value gradients from two buffers."""
    from vest_slurm.estimate.scratch import kernel_scratch

    b, hq, hkv, n, d = 2, 8, 2, 128, 64
    with fake_gpu():
        q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.float16, requires_grad=True)
        k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.float16, requires_grad=True)
        v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.float16, requires_grad=True)
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionBackward0"
        name, sizes = kernel_scratch(torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
                                     (out, q, k, v, out))
    assert name == "flash_attention"
    assert sizes[-2:] == [b * n * hq * d * 2] * 2


@pytest.mark.parametrize("autocast", [False, True])
def test_multihead_attention_takes_the_gpus_kernel(autocast):
    """nn.MultiheadAttention (torchvision's ViT, nn.TransformerEncoderLayer) calls
    scaled_dot_product_attention inside F.multi_head_attention_forward: the GPU's kernel there too,
    after autocast's cast (fp32 inputs under autocast run flash attention in fp16), not the
    host's ``_scaled_dot_product_flash_attention_for_cpu``."""
    with fake_gpu():
        mha = torch.nn.MultiheadAttention(64, 4, batch_first=True, device="cuda")
        x = torch.randn(2, 100, 64, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
            out, _ = mha(x, x, x, need_weights=False)
        seen, todo = set(), [out.grad_fn]
        while todo:
            node = todo.pop()
            if node is not None and node not in seen:
                seen.add(node)
                todo.extend(n for n, _ in node.next_functions)
        nodes = {type(node).__name__ for node in seen}
    kernel = "ScaledDotProductFlashAttentionBackward0" if autocast else "ScaledDotProductEfficientAttentionBackward0"
    assert kernel in nodes
    assert not any("ForCpu" in n for n in nodes)


def test_attention_kernel_leaves_real_tensors_to_pytorch():
    """The dispatcher kernel that picks the GPU's attention kernel for fake tensors hands real
    tensors (a measuring run on a GPU in the same process) to PyTorch's own composite."""
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)
    assert torch.allclose(fc._sdpa_kernel(q, q, q, None, 0.0, True),
                          F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert torch.allclose(fc._sdpa_kernel(q, k, k, enable_gqa=True),
                          F.scaled_dot_product_attention(q, k, k, enable_gqa=True))


def test_attention_the_gpu_runs_on_its_math_kernel_keeps_the_scores():
    """fp32 with a head dim that is not a multiple of 4 fits neither fused kernel: the GPU runs
    the math kernel and keeps the softmaxed scores for backward (the host's SDPA would pick its
    own flash kernel instead and keep none)."""
    b, h, n, d = 2, 4, 256, 6
    scores = b * h * n * n * 4
    with fake_gpu() as seen:
        q, k, v = (torch.randn(b, h, n, d, device="cuda", requires_grad=True) for _ in range(3))
        mask = torch.ones(n, n, device="cuda", dtype=torch.bool).tril()
        mark = len(seen.allocated)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert "FlashAttention" not in type(out.grad_fn).__name__
        kept = [size for block, size in seen.live.items() if size == scores]
    assert seen.since(mark).count(scores) >= 2
    assert kept, "the softmaxed scores stay alive for backward"


def test_one_key_value_head_without_enable_gqa_follows_the_installed_torchs_rule(tmp_path, monkeypatch):
    """Multi-query attention called without enable_gqa (Falcon): torch releases whose
    sdp_utils_cpp.h broadcasts one key/value head run a fused kernel; older ones, math."""
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")   # flash's and math's rules, not cuDNN's
    q = torch.empty(2, 8, 64, 64, dtype=torch.float16, device="meta")
    kv = torch.empty(2, 1, 64, 64, dtype=torch.float16, device="meta")
    old = tmp_path / "old.h"
    old.write_text("inline bool check_batch_size_and_num_heads_dense(sdp_params const& params, bool debug) {}")
    assert fc.installed_sdp_broadcasts_one_kv_head(str(old)) is False
    assert fc.installed_sdp_broadcasts_one_kv_head(str(tmp_path / "absent.h")) is False
    monkeypatch.setattr(fc, "SDP_BROADCASTS_ONE_KV_HEAD", False)
    assert fc.gpu_sdp_choice((9, 0), q, kv, kv, None, 0.0, False) == fc.SDP_MATH
    monkeypatch.setattr(fc, "SDP_BROADCASTS_ONE_KV_HEAD", True)
    assert fc.gpu_sdp_choice((9, 0), q, kv, kv, None, 0.0, False) == fc.SDP_FLASH
    two = torch.empty(2, 2, 64, 64, dtype=torch.float16, device="meta")
    assert fc.gpu_sdp_choice((9, 0), q, two, two, None, 0.0, False) == fc.SDP_MATH   # GQA needs enable_gqa
    assert fc.gpu_sdp_choice((9, 0), q, two, two, None, 0.0, True) == fc.SDP_FLASH


def test_bfloat16_before_sm80_is_emulated_as_pytorch_answers():
    """torch.cuda.is_bf16_supported() is true on a V100 (a bfloat16 tensor can be made there), so
    bf16 autocast runs; only ``including_emulation=False`` asks for sm80. Memory-efficient
    attention takes bf16 only from sm80: math before (flash needs sm80 anyway)."""
    q = torch.empty(2, 4, 64, 64, dtype=torch.bfloat16, device="meta")
    with fake_gpu(capability=(7, 0)):
        assert torch.cuda.is_bf16_supported() and not torch.cuda.is_bf16_supported(including_emulation=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = torch.nn.Linear(8, 8, device="cuda")(torch.randn(4, 8, device="cuda"))
        assert y.dtype == torch.bfloat16
    with fake_gpu(capability=(8, 0)):
        assert torch.cuda.is_bf16_supported(including_emulation=False)
    assert fc.gpu_sdp_choice((7, 0), q, q, q, None, 0.0, False) == fc.SDP_MATH
    assert fc.gpu_sdp_choice((7, 0), q.half(), q.half(), q.half(), None, 0.0, False) == fc.SDP_EFFICIENT
    assert fc.gpu_sdp_choice((8, 0), q, q, q, None, 0.0, False) == fc.SDP_FLASH


def test_the_attention_backend_follows_torchs_filters_and_the_scripts_switches(monkeypatch):
    """select_sdp_backend's filters (cuda/sdp_utils.cpp): flash takes any head dim up to 256 (one
    not a multiple of 8 is padded), not a causal mask over a non-square score matrix; the
    memory-efficient kernel's alignment is the GEMM's (fp32: 4 from sm80, 1 before); and a backend
    the script turned off (enable_flash_sdp(False), sdpa_kernel(SDPBackend.MATH)) is not chosen.
    vest took the math kernel for head dim 4 (+825% on a DreamBooth run) and flash where the
    script had asked for math (-85%), with no word either way."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")   # flash's and math's rules, not cuDNN's
    h4 = torch.empty(2, 8, 64, 4, dtype=torch.float16, device="meta")
    assert fc.gpu_sdp_choice((8, 0), h4, h4, h4, None, 0.0, False) == fc.SDP_FLASH
    q = torch.empty(2, 8, 16, 64, dtype=torch.float16, device="meta")
    kv = torch.empty(2, 8, 64, 64, dtype=torch.float16, device="meta")
    assert fc.gpu_sdp_choice((8, 0), q, kv, kv, None, 0.0, False) == fc.SDP_FLASH
    assert fc.gpu_sdp_choice((8, 0), q, kv, kv, None, 0.0, False, is_causal=True) == fc.SDP_EFFICIENT
    f6 = torch.empty(2, 8, 64, 6, dtype=torch.float32, device="meta")
    assert fc.gpu_sdp_choice((8, 0), f6, f6, f6, None, 0.0, False) == fc.SDP_MATH
    assert fc.gpu_sdp_choice((7, 0), f6, f6, f6, None, 0.0, False) == fc.SDP_EFFICIENT
    with sdpa_kernel(SDPBackend.MATH):
        assert fc.gpu_sdp_choice((9, 0), kv, kv, kv, None, 0.0, False) == fc.SDP_MATH
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        assert fc.gpu_sdp_choice((9, 0), kv, kv, kv, None, 0.0, False) == fc.SDP_EFFICIENT
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        assert fc.gpu_sdp_choice((9, 0), kv, kv, kv, None, 0.0, False) == fc.SDP_EFFICIENT
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(FailsOnAGpu, match="No available kernel"):
        fc.gpu_sdp_choice((7, 0), kv, kv, kv, None, 0.0, False)   # flash needs sm80; math is off
    # the padded flash kernel on the fake GPU: q, k and v copied to head dim 8, the output a view
    with fake_gpu(capability=(8, 0)):
        x = torch.empty(2, 8, 64, 4, dtype=torch.float16, device="cuda", requires_grad=True)
        out = torch.nn.functional.scaled_dot_product_attention(x, x, x)
        assert out.shape == (2, 8, 64, 4) and out._base is not None and out._base.shape[-1] == 8


def test_the_attention_kernel_follows_torchs_priority_order_and_takes_cudnn_where_torch_does(monkeypatch):
    """torch tries the kernels in its priority order: the script's (``sdpa_kernel([MATH, FLASH],
    set_priority=True)``: math first, the S x S scores kept; vest took flash, 7x low, silently), or
    its default, which puts cuDNN's attention first on sm90/sm100 with a cuDNN newer than 9.15
    (torch >= 2.9, unless TORCH_CUDNN_SDPA_DEPRIORITIZED). cuDNN alone (``sdpa_kernel(CUDNN_ATTENTION)``)
    runs where its filters take the inputs (it was refused as "no available kernel"). A kernel
    choice that fails on a GPU too is the script's (FailsOnAGpu), not vest's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    monkeypatch.setattr(torch, "__version__", "2.14.1+cu130")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(fc, "_cudnn_version", lambda: 92400)
    q = torch.empty(2, 8, 128, 64, dtype=torch.bfloat16, device="meta")
    assert fc.gpu_sdp_choice((9, 0), q, q, q, None, 0.0, False) == fc.SDP_CUDNN
    assert fc.gpu_sdp_choice((10, 0), q, q, q, None, 0.0, False) == fc.SDP_CUDNN
    assert fc.gpu_sdp_choice((8, 0), q, q, q, None, 0.0, False) == fc.SDP_FLASH      # Ampere: flash first
    assert fc.gpu_sdp_choice((12, 0), q, q, q, None, 0.0, False) == fc.SDP_FLASH     # consumer Blackwell
    h320 = torch.empty(2, 8, 128, 320, dtype=torch.bfloat16, device="meta")
    assert fc.gpu_sdp_choice((9, 0), h320, h320, h320, None, 0.0, False) == fc.SDP_EFFICIENT   # over both limits
    monkeypatch.setattr(fc, "_cudnn_version", lambda: 91500)
    assert fc.gpu_sdp_choice((9, 0), q, q, q, None, 0.0, False) == fc.SDP_FLASH
    monkeypatch.setattr(fc, "_cudnn_version", lambda: 92400)
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert fc.gpu_sdp_choice((9, 0), q, q, q, None, 0.0, False) == fc.SDP_FLASH
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], set_priority=True):
        assert fc.gpu_sdp_choice((9, 0), q, q, q, None, 0.0, False) == fc.SDP_MATH
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH], set_priority=True):
        assert fc.gpu_sdp_choice((9, 0), q, q, q, None, 0.0, False) == fc.SDP_FLASH
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        assert fc.gpu_sdp_choice((9, 0), q, q, q, None, 0.0, False) == fc.SDP_CUDNN
        with pytest.raises(FailsOnAGpu, match="No available kernel"):
            fc.gpu_sdp_choice((9, 0), q.float(), q.float(), q.float(), None, 0.0, False)   # cuDNN: fp16/bf16 only
    # cuDNN on the fake GPU: flash's buffers where flash's kernel would take the inputs (the same
    # algorithm: output, fp32 log-sum-exp, dQ accumulator), cuDNN's own kernel where not (a mask)
    with fake_gpu(capability=(9, 0)), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        x = torch.empty(2, 8, 128, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        out = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        assert out.shape == (2, 8, 128, 64) and "Flash" in type(out.grad_fn).__name__
        mask = torch.zeros(2, 1, 128, 128, dtype=torch.bfloat16, device="cuda")
        out = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
        assert out.shape == (2, 8, 128, 64) and "Cudnn" in type(out.grad_fn).__name__
        out.sum().backward()
        assert x.grad.shape == x.shape


def _conv(dtype, groups=1, n=4, c=64, hw=28, k=3):
    x = torch.empty(n, c, hw, hw, device="cuda", dtype=dtype)
    w = torch.empty(c, c // groups, k, k, device="cuda", dtype=dtype)
    return (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], groups)


def test_bfloat16_convolution_before_sm80_runs_im2col_off_cudnn():
    """cuDNN takes bf16 convolutions from sm80 only (use_cudnn: supportsBFloat16ConvolutionWithCuDNNv8);
    on a V100 ATen's im2col + GEMM runs them with no cuDNN workspace and an im2col buffer of one
    sample, C_in x kH x kW x H_out x W_out; fp16 there, and bf16 on an A100, go to cuDNN."""
    from vest_slurm.estimate.scratch import kernel_scratch

    conv, conv_bwd = torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default
    columns = 64 * 3 * 3 * 28 * 28 * 2
    with fake_gpu(capability=(7, 0)):
        bf16, fp16 = _conv(torch.bfloat16), _conv(torch.float16)
        assert fc.conv_workspace_keys(conv, bf16) == [] and len(fc.conv_workspace_keys(conv, fp16)) == 1
        assert kernel_scratch(conv, bf16) == ("conv_scratch", [columns])
        assert kernel_scratch(conv, fp16) == ("conv_scratch", [])   # dense operands: no copies
        g = torch.empty(4, 64, 28, 28, device="cuda", dtype=torch.bfloat16)
        bwd = (g, *bf16[:2], [64], *bf16[3:], [True, True, False])
        assert kernel_scratch(conv_bwd, bwd) == ("conv_scratch", [columns])
        # an NCHW depthwise convolution takes ATen's depthwise kernel, as in fp16 and fp32: no im2col
        assert kernel_scratch(conv, _conv(torch.bfloat16, groups=64)) == ("conv_scratch", [])
    with fake_gpu(capability=(8, 0)):
        assert len(fc.conv_workspace_keys(conv, _conv(torch.bfloat16))) == 1


def test_grouped_im2col_convolution_keeps_every_groups_result_until_cat():
    """With groups, Convolution.cpp runs im2col + GEMM per group on a copied slice of the input and
    joins the groups' outputs (forward) and input gradients (backward) with ``at::cat``: a second
    output-sized buffer while the op runs. At batch 1 a group's slice is contiguous: no copy."""
    from vest_slurm.estimate.scratch import kernel_scratch

    conv, conv_bwd = torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default
    n, c, hw, groups = 4, 64, 28, 8
    out = in_ = n * c * hw * hw * 2
    columns, slice_ = (c // groups) * 9 * hw * hw * 2, in_ // groups
    with fake_gpu(capability=(7, 5)):
        args = _conv(torch.bfloat16, groups=groups, n=n, c=c, hw=hw)
        assert kernel_scratch(conv, args) == ("conv_scratch", [out, slice_, columns])
        g = torch.empty(n, c, hw, hw, device="cuda", dtype=torch.bfloat16)
        bwd = (g, *args[:2], [c], *args[3:], [True, True, False])
        weight_grad = args[1].numel() * 2
        assert kernel_scratch(conv_bwd, bwd) == ("conv_scratch", [in_ + weight_grad, out // groups, slice_, columns])
        one = _conv(torch.bfloat16, groups=groups, n=1, c=c, hw=hw)
        assert kernel_scratch(conv, one) == ("conv_scratch", [c * hw * hw * 2, columns])


def test_op_leaves_finds_the_tensors_devices_and_strings_pytree_finds():
    """_fakecuda._op_leaves walks an aten op's arguments directly; what the dispatch checks among
    them (tensors, devices, strings) is what pytree.tree_leaves finds, nested or not."""
    from torch.utils import _pytree as pytree

    from vest_slurm.estimate._fakecuda import _op_leaves

    t, u = torch.zeros(2), torch.ones(3)
    cases = [((t, 2, [u, None, t]), {}), ((t,), {"device": torch.device("cpu"), "dtype": torch.float32}),
             (([t, [u]],), {}), ((t, {"a": u}), {"b": [t, (u,)]}), ((), {"size": [2, 3], "device": "cuda:0"}),
             ((torch.Size([2, 3]), "cpu"), {})]

    def seen(leaves):
        return [x if not isinstance(x, torch.Tensor) else id(x) for x in leaves
                if isinstance(x, (torch.Tensor, torch.device, str))]

    for args, kwargs in cases:
        assert seen(_op_leaves(args, kwargs)) == seen(pytree.tree_leaves((args, kwargs))), (args, kwargs)
