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
