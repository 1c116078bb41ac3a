"""A command that runs once and ends (``vest estimate``, ``vest check``, ``vsbatch``): two costs of
CPython that such a process need not pay, and that a long-lived one (the bridge's server and
worker) must.

- **Collection of what is never garbage.** Importing torch and torchvision leaves about a million
  objects tracked by the cyclic collector; every full collection walks all of them, and a trace
  and an allocator replay allocate enough small objects to start several (0.3 s of a resnet50
  estimate's 2 s here). ``settle()`` moves what is alive into the collector's permanent
  generation (``gc.freeze``), as forking servers do after start-up: the collector goes on
  collecting what is made afterwards. Cycles that are already garbage when it is called stay until
  the process ends, which for a one-shot command is moments later; a long-lived process never
  calls it (``begin`` is not called there), as its garbage would stay for good.
- **Teardown.** At exit CPython frees every module, torch's included (about 1 s here after an
  import of torch and torchvision, more with traces alive). ``leave(code)`` flushes the output,
  runs the ``atexit`` handlers (the cuDNN answers file, stopping traces made ahead, torch's own)
  and ends the process without the teardown.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys

_ONE_SHOT = False


def begin() -> None:
    """Mark this process as one that ends when its command does (a CLI's main, never the bridge)."""
    global _ONE_SHOT
    _ONE_SHOT = True


def settle() -> None:
    """In a one-shot process, take what is alive now (the imports, a model built, a trace made) out
    of the collector's future scans. Cheap (the collector's lists are spliced), so callers call it
    after each large piece of long-lived state is made."""
    if _ONE_SHOT:
        gc.freeze()


def leave(code: int) -> None:
    """End a one-shot process with ``code``: output flushed and ``atexit`` handlers run, as at a
    normal exit, without freeing every module first. Where neither torch nor cuDNN's frontend was
    imported there is little to skip, and the normal exit is taken (an embedding caller then sees
    SystemExit as usual). The frontend (a nanobind module, imported without torch where a script's
    convolutions are asked about) prints "nanobind: leaked ..." to stderr when freed at exit."""
    if "torch" not in sys.modules and "cudnn" not in sys.modules:
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed pipe: nothing more can be said on it
            pass
    atexit._run_exitfuncs()
    os._exit(code)
