"""cuda_surface: every public CUDA API of the installed torch has a decision, stand-ins keep the real
signatures, unsupported APIs name themselves, and a device-generic script runs on them."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

import vest_slurm.dynamic.cuda_surface as cs
from vest_slurm.dynamic.launch import parse_train_command
from vest_slurm.dynamic.runner import estimate_command
from vest_slurm.estimate.profiles import get_profile

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "scripts")
ANS = cs.Answers(lambda: 1000, lambda: 5000)


def test_every_public_cuda_api_of_this_torch_has_a_decision():
    assert cs.undecided() == []
    # the walk covers what the issue names: streams, events, accelerator, amp, generator, pinned memory
    apis = cs.surface()
    for name in ("torch.cuda.stream", "torch.accelerator.set_stream", "torch.Stream.wait_stream", "torch.Event.record",
                 "torch.cuda.amp.GradScaler", "torch.Generator.manual_seed", "torch.Tensor.pin_memory",
                 "torch.empty(pin_memory=)"):
        assert name in apis, name


def test_a_new_public_api_without_a_decision_fails(monkeypatch):
    def brand_new_query(device=None):
        return 0

    monkeypatch.setattr(torch.cuda, "brand_new_query", brand_new_query, raising=False)
    monkeypatch.setattr(torch.cuda, "__all__", [*torch.cuda.__all__, "brand_new_query"])
    monkeypatch.setattr(torch.cuda.Stream, "brand_new_method", lambda self: None, raising=False)
    assert cs.undecided() == ["torch.cuda.Stream.brand_new_method", "torch.cuda.brand_new_query"]


def test_no_decision_for_an_api_this_torch_does_not_have():
    apis = cs.surface()
    assert [name for name in cs.DECISIONS if name not in apis] == []


def test_stand_ins_have_the_real_signatures_and_bind_like_them():
    checked = 0
    for owner, attr, new in cs.patches(ANS):
        api = getattr(new, "__vest_standin__", None)
        if api is None or "(" in api:
            continue
        expected = cs.real_signature(getattr(owner, attr))
        if expected is None:   # a builtin that states no signature (Tensor.is_pinned): arguments pass through
            continue
        assert inspect.signature(new) == expected, api
        checked += 1
    assert checked > 60
    patched = {(o, a): n for o, a, n in cs.patches(ANS)}
    memory_allocated = patched[(torch.cuda, "memory_allocated")]
    assert memory_allocated() == 1000 and memory_allocated(device=0) == 1000
    with pytest.raises(TypeError, match="torch.cuda.memory_allocated"):
        memory_allocated(0, 1)            # the real one takes one argument
    with pytest.raises(TypeError):
        memory_allocated(devcie=0)        # nor a misspelt keyword
    with pytest.raises(TypeError):
        patched[(torch.accelerator, "memory_allocated")](device_index=0)   # positional-only in torch
    assert patched[(torch.cuda, "max_memory_allocated")]() == 5000


def test_unsupported_apis_name_themselves_and_say_vest_must_act():
    patched = {(o, a): n for o, a, n in cs.patches(ANS)}
    for owner, attr, api in ((torch.cuda, "CUDAGraph", "torch.cuda.CUDAGraph"),
                             (torch.cuda, "make_graphed_callables", "torch.cuda.make_graphed_callables"),
                             (torch.cuda, "MemPool", "torch.cuda.MemPool")):
        with pytest.raises(cs.NotSupportedHere, match=api.replace(".", r"\.")) as e:
            patched[(owner, attr)](None, ()) if attr == "make_graphed_callables" else patched[(owner, attr)]()
        assert "vest cannot yet run" in str(e.value) and "#VEST" in str(e.value)


def test_a_class_stays_a_class_where_it_is_unsupported():
    """Libraries annotate with CUDA classes at import (``graph: torch.cuda.CUDAGraph | None``, as
    transformers' modules do): a stand-in that is a function would break that import, so every class
    of the surface is replaced by a class; an unsupported one refuses only when it is made."""
    replaced = 0
    for owner, attr, new in cs.patches(ANS):
        real = getattr(owner, attr)
        if isinstance(real, type):
            replaced += 1
            assert isinstance(new, type), f"{attr}: a class replaced by {type(new).__name__}"
            assert (new | None) is not None
    assert replaced >= 5
    graph = {(o, a): n for o, a, n in cs.patches(ANS)}[(torch.cuda, "CUDAGraph")]
    assert not isinstance(object(), graph) and issubclass(torch.cuda.CUDAGraph, graph)

    class Mine(graph):   # a script's subclass: made, it refuses as well
        pass

    with pytest.raises(cs.NotSupportedHere, match=r"torch\.cuda\.CUDAGraph"):
        Mine()


def test_stand_in_classes_keep_isinstance_both_ways():
    s = cs.FakeCudaStream()
    assert isinstance(s, cs.FakeStream) and isinstance(s, torch.Stream)
    assert isinstance(torch.default_generator, cs.FakeGenerator)   # a real generator is still a Generator
    g = cs.FakeGenerator(device="cuda")
    assert g.device == torch.device("cuda:0") and g.manual_seed(3).initial_seed() == 3
    assert cs.FakeGenerator().device == torch.device("cpu")
    assert cs.FakeStream(device="cuda") != cs.FakeStream(device="cuda")   # each a stream of its own
    patches = cs.patches(ANS)
    assert len({(id(o), a) for o, a, _ in patches}) == len(patches)   # each attribute patched once


def test_a_cuda_generators_state_is_cudas_philox_seed_and_offset():
    """RNG trackers (Megatron's CudaRNGStatesTracker, DeepSpeed's and fairscale's copies) save
    torch.cuda.get_rng_state() and restore it through the device's default generator: a CUDA
    generator's state is 16 bytes (seed, offset) as CUDAGeneratorImpl's; the stand-in, a CPU
    generator, asked for its 5056-byte state and failed ("fix the script"). A state of the wrong
    size fails as on a GPU, the script's to fix. A CPU generator keeps its own format."""
    g = cs.FakeGenerator(device="cuda")
    g.manual_seed(1234)
    state = g.get_state()
    assert state.dtype == torch.uint8 and state.numel() == 16
    g.manual_seed(7)
    g.set_state(state)
    assert g.initial_seed() == 1234 and torch.equal(g.get_state(), state)
    g.set_state(torch.zeros(16, dtype=torch.uint8))   # what torch.cuda.get_rng_state() gives here
    assert g.initial_seed() == 0
    with pytest.raises(cs.FailsOnAGpu, match="16 bytes"):
        g.set_state(torch.default_generator.get_state())
    cpu = cs.FakeGenerator()
    assert cpu.get_state().numel() == torch.default_generator.get_state().numel()


def test_device_generic_script_runs_on_the_stand_ins():
    """torch.Stream, torch.accelerator.*, torch.cuda.stream(stream=...), torch.Generator(device="cuda"),
    pin_memory() and pin_memory=True, events and memory queries: the script trains its 3 steps."""
    cmd = parse_train_command(["python", "train_device_generic.py", "--batch-size", "16"])
    (est,), run = estimate_command(cmd, [get_profile("a100-40gb")], cwd=SCRIPTS)
    assert run.steps == 3
    assert run.batch_hint == 16
    params = (64 * 256 + 256 + 256 * 10 + 10) * 4
    assert dict(est.breakdown)["parameters"] == params


def _shape(sig):
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def test_grad_scaler_stand_ins_have_every_public_method_with_its_signature():
    import vest_slurm.dynamic.grad_scaler as gs

    for real, fake in ((torch.amp.GradScaler, gs.FakeGradScaler),
                       (torch.cuda.amp.GradScaler, gs.FakeCudaGradScaler)):
        for name in ["__init__", *(n for n in dir(real) if not n.startswith("_"))]:
            assert hasattr(fake, name), f"{fake.__name__}.{name}"
            assert _shape(inspect.signature(getattr(fake, name))) == _shape(inspect.signature(getattr(real, name))), name
    scaler = gs.FakeGradScaler("cuda", growth_interval=100)
    scaler.set_growth_factor(4.0)
    assert scaler.get_growth_factor() == 4.0 and scaler.get_growth_interval() == 100


def test_every_device_property_of_this_torch_is_answered_or_refused_by_name():
    """torch.cuda.get_device_properties: each attribute of torch's own _CudaDeviceProperties is
    answered as the GPU type's (profile and compute capability) or stops the run naming itself; a new
    attribute in a new torch fails here until it is decided. (timm's foreach optimizers read
    L2_cache_size: it was an AttributeError, blamed on the script.)"""
    from vest_slurm.errors import NotSupportedHere
    from vest_slurm.estimate._fakecuda import FakeDeviceProperties

    h100 = get_profile("h100-80gb")
    props = FakeDeviceProperties(h100.name, h100.total_bytes, h100.capability, h100.sm_count, h100.l2_cache_bytes)
    names = [a for a in dir(torch._C._CudaDeviceProperties) if not a.startswith("_")]
    assert len(names) >= 20
    refused = []
    for a in names:
        try:
            value = getattr(props, a)
        except NotSupportedHere as e:
            assert f"get_device_properties().{a}" in str(e)
            refused.append(a)
            continue
        assert value is not None, a
    assert sorted(refused) == ["clock_rate", "memory_bus_width", "memory_clock_rate"]
    assert (props.multi_processor_count, props.L2_cache_size, props.max_threads_per_multi_processor) == (132, 50 << 20, 2048)
    assert (props.shared_memory_per_block_optin, props.warp_size, props.gcnArchName) == (227 * 1024, 32, h100.name)
    with pytest.raises(AttributeError):
        props.no_such_property
    l4 = get_profile("l4-24gb")
    assert FakeDeviceProperties(l4.name, l4.total_bytes, l4.capability, l4.sm_count, l4.l2_cache_bytes).L2_cache_size == 48 << 20


def test_a_script_sizing_its_optimizer_chunks_by_the_l2_cache_runs(tmp_path):
    """timm's style: foreach chunks sized from get_device_properties().L2_cache_size; the run takes
    the GPU type's L2 (a chunked step on the L40S's 96 MiB, one chunk on the A100's 40 MiB)."""
    (tmp_path / "t.py").write_text(
        "import torch\nfrom torch import nn\n"
        "m = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(3)]).cuda()\n"
        "l2 = torch.cuda.get_device_properties(0).L2_cache_size\n"
        "budget = l2 // 16\nprint('chunk', budget if budget >= 2 ** 22 else None)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(4):\n    m(torch.randn(8, 2048, device='cuda')).sum().backward()\n    opt.step()\n    opt.zero_grad()\n")
    for key in ("a100-40gb", "l40s-48gb"):
        (e,), run = estimate_command(parse_train_command("python t.py"), [get_profile(key)], cwd=str(tmp_path))
        assert run.steps == 3 and e.peak_bytes > 0
