"""The directive worker: traces ``#VEST`` directives for the decision server, confined.

    python -c "import sys; del sys.path[0]; from vest_slurm.bridge.worker import main; main()" \\
        --user nobody --memory-mib 4096 --cpu-s 60

The server (``directives.py``) starts it in its own process session with pipes for stdin and
stdout; the worker confines itself (``sandbox.confine``: own mount and network namespaces, every
mount read-only but a private tmpfs, the site's unprivileged user, limits), loads torch and the
estimator, refuses sockets and programs from then on (seccomp), and answers one JSON line per
request line:

- ``{"op": "trace", "argv": [...], "num_gpus": N, "profiles": [...]}`` ->
  ``{"ok": true, "estimates": {profile: [required_bytes, peak_bytes]}}`` or
  ``{"ok": false, "reason": ..., "error": ...}``. The options are checked against the allow-list
  again here (``allowlist.parse_untrusted``): the worker trusts nothing it is sent.
- ``{"op": "probe", "write": [paths]}`` -> what the confinement allows: its user, whether each
  path could be created, whether sockets open. The server logs it at start; tests assert on it.

Its first line is ``{"ready": true, "confinement": ...}`` or ``{"ready": false, "problem": ...}``.
A request over the CPU limit ends the process (SIGXCPU); the server starts a new one.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

from .sandbox import SandboxError, confine, limit_cpu, refuse_sockets_and_exec


def _probe(write_paths: list[str]) -> dict:
    out = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
           "cwd": os.getcwd(), "writes": {}, "sockets": {}}
    for path in write_paths:
        try:
            with open(path, "x") as f:
                f.write("vest probe\n")
            out["writes"][path] = "written"
        except OSError as e:
            out["writes"][path] = f"refused: {e.strerror}"
    for name, family, kind in (("inet", socket.AF_INET, socket.SOCK_STREAM), ("inet6", socket.AF_INET6, socket.SOCK_STREAM),
                               ("unix", socket.AF_UNIX, socket.SOCK_STREAM), ("udp", socket.AF_INET, socket.SOCK_DGRAM)):
        try:
            s = socket.socket(family, kind)
            s.close()
            out["sockets"][name] = "opened"
        except OSError as e:
            out["sockets"][name] = f"refused: {e.strerror}"
    try:
        pid = os.fork()
    except OSError as e:
        out["exec"] = f"fork refused: {e.strerror}"
    else:
        if pid == 0:
            try:
                os.execv("/bin/true", ["/bin/true"])
            finally:
                os._exit(111)
        _, status = os.waitpid(pid, 0)
        out["exec"] = "ran" if os.waitstatus_to_exitcode(status) == 0 else "refused"
    return out


def _trace(req: dict) -> dict:
    from ..estimate.allowlist import parse_untrusted
    from ..errors import VestError
    from ..estimate.estimator import estimate
    from ..estimate.profiles import get_profile

    try:
        spec = parse_untrusted(req["argv"]).with_(num_gpus=int(req["num_gpus"]))
        profiles = [get_profile(p) for p in req["profiles"]]
        return {"ok": True, "estimates": {e.gpu: [e.required_bytes, e.peak_bytes] for e in estimate(spec, profiles)}}
    except VestError as e:
        return {"ok": False, "reason": getattr(e, "reason", type(e).__name__), "error": e.what}


def _warm() -> None:
    """Load what tracing loads (torch, the model libraries, cuDNN's frontend) before the seccomp
    filter is in force: a library that starts a helper program while loading does it now."""
    from ..estimate.estimator import estimate
    from ..estimate.profiles import get_profile
    from ..estimate.workload import parse_workload_args

    estimate(parse_workload_args(["--model", "torchvision:resnet18", "--batch-size", "2", "--input", "3x32x32",
                                  "--steps", "1"]), [get_profile("a100-40gb")])
    import timm  # noqa: F401
    import transformers  # noqa: F401


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="vest-directive-worker")
    ap.add_argument("--user", required=True)
    ap.add_argument("--memory-mib", type=int, required=True)
    ap.add_argument("--cpu-s", type=float, required=True)
    ns = ap.parse_args(argv)
    # every trace in this process, under its CPU and memory limits: the server's pool of workers is
    # the bridge's parallelism, not children of a worker (estimate/ahead.py)
    os.environ["VEST_TRACE_AHEAD"] = "0"
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)          # whatever a library prints goes to stderr, never into the answers
    try:
        conf = confine(ns.user, ns.memory_mib << 20)
        from ..estimate.models import forbid_user_code

        forbid_user_code()
        _warm()
        conf = conf.__class__(**{**conf.__dict__, "seccomp": refuse_sockets_and_exec()})
    except (SandboxError, OSError, ImportError) as e:
        proto.write(json.dumps({"ready": False, "problem": f"{type(e).__name__}: {e}"}) + "\n")
        return 1
    proto.write(json.dumps({"ready": True, "confinement": conf.line()}) + "\n")
    for line in sys.stdin:
        try:
            req = json.loads(line)
            if req.get("op") == "probe":
                answer = _probe([str(p) for p in req.get("write", [])])
            elif req.get("op") == "trace":
                limit_cpu(ns.cpu_s)
                answer = _trace(req)
            else:
                answer = {"ok": False, "reason": "bad-request", "error": f"unknown op {req.get('op')!r}"}
        except MemoryError:
            proto.write(json.dumps({"ok": False, "reason": "limit", "error": "memory limit of the directive worker"}) + "\n")
            return 3   # a fresh process, not one that ran out of memory, serves the next request
        except Exception as e:  # a bug must not take the worker down with a half-written answer
            answer = {"ok": False, "reason": "internal", "error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
