"""The site facts job_submit.lua needs before any answer, as JSON beside job_submit.lua.

The Lua must know the socket, the timeout, the fail mode and who is exempt even when no server
answers, so these come from the site config (the one source of truth) through a generated file,
``vest-bridge.json`` in slurm.conf's directory, that the Lua reads on every call (a few dozen
microseconds). The server rewrites it on every successful (re)load; ``vest bridge lua-config``
writes it by hand. A broken site config never overwrites it: the last good facts stay.

Exempt users are resolved to uids here (Lua inside slurmctld has no getpwnam); a user created
after the last write is not exempt until the next reload.

``rules``: the site's placement rules as data (GPU types with their capacity and floor, partitions,
headroom, selection, the site's messages split into literal text and placeholders), from which the
Lua decides by itself, without starting a process, a job that carries vsbatch's estimate when no
server answers (job_submit.lua, "the Lua's own decision"; tests/test_bridge_lua_decide.py holds it
to the Python decision). A message the Lua cannot render as Python's ``str.format_map`` does (a
format spec, a conversion, a field it does not know) is ``null``: the Lua then leaves every job that
needs it to the server or the per-call program.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import string
import sys
import tempfile
import time
from pathlib import Path

from ..estimate.profiles import get_profile
from ..site.config import MESSAGE_FIELDS, SiteConfig

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
        "rules": rules(site),
        # Every write differs: the Lua closes its circuit breaker when the file is rewritten (a
        # server that (re)started or reloaded has just written it), instead of waiting a second.
        "written": time.time(),
    }


def _message(site: SiteConfig, kind: str) -> list | None:
    """A site message as [[literal, placeholder or ""], ...] with help_url (a site constant) filled
    in, the way Messages.render treats it; None when str.format_map would do more than fill names."""
    pol = site.policy
    template = getattr(pol.messages, kind)
    if not pol.help_url:
        template = " ".join(s for s in re.split(r"(?<=[.!?])\s+", template) if "{help_url}" not in s)
    out: list[list[str]] = []
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError:
        return None
    for literal, name, spec, conversion in parts:
        if name is not None and (spec or conversion or name not in MESSAGE_FIELDS[kind]):
            return None
        if name == "help_url":
            literal, name = literal + pol.help_url, None
        out.append([literal, name or ""])
    return out


def rules(site: SiteConfig) -> dict:
    """What job_submit.lua needs to decide a job with an attached estimate as decide.py does."""
    pol = site.policy
    gpus = []
    for g in site.gpus:
        prof = get_profile(g.profile)
        gpus.append({"name": g.name, "profile": g.profile,
                     "capacity_bytes": g.memory_bytes if g.memory_bytes is not None else prof.usable_bytes,
                     "cost": g.cost,
                     # decision_record's floor: the calibrated context_mib, else the profile's default
                     "floor_mib": g.context_mib if g.context_mib is not None else prof.context_mib,
                     "floor": "c" if g.context_mib is not None else "d"})
    parts = [{"name": p.name, "gpu_types": list(p.gpu_types), "gpus_per_node": p.gpus_per_node,
              "max_gpus_per_job": p.max_gpus_per_job, "cost": p.cost, "nodes": p.nodes}
             for p in site.partitions]
    return {"gpus": gpus, "partitions": parts, "headroom_percent": float(pol.headroom_percent),
            "headroom_bytes": pol.headroom_bytes, "selection": pol.selection,
            "on_user_choice_too_small": pol.on_user_choice_too_small,
            "exempt_users": list(pol.exempt_users), "unknown_jobs": site.bridge.unknown_jobs,
            "allow_vest_directives": site.bridge.allow_vest_directives,
            "messages": {k: _message(site, k) for k in MESSAGE_FIELDS}}


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
