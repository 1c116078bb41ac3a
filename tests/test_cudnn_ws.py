"""cuDNN convolution workspaces: which convolutions the trace hands to cuDNN (ATen's backend
choice), and how the estimator sizes them per GPU from cuDNN's own heuristics (no GPU needed)."""

import json

import cudnn   # nvidia-cudnn-frontend: a dependency (pyproject), asked directly below
import pytest
import torch

from vest_slurm.estimate import cudnn_ws
from vest_slurm.estimate.estimator import _events_for, _without_cudnn_workspaces, estimate_from_trace, trace_for
from vest_slurm.estimate.profiles import PROFILES, get_profile
from vest_slurm.estimate.tracing import trace_training
from vest_slurm.estimate.workload import parse_workload_args

USER = "tests/data/user_models.py"
A100 = get_profile("a100-40gb")


def spec(*argv):
    return parse_workload_args(list(argv))


def require_cudnn():
    assert cudnn_ws.available(), ("cuDNN >= 9.8 (the libcudnn torch's CUDA build ships) with its Python frontend "
                                  "(nvidia-cudnn-frontend) does not load: bash scripts/install.sh")


_DT = {"float32": cudnn.data_type.FLOAT, "float16": cudnn.data_type.HALF, "bfloat16": cudnn.data_type.BFLOAT16}


def ask_cudnn(profile, key: str, benchmark: bool = False) -> int:
    """cuDNN's own answer for one convolution of a trace (a cudnn_ws.conv_key string), asked here
    through cuDNN's Python frontend and not through cudnn_ws: the operation graph of the
    convolution with the trace's shapes and layout, the engine configurations of heuristics mode A
    (and, for benchmark mode, of the fallback list), less those PyTorch's Conv_v8.cpp filters out
    (DOWN_CONVERT_INPUTS; TENSOR_CORE for fp32 with allow_tf32 off). Without benchmark: the
    workspace of the plan the frontend's HEURISTICS_CHOICE policy builds (the first that builds,
    what PyTorch runs). With it: the largest workspace of all plans that build. The board is
    cudnn_ws's device-properties descriptor (its figures checked in test_device_properties_...)."""
    kind, x, w, stride, pad, dil, dtype, nhwc, tf32 = json.loads(key)
    n, c, h, wd = x
    k, cg, r, s_ = w
    ho = (h + 2 * pad[0] - dil[0] * (r - 1) - 1) // stride[0] + 1     # the output size of a convolution
    wo = (wd + 2 * pad[1] - dil[1] * (s_ - 1) - 1) // stride[1] + 1

    def layout(dims):
        a, b, hh, ww = dims
        return [b * hh * ww, 1, ww * b, b] if nhwc else [b * hh * ww, hh * ww, ww, 1]

    dt = _DT[dtype]
    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT,
                      device_property=cudnn.create_device_properties(cudnn_ws.device_properties_json(profile)))
    conv = dict(padding=pad, stride=stride, dilation=dil)
    image = g.tensor(name="x", dim=x, stride=layout(x), data_type=dt)
    weight = g.tensor(name="w", dim=w, stride=layout(w), data_type=dt)
    grad_out = g.tensor(name="dy", dim=[n, k, ho, wo], stride=layout([n, k, ho, wo]), data_type=dt)
    if kind == "fprop":
        out = g.conv_fprop(image=image, weight=weight, **conv)
    elif kind == "dgrad":
        out = g.conv_dgrad(loss=grad_out, filter=weight, **conv)
        out.set_dim(x).set_stride(layout(x))
    else:
        out = g.conv_wgrad(image=image, loss=grad_out, **conv)
        out.set_dim(w).set_stride(layout(w))
    out.set_output(True).set_data_type(dt)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK] if benchmark else [cudnn.heur_mode.A])
    g.deselect_numeric_notes([cudnn.numerical_note.DOWN_CONVERT_INPUTS]
                             + ([cudnn.numerical_note.TENSOR_CORE] if dtype == "float32" and not tf32 else []))
    if not benchmark:
        g.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
        return int(g.get_workspace_size())
    sizes = []
    for i in range(g.get_execution_plan_count()):
        try:
            g.build_plan_at_index(i)
        except Exception:   # deselected, or an engine that does not build for this graph
            continue
        sizes.append(int(g.get_workspace_size_plan_at_index(i)))
    return max(sizes)


