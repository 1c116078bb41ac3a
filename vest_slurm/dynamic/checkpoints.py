"""Checkpoints of fake tensors: written, and read back, as a script on a GPU would (dynamic analysis).

A fake tensor has a shape, dtype, strides and device but no bytes, so a script's checkpoint cannot
be written as it is on the GPU. What a script does with its checkpoints must still run: save the
initial weights and load them back, ``save_pretrained`` then ``from_pretrained``, resume from the
file it just wrote, move or stat it (bootstrap's overlay holds the file wherever it was written).

- ``torch.save`` of an object holding fake tensors writes this module's format: ``MAGIC``, then a
  pickle of the object in which each fake tensor is a record (storage id and size, dtype, shape,
  strides, offset, device, requires_grad, parameter or not) and each real tensor the bytes torch's
  own ``torch.save`` makes of it. An object without fake tensors is saved by torch itself.
- ``torch.load`` of such a file rebuilds the object: each storage once (tensors that shared one
  share it again), as a fake tensor on the device the load maps it to (``map_location`` as torch
  reads it: None keeps the saved device; a device, a string, a dict, or a function). Loaded to the
  GPU, its storages are allocations the tracer records, as the real load's are. Any other file goes
  to torch's own load. The script wrote the file in this run, so it is unpickled without torch's
  weights_only restriction.
- ``safetensors.torch.save_file`` / ``save`` of fake tensors make a real safetensors file (its
  header: names, dtypes, shapes, offsets; ``__metadata__`` as given plus a note) whose data are
  zeros. The file is sparse: no disk is written for them. Every safetensors reader (transformers'
  from_pretrained, accelerate, ``load_file``) reads it as it reads any other, with zeros as values;
  the checks safetensors makes before it writes (shared storages, contiguity) are made as before.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import threading

import torch

from ..estimate import _fakecuda as fc

MAGIC = b"vest-slurm fake checkpoint 1\n"
_SAFETENSORS_NOTE = {"vest-slurm": "written by a dynamic estimate: fake tensors, zero data"}


class _Pickler(pickle.Pickler):
    def __init__(self, f, probe: bool):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.probe = probe
        self.fakes = 0

    def persistent_id(self, obj):
        if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):   # its __reduce__ calls torch.save
            return ("probe",) if self.probe else ("real", self._real(obj))
        if not isinstance(obj, torch.Tensor):
            return None
        if fc.is_fake(obj):
            self.fakes += 1
            if self.probe:
                return ("probe",)
            return ("fake", fc.storage_key(obj), obj.untyped_storage().nbytes(), str(obj.dtype).removeprefix("torch."),
                    tuple(obj.shape), tuple(obj.stride()), obj.storage_offset(), str(obj.fake_device),
                    obj.requires_grad, isinstance(obj, torch.nn.Parameter))
        if self.probe:
            return ("probe",)
        return ("real", self._real(obj))

    @staticmethod
    def _real(obj) -> bytes:
        b = io.BytesIO()
        _ORIGINAL["save"](obj, b)
        return b.getvalue()


def _holds_fake(obj) -> bool:
    p = _Pickler(io.BytesIO(), probe=True)
    try:
        p.dump(obj)
    except Exception:  # not picklable here: torch's own save says why
        return False
    return p.fakes > 0


def _mapped(map_location, saved: str) -> torch.device:
    """The device torch.load puts a storage saved on ``saved`` (torch/serialization.py, _get_restore_location)."""
    if map_location is None:
        return torch.device(saved)
    if isinstance(map_location, dict):
        return torch.device(map_location.get(saved, saved))
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if callable(map_location):   # fn(storage, location): ask it with an empty host storage
        try:
            out = map_location(torch.UntypedStorage(0), saved)
        except Exception:   # it moved the storage to a GPU (there is none here)
            return torch.device("cuda")
        return torch.device(getattr(out, "device", "cpu") if out is not None else saved)
    return torch.device(saved)


class _Unpickler(pickle.Unpickler):
    def __init__(self, f, map_location):
        super().__init__(f)
        self.map_location = map_location
        self.storages: dict[int, torch.Tensor] = {}

    def persistent_load(self, pid):
        if pid[0] == "real":   # host data, saved by torch: loaded for real, then to where the load maps it
            with fc.real_host():
                t = _ORIGINAL["load"](io.BytesIO(pid[1]), map_location="cpu", weights_only=False)
            to = _mapped(self.map_location, "cpu")
            return t.to(to) if isinstance(t, torch.Tensor) and to.type != "cpu" else t
        _, key, nbytes, dtype, shape, stride, offset, device, requires_grad, is_param = pid
        base = self.storages.get(key)
        if base is None:
            base = self.storages[key] = fc.fake_empty(nbytes, _mapped(self.map_location, device))
        dt = getattr(torch, dtype)
        flat = base if dt == torch.uint8 else base.view(dt)
        t = flat.as_strided(shape, stride, offset)
        if is_param:
            return torch.nn.Parameter(t, requires_grad=requires_grad)
        return t.requires_grad_(True) if requires_grad and t.is_leaf else t


def save(obj, f, *args, **kwargs):
    # a path is opened here, through Python's open and so the run's overlay of the file system
    # (bootstrap.py): torch's own writer opens it in C++, which sees neither a directory the script
    # made nor where its writes go
    own = isinstance(f, (str, os.PathLike))
    fh = open(f, "wb") if own else f
    try:
        if not _holds_fake(obj):
            return _ORIGINAL["save"](obj, fh, *args, **kwargs)
        fh.write(MAGIC)
        _Pickler(fh, probe=False).dump(obj)
    finally:
        if own:
            fh.close()


def load(f, map_location=None, *args, **kwargs):
    own = isinstance(f, (str, os.PathLike))
    fh = open(f, "rb") if own else f
    try:
        start = fh.tell() if fh.seekable() else None
        head = fh.read(len(MAGIC)) if start is not None else b""
        if head == MAGIC:
            return _Unpickler(fh, map_location).load()
        if start is not None:
            fh.seek(start)
        if head[:4] != _ZIP or "restore" not in _ORIGINAL:   # (patches(): torch has the hook)
            return _ORIGINAL["load"](fh, map_location, *args, **kwargs)
        return _foreign_load(fh, map_location, args, kwargs)
    finally:
        if own:
            fh.close()


# ---- files torch wrote (a data set, pretrained weights, a checkpoint from an earlier job) -------

_ZIP = b"PK\x03\x04"   # torch.save's format since 1.6 (a zip archive; the legacy format is torch's own load's)
_LOADING = threading.local()


class _ForeignFile:
    """One torch.load of a file torch saved. Under a fake mode torch's own load reads no data: every
    storage comes back as a meta storage that remembers where its bytes are (``_checkpoint_offset``)
    and the device it was saved from, and each tensor passes through ``_restore_device_fake_mode``.
    Plain meta tensors, though, are neither host data nor device allocations: a data set loaded to
    the host had no values, and one loaded onto the GPU (a data set kept there, pretrained weights,
    a resume) was no allocation at all. Here each storage goes where ``map_location`` maps it (as
    torch reads it, a function included), once, the tensors that shared it sharing it again:
    - to the host: its real bytes, mapped from the file (pages are read when touched);
    - to a GPU: a fake storage of its size, an allocation the tracer records as the real load's
      copy is; its values (a shadow) where _shadow keeps them for a tensor of that kind and size
      (labels, indices, masks): the rest need no bytes read."""

    def __init__(self, fh, map_location):
        self.fh = fh
        self.map_location = map_location
        self.bases: dict[int, torch.Tensor] = {}
        self._map = None   # the file mapped once (copy-on-write), or False where it cannot be

    def _bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        """A real uint8 tensor of the file's bytes [offset, offset + nbytes)."""
        import mmap

        with fc.real_host():
            if nbytes == 0:
                return torch.empty(0, dtype=torch.uint8)
            if self._map is None:
                try:
                    self._map = mmap.mmap(self.fh.fileno(), 0, access=mmap.ACCESS_COPY)
                except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
                    self._map = False   # a file object without a descriptor (BytesIO): read
            if self._map:
                return torch.frombuffer(self._map, dtype=torch.uint8, offset=offset, count=nbytes)
            pos = self.fh.tell()
            try:
                self.fh.seek(offset)
                data = bytearray(self.fh.read(nbytes))
            finally:
                self.fh.seek(pos)
            return torch.frombuffer(data, dtype=torch.uint8)

    def rebuilt(self, t: torch.Tensor) -> torch.Tensor:
        from ..estimate import _shadow

        s = t.untyped_storage()
        target = _mapped(self.map_location, str(getattr(s, "_fake_device", None) or "cpu"))
        base = self.bases.get(s._cdata)
        if base is None:
            offset, nbytes = s._checkpoint_offset, s.nbytes()
            if target.type == "cpu":
                base = self._bytes(offset, nbytes)
            elif _shadow.worthy(t):
                base = self._bytes(offset, nbytes).to(target)   # a copy from the host: values kept
            else:
                base = fc.fake_empty(nbytes, target)
            self.bases[s._cdata] = base
        if target.type == "cpu":
            with fc.real_host():
                out = torch.empty(0, dtype=t.dtype).set_(base.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        else:
            flat = base if t.dtype == torch.uint8 else base.view(t.dtype)
            out = flat.as_strided(t.shape, t.stride(), t.storage_offset())
        if t.requires_grad and out.is_leaf:
            out.requires_grad_(True)
        return out


def _restore_device(tensor):
    """torch._utils._restore_device_fake_mode, as each loaded tensor passes it (_ForeignFile)."""
    state = getattr(_LOADING, "file", None)
    if state is None or not tensor.is_meta or getattr(tensor.untyped_storage(), "_checkpoint_offset", None) is None:
        return _ORIGINAL["restore"](tensor)
    return state.rebuilt(tensor)


def _foreign_load(fh, map_location, args, kwargs):
    kwargs = {k: v for k, v in kwargs.items() if k != "mmap"}   # the bytes are read here (mapped)
    outer = getattr(_LOADING, "file", None)
    _LOADING.file = _ForeignFile(fh, map_location)
    try:
        # torch's own load, which under the fake mode reads no storage: map_location is applied
        # by _ForeignFile (torch's fake path refuses a function; a device or dict it would set only
        # as a label on meta tensors)
        return _ORIGINAL["load"](fh, None, *args, **kwargs)
    finally:
        _LOADING.file = outer


# ---- safetensors -----------------------------------------------------------------------------

def _safetensors_header(tensors: dict, metadata) -> tuple[bytes, int]:
    """The header of a safetensors file of these tensors (the format: an 8-byte little-endian header
    length, the JSON header padded with spaces to 8 bytes, then the data, largest element size
    first as safetensors orders it) and the data's length."""
    from safetensors import torch as st

    code = {dt: name for name, dt in st._TYPES.items()}
    header, offset = {}, 0
    for name, t in sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0])):
        if t.dtype not in code:
            raise ValueError(f"safetensors cannot store dtype {t.dtype} (tensor {name!r})")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": code[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {**(metadata or {}), **_SAFETENSORS_NOTE}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset


