"""Device tensors copied from the host keep their real values (vest_slurm/estimate/_shadow.py).

Real torch ops on the fake GPU of dynamic analysis (host code real): a host-built index or mask
moved to the device answers data-dependent ops with the real shape and ``.item()`` with the real
value (a device random draw a sampled one, marked), while the tensors the model computes stay without values, and
the allocations recorded are the fake tensors' as before.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from vest_slurm.estimate import _fakecuda as fc
from vest_slurm.estimate import _shadow


class Seen:
    def __init__(self):
        self.allocated: list[int] = []
        self.recorder = fc.Recorder(lambda block, nbytes, s: self.allocated.append(nbytes), lambda block: None)


@contextlib.contextmanager
def fake_gpu():
    """Dynamic analysis's fake GPU: host tensors real, stand-ins for values read from the device."""
    seen = Seen()
    with (fc.cuda_answers(total_memory_bytes=80 << 30, capability=(9, 0)),
          fc.FakeCudaMode(seen.recorder, scalar_stand_in=True, host_real=True), fc.CudaFactoryMode(host_real=True)):
        yield seen


def test_host_index_and_mask_give_real_shapes_and_values_and_the_gpu_allocations():
    with fake_gpu() as seen:
        labels = (torch.arange(300) % 5).to("cuda")
        mask = torch.zeros(300, dtype=torch.bool)
        mask[:180] = True
        mask = mask.cuda()
        features = torch.randn(300, 16).to("cuda")
        assert isinstance(labels, fc.FakeTensor) and labels.device.type == "cuda"
        assert labels.max().item() + 1 == 5 and int(mask.sum()) == 180 and bool(mask.any())
        mark = len(seen.allocated)
        picked = features[mask]
        assert picked.shape == (180, 16) and seen.allocated[mark:] == [180 * 16 * 4]   # as the GPU allocates
        assert mask.nonzero().shape == (180, 1) and torch.masked_select(labels, mask).shape == (180,)
        assert labels[mask].bincount().tolist() == [36] * 5
        assert torch.unique(labels[mask], sorted=False).tolist() == [0, 1, 2, 3, 4]   # CUDA's unique sorts
        assert torch.repeat_interleave(torch.tensor([1, 2, 3], device="cuda")).shape == (6,)
        ids = torch.tensor([[1, 2, 0], [3, 0, 0]], device="cuda")
        assert ids.ne(0).sum(1).tolist() == [2, 1]
        host = ids.cpu()   # a real host tensor, a copy
        assert not isinstance(host, fc.FakeTensor) and host.tolist() == [[1, 2, 0], [3, 0, 0]]
        host[0, 0] = 9
        assert ids[0, 0].item() == 1


def test_values_computed_from_the_model_have_none_and_a_mask_of_them_is_bounded_or_data_dependent(monkeypatch):
    """A mask the model's outputs decide has no values here: a small one is taken as all selected
    (the most it can select: FakeCudaMode._bounded_nonzero, flagged), a large one stays data-dependent."""
    fc.BOUNDED_MASKS.clear()
    with fake_gpu():
        labels = (torch.arange(64) % 4).cuda()
        model = nn.Linear(16, 4, device="cuda")
        out = model(torch.randn(64, 16).cuda())
        hard = out.argmax(1) != labels   # one input from the model: no shadow
        assert _shadow.of(out) is None and _shadow.of(hard) is None and _shadow.of(labels) is not None
        assert labels[hard].shape == (64,) and len(fc.BOUNDED_MASKS) == 1
        monkeypatch.setattr(fc, "BOUNDED_MASK_NUMEL", 32)
        with pytest.raises(DynamicOutputShapeException):
            labels[hard]
        assert hard.sum().item() == 1   # the stand-in, as before
    fc.BOUNDED_MASKS.clear()


def test_the_bound_floats_only_small_ones_and_never_activations(monkeypatch):
    with fake_gpu():
        small = torch.randn(4, 8).cuda()
        batch = torch.randn(64, 3, 32, 32).cuda()          # a batch of images: values steer no shape
        assert _shadow.of(small) is not None and _shadow.of(batch) is None
        hidden = nn.Linear(8, 8, device="cuda")(small)      # parameters have none: neither has the output
        assert _shadow.of(hidden) is None and _shadow.of(hidden.relu()) is None
        assert _shadow.of(small * 2) is not None            # host values computed on: still known
        monkeypatch.setattr(_shadow, "MAX_TENSOR_BYTES", 1024)
        assert _shadow.of(torch.arange(128).cuda()) is not None        # 1 KiB of int64
        assert _shadow.of(torch.arange(129).cuda()) is None
    with fake_gpu():
        monkeypatch.setattr(_shadow, "MAX_TOTAL_BYTES", 2048)
        a, b = torch.arange(128).cuda(), torch.arange(128).cuda()
        c = torch.arange(128).cuda()
        assert _shadow.of(a) is not None and _shadow.of(b) is not None and _shadow.of(c) is None
        del a
        assert _shadow.of(torch.arange(128).cuda()) is not None   # a's bytes came back with it