def conv_keys(trace):
    return [json.loads(e.detail) for e in trace.events if e.module == "cudnn" and e.action == "alloc"]


def test_each_convolution_is_recorded_with_its_shapes():
    # resnet18 on 3x32x32, batch 4: 20 convolutions; the stem's input needs no gradient, so its
    # backward runs backward-filter only (output_mask), the other 19 run backward-data and -filter
    tr = trace_training(spec("--model", "torchvision:resnet18", "--batch-size", "4", "--input", "3x32x32",
                             "--optimizer", "sgd", "--steps", "1"))
    keys = conv_keys(tr)
    kinds = [k[0] for k in keys]
    assert kinds.count("fprop") == 20 and kinds.count("wgrad") == 20 and kinds.count("dgrad") == 19
    stem = keys[0]
    assert stem == ["fprop", [4, 3, 32, 32], [64, 3, 7, 7], [2, 2], [3, 3], [1, 1], "float32", False, True]
    assert all(k[6] == "float32" and k[7] is False and k[8] is True for k in keys)


def test_tf32_off_is_recorded_and_restored():
    before = torch.backends.cudnn.allow_tf32
    tr = trace_training(spec("--model", "torchvision:resnet18", "--batch-size", "2", "--input", "3x32x32",
                             "--optimizer", "sgd", "--steps", "1", "--cudnn-tf32", "off"))
    assert all(k[8] is False for k in conv_keys(tr))
    assert torch.backends.cudnn.allow_tf32 == before


def test_amp_channels_last_keys():
    tr = trace_training(spec("--model", "torchvision:resnet18", "--batch-size", "2", "--input", "3x32x32",
                             "--optimizer", "sgd", "--steps", "1", "--precision", "amp-fp16", "--channels-last"))
    keys = conv_keys(tr)
    assert keys and all(k[6] == "float16" and k[7] is True for k in keys)


def _fake_conv_keys(x, w, stride=(1, 1), padding=(0, 0), dilation=(1, 1)):
    from torch._subclasses import FakeTensorMode

    from vest_slurm.estimate import _fakecuda as fc

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        xs = mode.from_tensor(x, static_shapes=True)
        ws = mode.from_tensor(w, static_shapes=True)
    xs.fake_device = ws.fake_device = torch.device("cuda", 0)   # what the fake CUDA mode gives them
    return fc.conv_workspace_keys(torch.ops.aten.convolution.default,
                                  (xs, ws, None, list(stride), list(padding), list(dilation), False, [0, 0], 1))


def test_depthwise_follows_atens_backend_choice():
    # groups == channels: ATen's own depthwise kernel (no workspace) for fp32 and bf16 in NCHW;
    # cuDNN for channels_last, and for fp16 with a square 3x3 filter at stride 1
    x = torch.empty(8, 64, 28, 28)
    w = torch.empty(64, 1, 3, 3)
    assert _fake_conv_keys(x, w) == []
    assert _fake_conv_keys(x.to(torch.bfloat16), w.to(torch.bfloat16)) == []
    assert len(_fake_conv_keys(x.half(), w.half())) == 1
    assert _fake_conv_keys(x.half(), w.half(), stride=(2, 2)) == []
    cl = _fake_conv_keys(x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last))
    assert len(cl) == 1 and json.loads(cl[0])[7] is True
    # a conv1d runs as a 2-d one of height 1; a grouped (not depthwise) conv goes to cuDNN
    (k1,) = _fake_conv_keys(torch.empty(2, 80, 300), torch.empty(384, 80, 3), stride=(1,), padding=(1,), dilation=(1,))
    assert json.loads(k1)[1:6] == [[2, 80, 1, 300], [384, 80, 1, 3], [1, 1], [0, 1], [1, 1]]
    assert len(_fake_conv_keys(torch.empty(2, 64, 14, 14), torch.empty(64, 16, 3, 3))) == 1


