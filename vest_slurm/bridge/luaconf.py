"""The site facts job_submit.lua needs before any answer, as JSON beside job_submit.lua.

The Lua must know the socket, the timeout, the fail mode and who is exempt even when no server
answers, so these come from the site config (the one source of truth) through a generated file,
``vest-bridge.json`` in slurm.conf's directory, that the Lua reads on every call (a few dozen
microseconds). The server rewrites it on every successful (re)load; ``vest bridge lua-config``
writes it by hand. A broken site config never overwrites it: the last good facts stay.

Exempt users are resolved to uids here (Lua inside slurmctld has no getpwnam); a user created
after the last write is not exempt until the next reload.
"""

from __future__ import annotations

import json
import os
import pwd
import sys
import tempfile
import time
from pathlib import Path

from ..site.config import SiteConfig

FILE_NAME = "vest-bridge.json"


def facts(site: SiteConfig, python: str | None = None, pythonpath: str | None = None) -> dict:
    uids = {0}
    for name in site.policy.exempt_users:
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            pass
    return {
        "socket_path": site.bridge.socket_path,
        "timeout_s": site.bridge.timeout_s,
        "fail": site.bridge.fail,
        "exempt_uids": sorted(uids),
        "exempt_accounts": list(site.policy.exempt_accounts),
        "python": python or sys.executable,
        "pythonpath": pythonpath if pythonpath is not None else os.environ.get("VEST_BRIDGE_PYTHONPATH", ""),
        "site_config": os.path.abspath(site.path),
        "fallback_ms_per_s": site.bridge.fallback_ms_per_s,
        "fallback_burst_ms": site.bridge.fallback_burst_ms,
        # Every write differs: the Lua closes its circuit breaker when the file is rewritten (a
        # server that (re)started or reloaded has just written it), instead of waiting a second.
        "written": time.time(),
    }


def write_lua_conf(site: SiteConfig, path: str | os.PathLike, python: str | None = None,
                   pythonpath: str | None = None) -> Path:
    """Write atomically (the controller may read it at any moment)."""
    dest = Path(path)
    text = json.dumps(facts(site, python, pythonpath), indent=1, sort_keys=True) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=".vest-bridge.", dir=dest.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest
