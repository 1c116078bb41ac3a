"""Eager module loading: the device code a CUDA context loads at once, bounded from the libraries' files.

In: a GPU's compute capability, which libraries the job loads (torch's CUDA libraries always;
cuBLAS/cuBLASLt for matrix products; cuDNN for convolutions; NCCL for multi-GPU jobs), found in
the installed torch and its nvidia-* wheels without importing torch. Out: bytes (an upper bound)
and the per-library figures behind it.

Why: with CUDA_MODULE_LOADING=EAGER (or a torch built with CUDA < 11.7, before lazy loading) the
driver loads every module of every registered fat binary when the library registers it (the
context's creation for torch's own, cublasCreate / the first cuDNN call for theirs), not only the
kernels the job runs (CUDA C Programming Guide, "Lazy Loading"). What it loads per module is the
cubin the driver picks for the device: the one for the highest SM version not above the device's
within its major version (binary compatibility, "Compute Capabilities"); without one it JIT-compiles
the PTX. A cubin's uncompressed size is its code, constants and what the driver does not load
(symbols, relocations), so the sum over modules bounds what eager loading puts in device memory.

The fat binary format read here is the one the CUDA toolchain writes into the ELF section
``.nv_fatbin`` (fatbinary.h: a header with magic 0xBA55ED50, version, header size and the fat
size, then entries each with kind (1 PTX, 2 ELF), header size, payload size, SM version at offset
28 and the uncompressed size at offset 56 where the payload is compressed).
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import struct
from dataclasses import dataclass

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2
_READ_CHUNK = 1 << 26


@dataclass(frozen=True)
class Entry:
    kind: int        # 1 PTX, 2 ELF (cubin)
    sm: int          # e.g. 80 for sm_80
    bytes: int       # uncompressed size


def _fatbin_section(path: str) -> tuple[int, int] | None:
    """(offset, size) of the ELF section .nv_fatbin, None where there is none."""
    with open(path, "rb") as f:
        h = f.read(64)
        if h[:4] != b"\x7fELF" or h[4] != 2:      # 64-bit ELF only (every CUDA library torch ships)
            return None
        shoff = struct.unpack_from("<Q", h, 0x28)[0]
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", h, 0x3A)
        f.seek(shoff)
        raw = f.read(shentsize * shnum)
        heads = [struct.unpack_from("<IIQQQQ", raw, i * shentsize) for i in range(shnum)]
        f.seek(heads[shstrndx][4])
        names = f.read(heads[shstrndx][5])
    for name_at, _t, _fl, _addr, off, size in heads:
        if names[name_at:names.index(b"\0", name_at)] == b".nv_fatbin":
            return off, size
    return None


def modules(path: str) -> list[list[Entry]]:
    """The fat binaries of one library: per module, its entries."""
    where = _fatbin_section(path)
    if where is None:
        return []
    off, size = where
    with open(path, "rb") as f:
        f.seek(off)
        data = f.read(size)
    out, p = [], 0
    while p + 16 <= len(data):
        magic, _ver, hsize, fsize = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:
            p += 8                     # fat binaries are 8-byte aligned in the section
            continue
        q, end, mod = p + hsize, p + hsize + fsize, []
        while q + 64 <= end:
            kind, _u, ehs, psize = struct.unpack_from("<HHIQ", data, q)
            sm = struct.unpack_from("<I", data, q + 28)[0]
            unc = struct.unpack_from("<Q", data, q + 56)[0] if ehs >= 64 else 0
            mod.append(Entry(kind, sm, max(unc, psize)))
            q += ehs + psize
        out.append(mod)
        p = end
    return out


def loaded_bytes(mods: list[list[Entry]], capability: tuple[int, int]) -> int:
    """What eager loading of these modules puts on a device of ``capability``: per module the cubin
    the driver picks (highest SM <= the device's, same major), else its PTX (JIT output is smaller
    than the PTX text)."""
    dev = capability[0] * 10 + capability[1]
    total = 0
    for mod in mods:
        cubins = [e for e in mod if e.kind == KIND_ELF and e.sm // 10 == dev // 10 and e.sm <= dev]
        if cubins:
            total += max(cubins, key=lambda e: e.sm).bytes
        else:
            ptx = [e for e in mod if e.kind == KIND_PTX and e.sm <= dev]
            total += max(ptx, key=lambda e: e.sm).bytes if ptx else 0
    return total


@functools.lru_cache(maxsize=64)
def _library_bytes(path: str, mtime_ns: int, capability: tuple[int, int]) -> int:
    return loaded_bytes(modules(path), capability)


def _site_dir(pkg: str) -> str | None:
    spec = importlib.util.find_spec(pkg)
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    return locs[0] if locs else None


def job_libraries(convolves: bool, multi_gpu: bool) -> dict[str, list[str]]:
    """The CUDA libraries of the installed torch a job loads: {group: paths}."""
    torch_dir, nv = _site_dir("torch"), _site_dir("nvidia")
    libs: dict[str, list[str]] = {"torch": [], "cublas": [], "cudnn": [], "nccl": []}
    if torch_dir:
        libs["torch"] = [p for p in (os.path.join(torch_dir, "lib", n) for n in ("libtorch_cuda.so", "libc10_cuda.so"))
                         if os.path.isfile(p)]
    if nv:
        libs["cublas"] = sorted(glob.glob(os.path.join(nv, "*", "lib", "libcublas*.so.*")))
        if convolves:
            libs["cudnn"] = sorted(glob.glob(os.path.join(nv, "cudnn", "lib", "libcudnn*.so.*")))
        if multi_gpu:
            libs["nccl"] = sorted(glob.glob(os.path.join(nv, "nccl", "lib", "libnccl.so.*")))
    return libs


def eager_code_bytes(capability: tuple[int, int], convolves: bool, multi_gpu: bool) -> tuple[int, dict[str, int]]:
    """(the bound in bytes, per library group) for a job on a GPU of ``capability``; (0, {}) where
    torch's CUDA libraries are not installed here (a CPU build: nothing to read)."""
    per: dict[str, int] = {}
    for group, paths in job_libraries(convolves, multi_gpu).items():
        for p in paths:
            try:
                per[group] = per.get(group, 0) + _library_bytes(os.path.realpath(p), os.stat(p).st_mtime_ns, capability)
            except (OSError, struct.error, ValueError):
                continue
    if not per.get("torch"):
        return 0, {}
    return sum(per.values()), per