def test_device_properties_build_for_every_profile():
    require_cudnn()
    for p in PROFILES.values():
        props = cudnn_ws.device_properties_json(p)
        assert props is not None and json.loads(props)["deviceName"] == p.name
        cudnn_ws._device_property(props)   # cuDNN accepts it (raises otherwise)
    # two boards by hand, from NVIDIA's specifications: SMs, compute capability, memory, L2
    a100 = json.loads(cudnn_ws.device_properties_json(A100))
    assert (a100["multiProcessorCount"], a100["deviceVer"], a100["totalGlobalMem"], a100["l2CacheSize"]) == (
        108, 800, 40 * 2**30, 40 * 2**20)
    h100 = json.loads(cudnn_ws.device_properties_json(get_profile("h100-80gb")))
    assert (h100["multiProcessorCount"], h100["deviceVer"], h100["l2CacheSize"]) == (132, 900, 50 * 2**20)


# A 3x3 convolution, batch 64, 128 -> 128 channels at 56x56, stride 1, padding 1: input and output
# of 64*128*56*56 elements each, filter of 128*128*3*3.
ACT, FILT = 64 * 128 * 56 * 56, 128 * 128 * 3 * 3


@pytest.mark.parametrize("dtype, channels_last, expected", [
    # fp16 in NHWC: the tensor-core kernels read and write this layout as it is: no workspace
    ("float16", True, 0),
    # fp16 in NCHW: the input and the filter are transposed to NHWC in the workspace (2 bytes an
    # element), 16 bytes beside them
    ("float16", False, 2 * (ACT + FILT) + 16),
    # fp32 (TF32 allowed) in NCHW: input, output and filter transposed (4 bytes an element), + 16
    ("float32", False, 4 * (ACT + ACT + FILT) + 16),
])
def test_forward_workspace_on_an_a100_is_the_layout_transform(dtype, channels_last, expected):
    """Sizes derived by hand from the tensors a layout transform copies, as cuDNN 9.24 (torch 2.14.1's)
    answers for the A100: the estimator, and cuDNN asked directly, give them."""
    require_cudnn()
    key = cudnn_ws.conv_key("fprop", [64, 128, 56, 56], [128, 128, 3, 3], [1, 1], [1, 1], [1, 1], dtype, channels_last)
    assert ask_cudnn(A100, key) == expected, f"cuDNN {cudnn.backend_version()}: re-derive for this version"
    assert cudnn_ws.workspace_for(A100, key) == expected


def test_estimator_sizes_workspaces_from_cudnn_and_required_goes_without():
    s = spec("--model", "torchvision:vgg11", "--batch-size", "8", "--input", "3x64x64", "--optimizer", "adam")
    summary = trace_for(s, A100)
    events = _events_for(summary.trace.events, A100, s, summary)
    sized = [(e.detail, e.size_bytes) for e in events if e.module == "cudnn" and e.action == "alloc"]
    require_cudnn()
    asked = {d: ask_cudnn(A100, d) for d in {d for d, _ in sized}}   # cuDNN itself, each distinct convolution
    assert sized and all(size == asked[d] for d, size in sized)
    lean = _without_cudnn_workspaces(events)
    assert all(e.size_bytes == 0 for e in lean if e.module == "cudnn")
    est = estimate_from_trace(summary, s, A100)
    b = dict(est.breakdown)
    assert b["cudnn_workspace_max"] == max(asked.values()) > 0   # fp32 NCHW 3x3 convolutions take one
    assert est.required_bytes <= est.peak_bytes


def test_without_the_frontend_workspaces_are_zero(monkeypatch):
    s = spec("--model", "torchvision:resnet18", "--batch-size", "2", "--input", "3x32x32", "--optimizer", "sgd")
    summary = trace_for(s, A100)
    cudnn_ws.workspace_bytes.cache_clear()
    monkeypatch.setattr(cudnn_ws, "_frontend", lambda: None)
    # the answers this process already had (an earlier test's convolutions of the same shapes)
    monkeypatch.setattr(cudnn_ws, "_ANSWERS", cudnn_ws._Answers())
    try:
        est = estimate_from_trace(summary, s, A100)
    finally:
        cudnn_ws.workspace_bytes.cache_clear()
    assert dict(est.breakdown)["cudnn_workspace_max"] == 0


