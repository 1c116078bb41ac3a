"""Whose code a frame runs: the user's, an installed library's, the interpreter's, torch's or vest's.

Every place that names a line of the user's (a value read, a branch the optimizer took, the line a
script failed at, the API it called there) asks this one question of a code object's file name.
Installed packages are told by their folder's name, ``site-packages`` (pip, venvs, conda) or
``dist-packages`` (Debian's and Ubuntu's system Python and their ``pip install`` outside a venv):
either may sit under the standard library's folder or apart from it. torch and vest are told by
where they were imported from, so a torch checkout installed in place (``pip install -e``) is
torch's, and a user's folder that happens to be named ``torch`` is the user's.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
import sysconfig

USER, LIBRARY, STDLIB, TORCH, VEST, GENERATED = "user", "library", "stdlib", "torch", "vest", "generated"

PACKAGE_DIRS = tuple(os.sep + d + os.sep for d in ("site-packages", "dist-packages"))
_VEST = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@functools.lru_cache(maxsize=1)
def _stdlib() -> tuple[str, ...]:
    """The standard library's folders (their pure and compiled parts; a venv's Python shares them)."""
    paths = sysconfig.get_paths()
    dirs = {paths.get("stdlib"), paths.get("platstdlib"), os.path.dirname(os.__file__)}
    return tuple(sorted(d.rstrip(os.sep) + os.sep for d in dirs if d))


def _torch() -> str | None:
    """torch's folder, once torch is imported (before, no frame runs its code)."""
    mod = sys.modules.get("torch")
    path = getattr(mod, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) + os.sep if path else None


@functools.lru_cache(maxsize=4096)
def origin(filename: str) -> str:
    """One of USER, LIBRARY, STDLIB, TORCH, VEST, GENERATED for a code object's file name."""
    if not filename or filename.startswith("<"):
        return GENERATED   # <string>, <frozen ...>, exec'd and compiled code
    if filename.startswith(_VEST) or os.sep + "vest_slurm" + os.sep in filename:
        return VEST
    torch_dir = _torch()
    if torch_dir and filename.startswith(torch_dir):
        return TORCH
    for marker in PACKAGE_DIRS:
        if marker in filename:
            top = filename.split(marker, 1)[1].split(os.sep, 1)[0]
            return TORCH if top == "torch" else LIBRARY
    if filename.endswith((".pyx", ".pxi", ".pxd")):
        return LIBRARY   # Cython names its sources relative to the package (pyarrow/error.pxi)
    if filename.startswith(_stdlib()):
        return STDLIB
    if entry_point_wrapper(filename):
        return LIBRARY   # `yolo train ...`: the package's own code is what runs, not the user's
    return USER


def _sets_argv0(stmt) -> bool:
    """``sys.argv[0] = ...`` (the wrappers' strip of ``-script.pyw``/``.exe``), or an ``if`` of
    nothing but those."""
    if isinstance(stmt, ast.If):
        return all(_sets_argv0(s) for s in stmt.body + stmt.orelse)
    return isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) == "sys.argv[0]"


@functools.lru_cache(maxsize=256)
def entry_point_wrapper(filename: str) -> bool:
    """Whether a file is an installer's wrapper of a console script (``bin/yolo``, ``bin/litgpt``):
    imports and an ``if __name__ == "__main__":`` of ``sys.argv[0]`` fixes and ``sys.exit(main())``
    (pip's and distlib's template, uv's), or setuptools' easy-install entry script. No line of it is
    the user's: a failure under it is named at the package's line."""
    try:
        if os.path.getsize(filename) > 4096:   # the templates are a few hundred bytes
            return False
        with open(filename, encoding="utf-8") as f:
            text = f.read()
        if "# EASY-INSTALL-ENTRY-SCRIPT:" in text:
            return True
        body = ast.parse(text).body
    except (OSError, SyntaxError, ValueError):
        return False
    *head, main = body or [None]
    if not (isinstance(main, ast.If) and ast.unparse(main.test).replace("'", '"') == '__name__ == "__main__"'):
        return False
    *fixes, leave = main.body
    return (all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in head) and all(_sets_argv0(s) for s in fixes)
            and isinstance(leave, ast.Expr) and isinstance(leave.value, ast.Call)
            and ast.unparse(leave.value.func) == "sys.exit" and len(leave.value.args) == 1
            and isinstance(leave.value.args[0], ast.Call))


def installed_module(filename: str) -> str | None:
    """The dotted module of an installed package's file (``lightning.pytorch.trainer.trainer``)."""
    for marker in PACKAGE_DIRS:
        if marker in filename:
            mod = filename.split(marker, 1)[1]
            mod = mod[:-3] if mod.endswith(".py") else mod
            return mod.replace(os.sep, ".").removesuffix(".__init__")
    return None


def innermost(frames, kinds: tuple[str, ...] = (USER,)):
    """The first of ``frames`` (innermost first: (filename, ...) tuples or FrameSummary entries)
    whose file's origin is one of ``kinds``, or None."""
    for fr in frames:
        name = fr.filename if hasattr(fr, "filename") else fr[0]
        if origin(name) in kinds:
            return fr
    return None


def stack():
    """The caller's stack as (filename, line), innermost first."""
    f = sys._getframe(1)
    while f is not None:
        yield f.f_code.co_filename, f.f_lineno
        f = f.f_back
