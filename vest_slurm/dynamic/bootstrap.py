"""Child process of the dynamic analysis: run an unmodified training script with fake CUDA.

    python -m vest_slurm.dynamic.bootstrap --out RESULT.json --steps 3 --tmpdir DIR [...] -- script.py ARGS
    python -m vest_slurm.dynamic.bootstrap ... --module pkg.train -- ARGS

The parent (vest_slurm/dynamic/runner.py) starts this in a fresh process session with a wall-time and
memory limit. Here:
- CUDA is fake (vest_slurm/estimate/_fakecuda.py): ``torch.cuda.is_available()`` is true, the device
  properties are the target GPU's, ``.cuda()``/``.to('cuda')``/``device='cuda'`` work, and tensors
  have no data, so building a 7-billion-parameter model costs no memory.
- The script's calls that need a real GPU or real values get stand-ins: ``.item()``/``.tolist()``
  (1 / 1.0 / False), ``.numpy()`` (zeros), GradScaler (scales and unscales without inf checks),
  ``torch.compile`` (runs eagerly), CUDA events, streams, memory queries (answered from the trace),
  ``torch.save`` (into the temp dir), DistributedDataParallel (a pass-through that allocates DDP's
  gradient buckets), ``torch.distributed`` (a single rank of the launch's world size).
- DataLoader workers are forced to 0: only the batches used are read, in this process.
- A PEP 578 audit hook refuses network connections, new processes, and writes outside the temp
  dir (Python-level writes elsewhere are redirected into it first).
- The script is stopped after N optimizer steps (StopTracing, a BaseException the script's own
  ``except Exception`` does not catch); the trace is written as JSON for the parent.
"""

from __future__ import annotations

import argparse
import builtins
import io
import json
import os
import runpy
import sys
import traceback

STATUS_OK = "ok"


class StopTracing(BaseException):
    """Raised after the N-th optimizer step: ends the script, keeps the trace."""


class Refused(PermissionError):
    pass


# ---- sandbox -----------------------------------------------------------------------------------

class Sandbox:
    """Writes only in ``tmpdir``, no network, no new processes. Python-level writes to other paths
    are redirected into ``tmpdir/redirected/...`` so checkpoints and logs neither break nor leak."""

    def __init__(self, tmpdir: str):
        self.tmpdir = os.path.realpath(tmpdir)
        self.redirected: list[str] = []
        self.refused: list[str] = []

    def inside(self, path) -> bool:
        try:
            p = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return p == self.tmpdir or p.startswith(self.tmpdir + os.sep) or p in ("/dev/null", "/dev/stdout", "/dev/stderr")

    def redirect(self, path) -> str:
        p = os.fsdecode(path)
        if isinstance(path, int) or self.inside(p):
            return path
        target = os.path.join(self.tmpdir, "redirected", os.path.abspath(p).lstrip(os.sep))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        self.redirected.append(os.path.abspath(p))
        return target

    def install(self) -> None:
        real_open = builtins.open
        sandbox = self

        def open_(file, mode="r", *a, **k):
            if not isinstance(file, int) and any(c in mode for c in "wax+"):
                file = sandbox.redirect(file)
            return real_open(file, mode, *a, **k)

        builtins.open = open_
        io.open = open_
        for name in ("makedirs", "mkdir"):
            real = getattr(os, name)

            def make(path, *a, _real=real, **k):
                return _real(sandbox.redirect(path), *a, **k)

            setattr(os, name, make)
        sys.addaudithook(self._audit)

    def _audit(self, event: str, args) -> None:
        if event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
            addr = args[1] if len(args) > 1 else None
            if isinstance(addr, str) or (isinstance(addr, bytes)):
                return   # AF_UNIX of the process itself is harmless; nothing leaves the machine
            self.refused.append(f"network {event} {addr!r}")
            raise Refused(f"vest: the training script tried to use the network ({event} {addr!r}); "
                          "estimates run without network access")
        if event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty"):
            self.refused.append(f"process {event}")
            raise Refused(f"vest: the training script tried to start a process ({event}); estimates run in one process")
        if event == "open" and len(args) >= 2:
            path, mode = args[0], args[1]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                      (isinstance(mode, int) and mode & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND))
            if writing and not isinstance(path, int) and path is not None and not self.inside(path):
                self.refused.append(f"write {path}")
                raise Refused(f"vest: the training script tried to write {os.fsdecode(path)!r} outside the estimate's temp dir")
        if event in ("os.remove", "os.rename", "os.rmdir", "shutil.rmtree", "os.truncate", "os.chmod", "os.chown", "os.symlink", "os.link"):
            path = args[0] if args else None
            if path is not None and not isinstance(path, int) and not self.inside(path):
                self.refused.append(f"{event} {path}")
                raise Refused(f"vest: the training script tried {event} on {os.fsdecode(path)!r} outside the estimate's temp dir")