def test_the_table_says_when_cudnn_cannot_be_asked(monkeypatch):
    from vest_slurm.estimate.report import estimate_table

    s = spec("--model", "torchvision:resnet18", "--batch-size", "2", "--input", "3x32x32", "--optimizer", "sgd")
    est = estimate_from_trace(trace_for(s, A100), s, A100)
    require_cudnn()
    assert "not in this estimate" not in estimate_table(s, [est])
    monkeypatch.setattr(cudnn_ws, "_frontend", lambda: None)
    assert "cuDNN's convolution workspaces are not in this estimate" in estimate_table(s, [est])


# ---- torch.backends.cudnn.benchmark: one timing workspace per convolution shape ----

def find_keys(trace):
    return [e.detail for e in trace.events if e.module == "cudnn_find" and e.action == "alloc"]


def test_benchmark_mode_times_each_shape_once_and_is_restored():
    before = torch.backends.cudnn.benchmark
    common = ("--model", "torchvision:resnet18", "--batch-size", "2", "--input", "3x32x32", "--optimizer", "sgd",
              "--steps", "2")
    on = trace_training(spec(*common, "--cudnn-benchmark", "on"))
    assert torch.backends.cudnn.benchmark == before
    found = find_keys(on)
    run_keys = [e.detail for e in on.events if e.module == "cudnn" and e.action == "alloc"]
    # every distinct convolution (forward, backward-data, backward-filter) is timed exactly once,
    # in the first step, just before its first run; the second step only runs them
    assert len(found) == len(set(found)) == len(set(run_keys)) < len(run_keys)
    first_step_end = on.step_ends[0]
    idx = [i for i, e in enumerate(on.events) if e.module == "cudnn_find" and e.action == "alloc"]
    assert max(idx) < first_step_end
    for i in idx:
        # the timing workspace is freed before the chosen plan's own workspace is taken
        assert on.events[i + 1].action == "free" and on.events[i + 1].block == on.events[i].block
        assert on.events[i + 2].module == "cudnn" and on.events[i + 2].detail == on.events[i].detail
    off = trace_training(spec(*common))
    assert find_keys(off) == []
    assert [e.detail for e in off.events if e.module == "cudnn"] == [e.detail for e in on.events if e.module == "cudnn"]


def test_benchmark_workspace_is_the_largest_of_all_plans():
    require_cudnn()
    h100 = get_profile("h100-80gb")
    props = cudnn_ws.device_properties_json(h100)
    for kind in ("fprop", "dgrad", "wgrad"):
        key = cudnn_ws.conv_key(kind, [64, 128, 56, 56], [128, 128, 3, 3], [1, 1], [1, 1], [1, 1], "float32", False)
        largest, first = ask_cudnn(h100, key, benchmark=True), ask_cudnn(h100, key)
        assert cudnn_ws.find_workspace_bytes(props, key) == largest
        assert cudnn_ws.workspace_bytes(props, key) == first
        assert largest >= first > 0
    # fp32 3x3 forward in NCHW: the heuristics' first plan on the H100 takes about one fp32
    # activation (4 * ACT bytes: a layout copy); the largest plan of the list more than twice that
    fwd = cudnn_ws.conv_key("fprop", [64, 128, 56, 56], [128, 128, 3, 3], [1, 1], [1, 1], [1, 1], "float32", False)
    assert 4 * ACT <= cudnn_ws.workspace_bytes(props, fwd) < 4 * (ACT + FILT) + 4096
    assert cudnn_ws.find_workspace_bytes(props, fwd) > 2 * cudnn_ws.workspace_bytes(props, fwd)


