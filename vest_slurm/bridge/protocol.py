"""The bridge's wire format: one JSON object per line each way, both bounded.

Request (from job_submit.lua; every field optional except ``uid``; Lua omits nil fields)::

    {"v": 1, "uid": 1001, "account": "...", "partition": "...", "tres_per_node": "gres:gpu:v100:1",
     "tres_per_job": "...", "tres_per_task": "...", "gres": "...", "comment": "...", "name": "...",
     "work_dir": "...", "script": "#!/bin/bash\\n...", "min_nodes": 1, "num_tasks": 1}

Answer (to job_submit.lua)::

    {"v": 1, "action": "allow"|"modify"|"refuse"|"error", "reason": "<code>",
     "set": {"partition": "...", "tres_per_node": "..."}, "msg": "<text for the user>",
     "log": "<one greppable line for admins>", "errno": 0|2002|2072, "record": "vest1:..."}

``record`` (on allow and modify of a job vest placed): vest's decision, which job_submit.lua writes
into the job's AdminComment for `vest audit` (format: slurm/accounting.py, encode_record).

Strings from Lua are bytes (cjson does not check UTF-8); they are decoded with surrogateescape so
that hashing the script gives back its exact bytes (attach.script_sha256 does the same).
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from dataclasses import dataclass, field

WIRE_VERSION = 1
# Slurm's default max_script_size is 4 MB (slurm.conf SchedulerParameters); a site may raise it to
# 512 MB; past this the bridge answers "error" and job_submit.lua applies the site's fail mode.
MAX_REQUEST_BYTES = 16 * 1024 * 1024
MAX_FIELD_CHARS = 64 * 1024          # every field but the script (Slurm's own limits are lower)
MAX_MESSAGE_CHARS = 4000             # what we hand to slurm.log_user
ACTIONS = ("allow", "modify", "refuse", "error")
# job_desc fields the answer may set, and what a value may contain (checked again in Lua).
SETTABLE = ("partition", "tres_per_node", "tres_per_job", "tres_per_task")
SAFE_VALUE = re.compile(r"[A-Za-z0-9_.,:/=+-]{1,256}")
STRING_FIELDS = ("account", "partition", "tres_per_node", "tres_per_job", "tres_per_task",
                 "tres_per_socket", "gres", "comment", "name", "work_dir", "script")
INT_FIELDS = ("min_nodes", "num_tasks", "ntasks_per_node")
NO_VAL = 0xFFFFFFFE                  # Slurm's "not set" for 32-bit fields

# slurm/slurm_errno.h (22.05): what sbatch prints on the second line of a refusal.
ESLURM_ACCESS_DENIED = 2002          # "Access/permission denied"
ESLURM_INVALID_GRES = 2072           # "Invalid generic resource (gres) specification"


class ProtocolError(ValueError):
    """A request that cannot be read; ``reason`` is a stable code."""

    def __init__(self, reason: str, what: str):
        super().__init__(what)
        self.reason = reason


@dataclass(frozen=True)
class JobRequest:
    uid: int
    account: str | None = None
    partition: str | None = None
    tres_per_node: str | None = None
    tres_per_job: str | None = None
    tres_per_task: str | None = None
    tres_per_socket: str | None = None
    gres: str | None = None
    comment: str | None = None
    name: str | None = None
    work_dir: str | None = None
    script: str | None = None
    min_nodes: int | None = None
    num_tasks: int | None = None
    ntasks_per_node: int | None = None


@dataclass(frozen=True)
class Decision:
    action: str
    reason: str
    log: str
    set: tuple[tuple[str, str], ...] = ()
    msg: str = ""
    errno: int = 0
    elapsed_ms: float = field(default=0.0, compare=False)
    detail: str = field(default="", compare=False)   # why, in plain words, for `vest bridge test` (not on the wire)
    record: str = ""                                  # AdminComment for `vest audit` (accounting.encode_record)

    def wire(self) -> bytes:
        obj = {"v": WIRE_VERSION, "action": self.action, "reason": self.reason, "set": dict(self.set),
               "msg": self.msg[:MAX_MESSAGE_CHARS], "log": self.log, "errno": self.errno}
        if self.record:
            obj["record"] = self.record
        return (json.dumps(obj, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")


def parse_request(data: bytes) -> JobRequest:
    """One request line (without or with its newline). Raises ProtocolError."""
    if len(data) > MAX_REQUEST_BYTES:
        raise ProtocolError("too-large", f"request of {len(data)} bytes (limit {MAX_REQUEST_BYTES})")
    try:
        obj = json.loads(data.decode("utf-8", errors="surrogateescape"))
    except (ValueError, RecursionError):
        raise ProtocolError("malformed", "the request is not JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError("malformed", "the request is not a JSON object")
    if obj.get("v") != WIRE_VERSION:
        raise ProtocolError("version", f"wire version {str(obj.get('v'))[:16]!r}, expected {WIRE_VERSION}")
    uid = obj.get("uid")
    if not _whole(uid) or not 0 <= uid < 2**32:
        raise ProtocolError("malformed", "uid must be a whole number")
    values: dict = {"uid": int(uid)}
    for k in STRING_FIELDS:
        v = obj.get(k)
        if v is None:
            continue
        if not isinstance(v, str):
            raise ProtocolError("malformed", f"field {k} must be a string")
        if k != "script" and len(v) > MAX_FIELD_CHARS:
            raise ProtocolError("malformed", f"field {k} is longer than {MAX_FIELD_CHARS} characters")
        values[k] = v
    for k in INT_FIELDS:
        v = obj.get(k)
        # Slurm's NO_VAL/INFINITE (and cjson's float spelling of 64-bit ones) mean "not set".
        if _whole(v) and 0 < v < NO_VAL:
            values[k] = int(v)
    return JobRequest(**values)


def _whole(v: object) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return True
    return isinstance(v, float) and math.isfinite(v) and v.is_integer()


_SAFE_LOG = re.compile(r"[A-Za-z0-9_.,:/@+-]+")


def kv(value: object) -> str:
    """A log value that greps and cannot forge another field (the convention of placement's admin
    lines): percent-encoded unless plain; no space, quote, '=' or newline survives."""
    text = "-" if value is None else str(value)
    if len(text) > 200:
        text = text[:200] + "..."
    if _SAFE_LOG.fullmatch(text):
        return text
    return urllib.parse.quote(text.encode("utf-8", errors="surrogateescape"), safe=",:/@+-")