# ---- the trace run -----------------------------------------------------------------------------

def _user_frame(tb, script_path: str | None):
    """The innermost frame of user code (not torch, not vest) in a traceback: file and line."""
    frames = traceback.extract_tb(tb)
    libs = (os.path.dirname(os.__file__), os.sep + "site-packages" + os.sep, os.sep + "vest_slurm" + os.sep)
    for fr in reversed(frames):
        if not any(part in fr.filename for part in libs) and not fr.filename.startswith("<"):
            return f"{fr.filename}:{fr.lineno}", (fr.line or "").strip()
    return None, None


def run(ns) -> dict:
    from ..estimate import _fakecuda as fc
    from . import standins as sp
    from ..estimate.tracing import Tracer

    tracer = Tracer(tuple(ns.capability))
    sandbox = Sandbox(ns.tmpdir)
    state = sp.ScriptState(tracer=tracer, max_steps=ns.steps, stop=StopTracing, tmpdir=ns.tmpdir,
                           world_size=ns.world_size)
    result: dict = {"status": STATUS_OK, "steps": 0}
    target = ns.module or ns.script
    sys.argv = [ns.script or ns.module] + list(ns.args)
    if ns.script:
        sys.path.insert(0, os.path.dirname(os.path.abspath(ns.script)))
    mode = fc.FakeCudaMode(tracer.recorder, scalar_stand_in=True)
    sandbox.install()
    try:
        with fc.cuda_answers(total_memory_bytes=ns.total_memory, name=ns.gpu_name, capability=tuple(ns.capability),
                             device_count=ns.device_count), sp.patched(state), mode, fc.CudaFactoryMode():
            try:
                if ns.module:
                    runpy.run_module(ns.module, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(ns.script, run_name="__main__")
            except StopTracing:
                pass
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if code != 0:
                    result.update(status="script-exit", message=f"{target} exited with status {code}"
                                  + (f": {e.code}" if isinstance(e.code, str) else ""))
            state.finish()
    except BaseException as e:  # the script failed by itself, or fake tensors could not answer it
        if os.environ.get("VEST_TRACEBACK"):   # developers: the whole stack into the child's log
            traceback.print_exc()
        where, line = _user_frame(e.__traceback__, ns.script)
        kind = "script-error"
        name = type(e).__name__
        if isinstance(e, Refused):
            kind = "refused"
        elif "DataDependent" in name or "DynamicOutputShape" in name or "data-dependent" in str(e).lower():
            kind = "data-dependent"
        elif isinstance(e, MemoryError):
            kind = "memory"
        result.update(status=kind, message=f"{name}: {str(e).splitlines()[0] if str(e) else ''}".strip(),
                      where=where, line=line)
    result["steps"] = state.steps
    result["step_ends"] = list(tracer.s.step_ends)
    result["redirected_writes"] = sandbox.redirected[:20]
    result["refused"] = sandbox.refused[:20]
    if result["status"] == STATUS_OK and state.steps == 0:
        result.update(status="no-step", message=f"{target} ended without an optimizer step")
    trace = tracer.finish(state.steps, ())
    result["events"] = [[e.action[0], e.block, e.size_bytes, e.phase, e.category, e.module, e.detail]
                        for e in trace.events]
    result["batch_hint"] = state.batch_hint
    from . import fake_dist

    result["fsdp"] = fake_dist.result(state)   # what fully_shard was asked (None: no FSDP2)
    result["notes"] = list(trace.notes)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="vest_slurm.dynamic.bootstrap")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tmpdir", required=True)
    p.add_argument("--gpu-name", default="NVIDIA A100-SXM4-80GB")
    p.add_argument("--total-memory", type=int, default=80 * 2**30)
    p.add_argument("--capability", type=int, nargs=2, default=(8, 0))
    p.add_argument("--device-count", type=int, default=1)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--module", default=None)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    rest = ns.rest[1:] if ns.rest[:1] == ["--"] else ns.rest
    if ns.module:
        ns.script, ns.args = None, rest
    else:
        ns.script, ns.args = rest[0], rest[1:]
    out_path = ns.out
    profile_to = os.environ.get("VEST_PROFILE")   # developers: cProfile of the child's run
    try:
        if profile_to:
            import cProfile

            prof = cProfile.Profile()
            result = prof.runcall(run, ns)
            prof.dump_stats(profile_to)
        else:
            result = run(ns)
    except BaseException as e:  # the bootstrap itself failed: report, never hang
        result = {"status": "internal", "message": f"{type(e).__name__}: {e}", "events": [], "steps": 0}
    with open(out_path + ".part", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".part", out_path)
    # Leave at once: the script's threads or atexit handlers must not hold the parent up.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