def test_estimator_sizes_benchmark_workspaces_and_required_goes_without():
    common = ("--model", "torchvision:vgg11", "--batch-size", "8", "--input", "3x64x64", "--optimizer", "adam")
    s_on, s_off = spec(*common, "--cudnn-benchmark", "on"), spec(*common)
    on, off = trace_for(s_on, A100), trace_for(s_off, A100)
    events = _events_for(on.trace.events, A100, s_on, on)
    sized = [(e.detail, e.size_bytes) for e in events if e.module == "cudnn_find" and e.action == "alloc"]
    require_cudnn()
    asked = {d: ask_cudnn(A100, d, benchmark=True) for d in {d for d, _ in sized}}
    assert sized and all(size == asked[d] for d, size in sized)
    assert all(e.size_bytes == 0 for e in _without_cudnn_workspaces(events) if e.module == "cudnn_find")
    est_on, est_off = estimate_from_trace(on, s_on, A100), estimate_from_trace(off, s_off, A100)
    b = dict(est_on.breakdown)
    assert b["cudnn_benchmark_workspace_max"] == max(size for _, size in sized)
    assert "cudnn_benchmark_workspace_max" not in dict(est_off.breakdown)
    # at capacity benchmark mode halves its timing workspace until it fits: the smallest GPU the job
    # runs on is the same with and without it
    assert est_on.required_bytes == est_off.required_bytes
    assert est_on.peak_bytes >= est_off.peak_bytes
    assert b["cudnn_benchmark_workspace_max"] >= b["cudnn_workspace_max"] > 0