def _checked(tensors: dict) -> None:
    """safetensors' own checks before it writes: a dict of dense, contiguous tensors, none sharing
    storage with another (its message, with the advice to use save_model)."""
    from safetensors import torch as st

    check = getattr(st, "_evaluate_tensors_for_save", None)
    if check is not None:
        check(tensors)
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"You are trying to save a non contiguous tensor: `{name}` which is not allowed "
                             "(safetensors); call `.contiguous()` on it before saving")


def _has_fake(tensors) -> bool:
    return isinstance(tensors, dict) and any(fc.is_fake(t) for t in tensors.values())


def safetensors_save_file(tensors, filename, metadata=None):
    if not _has_fake(tensors):
        return _ORIGINAL["save_file"](tensors, filename, metadata=metadata)
    _checked(tensors)
    head, size = _safetensors_header(tensors, metadata)
    with open(filename, "wb") as fh:
        fh.write(head)
        fh.truncate(len(head) + size)   # zeros, as holes: nothing written for the data


def safetensors_save(tensors, metadata=None) -> bytes:
    if not _has_fake(tensors):
        return _ORIGINAL["save_bytes"](tensors, metadata=metadata)
    _checked(tensors)
    head, size = _safetensors_header(tensors, metadata)
    return head + bytes(size)