def test_device_random_draws_are_sampled_and_marked_uninitialised_memory_has_none():
    """A draw of the device's generator (offsets, a mask) gets a sampled shadow, drawn on the host
    with the host's own random stream left as it was, and marked with where it was drawn; what
    follows from it carries the mark, and a value read from it is listed (the estimate's flag).
    An in-place fill that draws a whole tensor of indices, or a short float vector (per-sample
    probabilities), is sampled too; a weight's initialisation (a parameter, or a float tensor of a
    weight's size), dropout's masks and uninitialised memory get none."""
    with fake_gpu():
        state = torch.get_rng_state()
        r = torch.randint(0, 5, (100,), device="cuda")
        assert torch.equal(torch.get_rng_state(), state)
        real, shadows = _shadow.of(r), r.fake_mode.shadows
        assert real is not None and int(real.min()) >= 0 and int(real.max()) < 5 and len(set(real.tolist())) > 1
        assert shadows.origin(r).startswith("randint at test_shadow.py:")
        m = r == 3
        assert shadows.origin(m) == shadows.origin(r) and shadows.sampled_reads == []
        assert int(m.sum()) == int((real == 3).sum())             # the draw's value, read and listed
        assert shadows.sampled_reads == [[shadows.sampled_reads[0][0], shadows.origin(r)]]
        assert r[m].shape == (int((real == 3).sum()),)            # a shape taken from the draw
        assert shadows.origin(torch.arange(10).cuda()) is None
        w = torch.empty(64, 128, device="cuda")
        nn.init.normal_(w)                                        # an in-place fill: weights' initialisation
        p = nn.Parameter(torch.empty(16, device="cuda"))
        nn.init.uniform_(p)                                       # a parameter's, however small
        assert _shadow.of(w) is None and _shadow.of(p) is None
        assert _shadow.of(nn.functional.dropout(torch.ones(64, 128).cuda(), 0.5)) is None
        centres = torch.empty(100, dtype=torch.long, device="cuda").random_(2, 30)   # a fill drawing indices
        assert int(_shadow.of(centres).min()) >= 2 and int(_shadow.of(centres).max()) < 30
        assert shadows.origin(centres).startswith("random_ at test_shadow.py:")
        keep = torch.empty(16, device="cuda").uniform_() < 0.5     # per-sample probabilities
        assert shadows.origin(keep).startswith("uniform_ at test_shadow.py:")
        assert _shadow.of(torch.empty(100, dtype=torch.long, device="cuda")) is None
        assert _shadow.of(torch.arange(10, device="cuda")) is not None   # a factory of known values
        x = torch.arange(10).cuda()
        assert _shadow.of(x.topk(3).indices) is None and _shadow.of(x.sort().indices) is None   # ties' order


def test_writes_keep_views_in_step_or_forget_the_storage():
    with fake_gpu():
        labels = torch.arange(12).cuda()
        head = labels[:4]
        head.fill_(9)                                  # mirrored: the base sees it through its view
        assert labels.tolist()[:5] == [9, 9, 9, 9, 4]
        model_ints = nn.Linear(2, 12, device="cuda")(torch.randn(1, 2, device="cuda")).argmax(1)
        labels[4:6].add_(model_ints)                   # a write of unknown values: every view forgets
        assert _shadow.of(labels) is None and _shadow.of(head) is None
        fresh = torch.empty(6, dtype=torch.long, device="cuda")
        fresh.copy_(torch.arange(6))                   # a whole overwrite from the host: known again
        assert fresh.tolist() == [0, 1, 2, 3, 4, 5]


def test_a_layout_only_template_keeps_the_result_known():
    """``feats.new_full((n, 1), 8.0)`` or ``zeros_like(activations)`` reads only the template's layout:
    the result's values are the fill's, known on the GPU too, though the template (computed from the
    model) has none; ``empty_like`` of it stays unknown (uninitialised memory)."""
    with fake_gpu():
        feats = nn.Linear(4, 8, device="cuda")(torch.randn(2, 4, device="cuda"))
        assert _shadow.of(feats) is None
        stride = feats.new_full((16, 1), 8.0)
        ids = torch.zeros_like(feats, dtype=torch.long)
        assert stride.flatten().tolist() == [8.0] * 16 and ids.sum().item() == 0
        pts = torch.arange(16, dtype=torch.float32).view(16, 1).cuda() * stride
        assert (pts > 60).nonzero().shape == (8, 2)   # a real shape, as on the GPU
        assert _shadow.of(torch.empty_like(feats)) is None and _shadow.of(feats + 1) is None


def test_a_write_at_distinct_integer_indices_is_mirrored_and_a_racy_one_is_not():
    """``out[img, slot] = boxes`` with host indices: where the (img, slot) pairs are distinct (negative
    positions counted from the end), each element is written once and the CPU's result is the GPU's;
    where a pair repeats, the GPU's last writer is not defined and the target forgets its values."""
    with fake_gpu():
        boxes = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]).cuda()
        out = torch.zeros(4, 2, 2, device="cuda")
        out[torch.tensor([0, 0, 2]).cuda(), torch.tensor([0, 1, -1]).cuda()] = boxes
        assert out[..., 0].gt(0).nonzero().tolist() == [[0, 0], [0, 1], [2, 1]]
        racy = torch.zeros(4, 2, 2, device="cuda")
        racy[torch.tensor([0, 0, 2]).cuda(), torch.tensor([1, -1, 0]).cuda()] = boxes   # (0, 1) twice
        assert _shadow.of(racy) is None
        assert racy.gt(0).nonzero().shape == (16, 3)   # no values: every element taken (_bounded_nonzero)
        fc.BOUNDED_MASKS.clear()
        summed = torch.zeros(4, device="cuda").index_put_((torch.tensor([1, 1]).cuda(),),
                                                          torch.tensor([2.0, 3.0]).cuda(), accumulate=True)
        assert summed.tolist() == [0.0, 5.0, 0.0, 0.0]   # accumulation has no race