def test_a_peak_above_the_gpu_is_capped_where_the_job_still_runs():
    common = ("--model", "torchvision:vgg11", "--batch-size", "8", "--input", "3x64x64", "--optimizer", "adam",
              "--cudnn-benchmark", "on")
    s = spec(*common)
    summary = trace_for(s, A100)
    free = estimate_from_trace(summary, s, A100)
    require_cudnn()
    # cuDNN's benchmark workspaces (tens of MiB here) separate the peak from what the job needs
    assert free.peak_bytes - free.required_bytes >= 4 * 2**20, (free.peak_bytes, free.required_bytes)
    # a board whose usable memory lies between what the job needs and its uncapped peak
    usable_mib = (free.required_bytes + free.peak_bytes) // 2 // 2**20
    small = A100.with_overrides(total_mib=usable_mib + A100.reserved_mib)
    capped = estimate_from_trace(summary, s, small)
    assert capped.fits and capped.required_bytes == free.required_bytes
    assert capped.peak_bytes == small.usable_bytes < free.peak_bytes
    # where the job does not fit, the uncapped peak is what it would have needed
    tiny = A100.with_overrides(total_mib=free.required_bytes // 2**20 // 2 + A100.reserved_mib)
    over = estimate_from_trace(summary, s, tiny)
    assert not over.fits and over.peak_bytes == free.peak_bytes


def test_benchmark_cache_is_per_thread():
    # Conv_v8.cpp keeps its benchmark cache thread_local: a forward convolution recomputed in
    # backward (activation checkpointing) runs on autograd's thread and is timed there once more.
    # The recompute stops once the tensors backward needs exist again (non-reentrant checkpoint's
    # early stop): the first convolution only, whose ReLU output the second one saved.
    tr = trace_training(spec("--model", f"{USER}:checkpointed_cnn", "--batch-size", "2", "--input", "3x16x16",
                             "--optimizer", "sgd", "--steps", "2", "--cudnn-benchmark", "on"))
    found = [(e.phase, *json.loads(e.detail)[:2]) for e in tr.events if e.module == "cudnn_find" and e.action == "alloc"]
    first, second = [2, 3, 16, 16], [2, 8, 16, 16]
    assert found == [("forward", "fprop", first), ("forward", "fprop", second), ("backward", "fprop", first),
                     ("backward", "dgrad", second), ("backward", "wgrad", second), ("backward", "wgrad", first)]
    runs = [e for e in tr.events if e.module == "cudnn" and e.action == "alloc"]
    assert len(runs) == 2 * len(found)   # the second step runs every one of them without timing


def test_cudnn_version_text_and_which_cudnn_is_assumed(monkeypatch):
    """cudnn.h's version numbers; whether the heuristics asked here are the job's cuDNN's: this
    torch's cuDNN, or $VEST_JOB_CUDNN where the job runs another."""
    from vest_slurm.estimate.cudnn_ws import (_frontend, assumed_note, heuristics_are_the_jobs, job_cudnn_version,
                                              version_text)

    assert version_text(92400) == "9.24.0" and version_text(90800) == "9.8.0" and version_text(8902) == "8.9.2"
    here = _frontend().backend_version()
    monkeypatch.delenv("VEST_JOB_CUDNN", raising=False)
    ok, why = heuristics_are_the_jobs()
    assert ok == (job_cudnn_version() == here) and (assumed_note() == "") == ok
    monkeypatch.setenv("VEST_JOB_CUDNN", version_text(here))
    assert heuristics_are_the_jobs() == (True, "") and assumed_note() == ""
    monkeypatch.setenv("VEST_JOB_CUDNN", "8.9.7")
    ok, why = heuristics_are_the_jobs()
    assert not ok and "8.9.7" in why and "without a GPU" in why and "largest workspace" in assumed_note()
    monkeypatch.setenv("VEST_JOB_CUDNN", "unknown")
    ok, why = heuristics_are_the_jobs()
    assert not ok and "unknown" in why and version_text(here) in why


def test_the_jobs_cudnn_read_from_the_installed_files_is_torchs_answer(monkeypatch):
    """torch/version.py and the nvidia-cudnn wheel beside torch give what torch itself answers
    (torch.version.cuda, torch.backends.cudnn.version()); an LD_PRELOAD of a libcudnn leaves it to torch."""
    import torch

    known, version = cudnn_ws._cudnn_version_of_installed_torch()
    expected = None if torch.version.cuda is None else torch.backends.cudnn.version()
    assert not known or version == expected
    if torch.version.cuda is None or cudnn_ws._preload_torch_cudnn():
        assert known   # a CPU build, or a CUDA wheel with its nvidia-cudnn wheel: read without torch
    if torch.version.cuda is not None:
        monkeypatch.setenv("LD_PRELOAD", "/opt/other/libcudnn.so.9")
        assert cudnn_ws._cudnn_version_of_installed_torch() == (False, None)


def test_placement_bounds_the_engines_where_the_cudnn_asked_is_not_the_jobs(monkeypatch):
    """peak stays the first plan's; placement takes the peak with every convolution at the largest
    workspace over the engines (heuristics A + fallback), and the attached estimate carries it."""
    from vest_slurm.site.placement import estimate_need
    from vest_slurm.slurm.attach import make_payload

    require_cudnn()
    p = get_profile("a100-40gb")
    sp = spec("--model", "torchvision:resnet18", "--batch-size", "16", "--input", "3x128x128")
    summary = trace_for(sp, p)
    monkeypatch.setenv("VEST_JOB_CUDNN", cudnn_ws.version_text(cudnn.backend_version()))
    same = estimate_from_trace(summary, sp, p)
    assert same.placement_bytes == 0 and "cudnn_engines_bound_peak" not in dict(same.breakdown)
    monkeypatch.setenv("VEST_JOB_CUDNN", "9.1.0")
    other = estimate_from_trace(summary, sp, p)
    bound = dict(other.breakdown)["cudnn_engines_bound_peak"]
    assert other.peak_bytes == same.peak_bytes and other.placement_bytes == bound > 0
    assert estimate_need(other) == max(other.peak_bytes, other.required_bytes, bound)
    # each convolution's largest engine workspace is at least the first plan's, and larger somewhere
    keys = {e.detail for e in summary.trace.events if e.module == "cudnn" and e.action == "alloc" and e.detail}
    sizes = [(cudnn_ws.workspace_for(p, k), cudnn_ws.workspace_for(p, k, benchmark=True)) for k in keys]
    assert all(b >= a for a, b in sizes) and any(b > a for a, b in sizes)
    payload = make_payload({"a100": other})
    assert payload.gpu("a100").peak_bytes == max(other.peak_bytes, bound)


def test_the_job_python_s_cudnn_is_asked_of_that_python(monkeypatch, tmp_path):
    """A job whose command runs another Python than vest's: its torch is asked for its cuDNN
    ($VEST_JOB_CUDNN, said with where it comes from). Real interpreters: vest's own through a
    venv that sees its packages (another environment, the same torch: its real cuDNN), Debian's python3 without torch
    (unknown: placement bounds the engines), and vest's own (nothing asked)."""
    import os
    import shutil
    import sys

    from vest_slurm.dynamic.launch import parse_train_command

    monkeypatch.delenv(cudnn_ws.JOB_CUDNN_ENV, raising=False)
    # vest's own python: nothing to ask
    assert cudnn_ws.use_job_python(sys.executable) == "" and cudnn_ws.JOB_CUDNN_ENV not in os.environ
    # a venv-style python elsewhere, found on the job's PATH through a launcher's #! line
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "python").symlink_to(sys.executable)
    # a venv (its pyvenv.cfg) that sees this Python's packages: another environment, the same torch
    (tmp_path / "venv" / "pyvenv.cfg").write_text(f"home = {os.path.dirname(os.path.realpath(sys.executable))}\n"
                                                  "include-system-site-packages = true\n")
    (bindir / "torchrun").write_text("#!/usr/bin/env python\nimport sys\n")
    (bindir / "torchrun").chmod(0o755)
    cmd = parse_train_command("srun torchrun --nproc_per_node=2 train.py --lr 1")
    assert cmd.program == "torchrun" and cmd.launcher == "torchrun"
    note = cudnn_ws.use_job_python(cmd.program, str(bindir), str(tmp_path))
    assert str(bindir / "python") in note and os.environ[cudnn_ws.JOB_CUDNN_ENV] == \
        cudnn_ws.version_text(torch.backends.cudnn.version())
    version, src = cudnn_ws.jobs_cudnn()
    assert version == torch.backends.cudnn.version() and str(bindir / "python") in src
    # a later job of this process that runs vest's python: the earlier job's answer is dropped
    assert cudnn_ws.use_job_python(sys.executable) == "" and cudnn_ws.JOB_CUDNN_ENV not in os.environ
    # the site's or the user's $VEST_JOB_CUDNN is not overridden
    monkeypatch.setenv(cudnn_ws.JOB_CUDNN_ENV, "8.9.7")
    assert cudnn_ws.use_job_python("/usr/bin/python3") == "" and os.environ[cudnn_ws.JOB_CUDNN_ENV] == "8.9.7"
    monkeypatch.delenv(cudnn_ws.JOB_CUDNN_ENV)
    plain = shutil.which("python3", path="/usr/bin")
    if plain is None or os.system(f"{plain} -c 'import torch' 2>/dev/null") == 0:
        pytest.skip("no python3 without torch in /usr/bin")
    note = cudnn_ws.use_job_python(parse_train_command(f"{plain} train.py").program)
    assert os.environ[cudnn_ws.JOB_CUDNN_ENV] == "unknown" and "no torch answered" in note
    ok, why = cudnn_ws.heuristics_are_the_jobs()
    require_cudnn()
    assert not ok and "unknown" in why and plain in why