_ORIGINAL: dict = {}


def _rebuild_tensor(storage, storage_offset, size, stride):
    """torch._utils._rebuild_tensor (a tensor over a storage, as unpicklers make them) where the
    storage holds real host bytes: a real host tensor. Readers that reach it past torch.load, with
    the run's function modes off (Lightning's _lazy_load: litgpt's checkpoints, Fabric's and
    Lightning's FSDP full-state loads, materialized inside ``param.copy_``), made the empty tensor
    it sets fake, and set_ refused the real storage. Other storages (meta: torch.load under the fake
    mode) as before."""
    if storage._untyped_storage.device.type != "meta" and not isinstance(storage._untyped_storage, fc.FakeTensor):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return _ORIGINAL["rebuild"](storage, storage_offset, size, stride)
    return _ORIGINAL["rebuild"](storage, storage_offset, size, stride)


def patches() -> list:
    """(obj, attr, new) for torch.save / torch.load, torch._utils._rebuild_tensor and, where it is
    installed, safetensors' save."""
    _ORIGINAL.update(save=torch.save, load=torch.load, rebuild=torch._utils._rebuild_tensor)
    out = [(torch, "save", save), (torch, "load", load), (torch._utils, "_rebuild_tensor", _rebuild_tensor)]
    if hasattr(torch._utils, "_restore_device_fake_mode"):
        _ORIGINAL["restore"] = torch._utils._restore_device_fake_mode
        out.append((torch._utils, "_restore_device_fake_mode", _restore_device))
    try:
        from safetensors import torch as st
    except ImportError:
        return out
    _ORIGINAL.update(save_file=st.save_file, save_bytes=st.save)
    return out + [(st, "save_file", safetensors_save_file), (st, "save", safetensors_save)]