@pytest.mark.parametrize("gpu", ["v100-16gb", "t4-16gb", "a100-80gb", "h100-80gb", "l40s-48gb"])
def test_the_cpp_graph_answers_what_the_python_frontend_does(gpu):
    """cudnn_ws asks the frontend's C++ graph directly (cudnn_ws._graph_class), not its Python IR:
    the plan PyTorch runs and benchmark mode's largest are those of cuDNN asked through the Python
    frontend (ask_cudnn), on convolutions of each kind, layout and dtype."""
    require_cudnn()
    p = get_profile(gpu)
    props = cudnn_ws.device_properties_json(p)
    cudnn_ws.workspace_bytes.cache_clear()
    cudnn_ws.find_workspace_bytes.cache_clear()
    for kind in ("fprop", "dgrad", "wgrad"):
        for x, w, stride, pad, dtype, nhwc, tf32 in (
                ([32, 256, 28, 28], [128, 256, 1, 1], [1, 1], [0, 0], "float32", False, True),
                ([32, 64, 56, 56], [64, 64, 3, 3], [2, 2], [1, 1], "float32", False, False),
                ([32, 128, 28, 28], [128, 128, 3, 3], [1, 1], [1, 1], "float16", True, True),
                ([32, 64, 56, 56], [256, 64, 1, 1], [1, 1], [0, 0], "bfloat16", False, True)):
            key = cudnn_ws.conv_key(kind, x, w, stride, pad, [1, 1], dtype, nhwc, tf32)
            if dtype == "bfloat16" and p.capability < (8, 0):
                assert cudnn_ws.workspace_bytes(props, key) is None   # no bf16 convolution before sm80
                continue
            assert cudnn_ws.workspace_bytes(props, key) == ask_cudnn(p, key), (gpu, key)
            assert cudnn_ws.find_workspace_bytes(props, key) == ask_cudnn(p, key, benchmark=True), (gpu, key)


def test_questions_asked_ahead_by_forked_workers_get_cudnns_answers(monkeypatch):
    """estimator.ask_cudnn_ahead answers an estimate's questions in worker processes; the answers
    are cuDNN's own (asked here in-process, as ask_cudnn does), the estimates are those made with
    every question asked as it comes, and nothing answered is asked again."""
    from vest_slurm.estimate.estimator import ask_cudnn_ahead

    require_cudnn()
    s = spec("--model", "torchvision:resnet18", "--batch-size", "4", "--input", "3x64x64", "--optimizer", "adam")
    types = [get_profile(k) for k in ("a100-40gb", "h100-80gb", "l40s-48gb", "v100-16gb")]
    summary = trace_for(s, A100)   # resnet18 in fp32 asks nothing of the GPU: one trace holds on every class

    def fresh():
        cudnn_ws.workspace_bytes.cache_clear()
        cudnn_ws.find_workspace_bytes.cache_clear()
        monkeypatch.setattr(cudnn_ws, "_ANSWERS", cudnn_ws._Answers())

    fresh()
    one_by_one = [estimate_from_trace(summary, s, p) for p in types]
    fresh()
    monkeypatch.setattr(cudnn_ws, "_cores", lambda: 2)   # a pool of two even on a one-core runner
    keys = {e.detail for e in summary.trace.events if e.module == "cudnn" and e.action == "alloc"}
    assert ask_cudnn_ahead([(summary, p) for p in types]) == len(keys) * len(types)
    for p in types:
        props = cudnn_ws.device_properties_json(p)
        for k in keys:
            assert cudnn_ws._ANSWERS.has(cudnn_ws._answer_key("run", props, k))
            if k in sorted(keys)[:3]:   # a sample against cuDNN itself
                assert cudnn_ws.workspace_for(p, k) == ask_cudnn(p, k)
    assert [estimate_from_trace(summary, s, p) for p in types] == one_by_one
    assert ask_cudnn_ahead([(summary, p) for p in types]) == 0       # all answered: no pool
    fresh()
    monkeypatch.setattr(cudnn_ws, "ASK_PER_WORKER", len(keys) + 1)
    assert ask_cudnn_ahead([(summary, A100)]) == 0                   # too few for two workers: asked as they come


def test_questions_are_asked_ahead_on_the_cores_free_now(monkeypatch):
    """ask_ahead forks workers for the cores free now (this process's, which waits for them, and
    those idle: ahead.free_cores), not for every core: with another task runnable on the other
    core (a check's other search group) it forks none and the questions are asked as they come;
    with it idle, two workers answer them, and the answers are cuDNN's own."""
    from vest_slurm.estimate import ahead

    s = spec("--model", "torchvision:resnet18", "--batch-size", "4", "--input", "3x64x64", "--optimizer", "sgd")
    summary = trace_for(s, A100)
    keys = sorted({e.detail for e in summary.trace.events if e.module == "cudnn" and e.action == "alloc"})
    profiles = [get_profile(k) for k in ("a100-40gb", "h100-80gb", "v100-16gb", "l40s-48gb")]
    questions = [(p, k, False) for p in profiles for k in keys]
    require_cudnn()
    assert len(questions) >= 2 * cudnn_ws.ASK_PER_WORKER
    monkeypatch.setattr(ahead, "cores", lambda: 2)
    for idle, asked in ((0.0, 0), (1.0, len(questions))):
        monkeypatch.setattr(cudnn_ws, "_ANSWERS", cudnn_ws._Answers())
        monkeypatch.setattr(ahead, "_idle_cores", lambda idle=idle: idle)
        assert ahead.free_cores() == 1 + idle
        assert cudnn_ws.ask_ahead(questions) == asked
    cudnn_ws.workspace_bytes.cache_clear()
    try:
        assert all(cudnn_ws.workspace_for(p, k) == ask_cudnn(p, k) for p, k, _ in questions[::7])
    finally:
        cudnn_ws.workspace_bytes.cache_clear()
