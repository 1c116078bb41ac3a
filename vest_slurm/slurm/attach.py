"""The estimate vsbatch attaches to a job, for the job_submit.lua bridge to read.

Format, version 1: one line inserted right after the shebang of the submitted copy of the script
(the user's ``--comment`` is never touched)::

    #VEST-ESTIMATE v1 <base64url, no padding, of compact UTF-8 JSON>

The JSON object has exactly these fields:

- ``version``: 1
- ``script_sha256``: hex SHA-256 of the script text without this line (UTF-8; undecodable bytes
  kept as read with ``surrogateescape``), so an estimate cannot be carried over to another script
- ``gpus``: ``{gres type: {"profile": str, "required_bytes": int, "peak_bytes": int}}``, per GPU
- ``num_gpus``: int >= 1, ``batch_size``: int >= 1 or null (per GPU)
- ``tool_version``: str, ``created``: ISO 8601 UTC time (``2025-01-31T12:00:00Z``)

To the shell and to sbatch the line is a comment. Only the second line of the script is read,
and a line over ``MAX_LINE_CHARS`` is refused before decoding, so reading a script of several MB
costs one hash.

Trust: the line is written by vsbatch running as the user, so a user can forge it. The hash
catches stale and copied estimates, not forgery; a forged estimate can only move the user's own job
to a GPU the user could have asked for directly, or onto one too small for it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Mapping

from .. import __version__
from ..errors import VestError

PREFIX = "#VEST-ESTIMATE"
VERSION = 1
MAX_LINE_CHARS = 16 * 1024      # a payload for every known GPU type is well under 2 KiB
MAX_GPU_TYPES = 64
MAX_STRING_CHARS = 128
MAX_BYTES = 1 << 50             # 1 PiB: far above any GPU, far below float trouble in Lua
_B64URL = re.compile(r"[A-Za-z0-9_-]+")
_SHA = re.compile(r"[0-9a-f]{64}")
_FIELDS = ("version", "script_sha256", "gpus", "num_gpus", "batch_size", "tool_version", "created")


class AttachError(VestError):
    """An attached estimate that cannot be trusted. ``reason``: malformed, too-long, version,
    hash-mismatch, no-shebang."""

    def __init__(self, reason: str, what: str):
        super().__init__(f"attached estimate: {what}",
                         "submit the script with vsbatch again (it writes a fresh #VEST-ESTIMATE line)")
        self.reason = reason


@dataclass(frozen=True)
class GpuEstimate:
    gpu_type: str
    profile: str
    required_bytes: int
    peak_bytes: int


@dataclass(frozen=True)
class AttachedEstimate:
    gpus: tuple[GpuEstimate, ...]
    num_gpus: int = 1
    batch_size: int | None = None
    tool_version: str = __version__
    created: str = ""
    script_sha256: str = ""
    version: int = VERSION

    def gpu(self, gpu_type: str) -> GpuEstimate | None:
        return next((g for g in self.gpus if g.gpu_type == gpu_type), None)


def make_payload(estimates: Mapping[str, object], num_gpus: int = 1, batch_size: int | None = None,
                 now: datetime | None = None) -> AttachedEstimate:
    """From ``{gres type: MemoryEstimate}`` (``.gpu`` is the profile key)."""
    # The bridge places on max(peak, required): the peak sent is the one placement uses, with the
    # cuDNN engines' bound where the estimate has one (MemoryEstimate.placement_bytes).
    gpus = tuple(GpuEstimate(t, e.gpu, int(e.required_bytes), int(max(e.peak_bytes, getattr(e, "placement_bytes", 0))))
                 for t, e in sorted(estimates.items()))
    when = (now or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return AttachedEstimate(gpus, num_gpus, batch_size, __version__, when)


def script_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="surrogateescape")).hexdigest()


def encode(payload: AttachedEstimate) -> str:
    """The whole line, without its newline."""
    obj = {
        "version": payload.version, "script_sha256": payload.script_sha256,
        "gpus": {g.gpu_type: {"profile": g.profile, "required_bytes": g.required_bytes, "peak_bytes": g.peak_bytes}
                 for g in payload.gpus},
        "num_gpus": payload.num_gpus, "batch_size": payload.batch_size,
        "tool_version": payload.tool_version, "created": payload.created,
    }
    raw = json.dumps(obj, separators=(",", ":"), sort_keys=True, ensure_ascii=True).encode("ascii")
    line = f"{PREFIX} v{payload.version} " + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")
    if len(line) > MAX_LINE_CHARS:
        raise AttachError("too-long", f"the line would be {len(line)} characters (limit {MAX_LINE_CHARS})")
    return line


def attach(script_text: str, payload: AttachedEstimate) -> str:
    """Insert the estimate line after the shebang, replacing one already there; the payload's
    ``script_sha256`` is set from the script without the line."""
    text, _ = _split(script_text)
    if not text.startswith("#!"):
        raise AttachError("no-shebang", "the script has no #! first line to put the estimate after")
    line = encode(replace(payload, script_sha256=script_sha256(text), version=VERSION))
    head, nl, rest = text.partition("\n")
    if not nl:
        return f"{head}\n{line}"
    return f"{head}\n{line}\n{rest}"


def detach(text: str) -> tuple[str, AttachedEstimate | None]:
    """The script without the estimate line, and the checked estimate (None when there is none).
    Raises AttachError for a line that is there but malformed, of another version, or whose hash
    does not match the script."""
    original, line = _split(text)
    if line is None:
        return original, None
    return original, decode(line, original)


def decode(line: str, script_text: str | None = None) -> AttachedEstimate:
    """Decode and check one ``#VEST-ESTIMATE`` line; with ``script_text`` (the script without the
    line) also check the hash."""
    if len(line) > MAX_LINE_CHARS:
        raise AttachError("too-long", f"line of {len(line)} characters (limit {MAX_LINE_CHARS})")
    words = line.rstrip("\n").split(" ")
    if len(words) != 3 or words[0] != PREFIX:
        raise AttachError("malformed", f"expected '{PREFIX} v{VERSION} <data>'")
    if words[1] != f"v{VERSION}":
        raise AttachError("version", f"version {words[1][:16]!r} is not supported (this vest reads v{VERSION})")
    data = words[2]
    if not _B64URL.fullmatch(data):
        raise AttachError("malformed", "the data is not base64url")
    try:
        raw = base64.urlsafe_b64decode(data + "=" * (-len(data) % 4))
        obj = json.loads(raw.decode("utf-8"))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise AttachError("malformed", "the data does not decode to JSON") from None
    payload = _check(obj)
    if script_text is not None and script_sha256(script_text) != payload.script_sha256:
        raise AttachError("hash-mismatch", "it was made for another version of this script (the script changed since)")
    return payload


def _split(text: str) -> tuple[str, str | None]:
    """(text without the estimate line, the line) — only the line right after the shebang counts."""
    first = text.find("\n")
    if first < 0 or not text.startswith(PREFIX, first + 1):
        return text, None
    end = text.find("\n", first + 1)
    if end < 0:
        return text[:first], text[first + 1:]
    return text[: first + 1] + text[end + 1:], text[first + 1: end]


def _int(obj: dict, key: str, minimum: int, nullable: bool = False) -> int | None:
    v = obj.get(key)
    if v is None and nullable:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not minimum <= v <= MAX_BYTES:
        raise AttachError("malformed", f"field {key!r} must be a whole number from {minimum} to {MAX_BYTES}")
    return v


def _str(obj: dict, key: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or len(v) > MAX_STRING_CHARS:
        raise AttachError("malformed", f"field {key!r} must be a string of at most {MAX_STRING_CHARS} characters")
    return v


def _check(obj: object) -> AttachedEstimate:
    if not isinstance(obj, dict):
        raise AttachError("malformed", "the data is not a JSON object")
    if sorted(obj) != sorted(_FIELDS):
        raise AttachError("malformed", f"fields must be exactly {', '.join(_FIELDS)}")
    if obj["version"] != VERSION or isinstance(obj["version"], bool):
        raise AttachError("version", f"the data says version {str(obj['version'])[:16]!r}, the line v{VERSION}")
    sha = _str(obj, "script_sha256")
    if not _SHA.fullmatch(sha):
        raise AttachError("malformed", "script_sha256 is not 64 lowercase hex digits")
    gpus = obj["gpus"]
    if not isinstance(gpus, dict) or not 1 <= len(gpus) <= MAX_GPU_TYPES:
        raise AttachError("malformed", f"gpus must map 1 to {MAX_GPU_TYPES} GPU types to their estimates")
    entries = []
    for name, g in sorted(gpus.items()):
        if len(name) > MAX_STRING_CHARS or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise AttachError("malformed", "a GPU type name is not a gres type name")
        if not isinstance(g, dict) or sorted(g) != ["peak_bytes", "profile", "required_bytes"]:
            raise AttachError("malformed", f"gpus.{name} must have exactly profile, required_bytes, peak_bytes")
        entries.append(GpuEstimate(name, _str(g, "profile"), _int(g, "required_bytes", 0), _int(g, "peak_bytes", 0)))
    return AttachedEstimate(tuple(entries), _int(obj, "num_gpus", 1), _int(obj, "batch_size", 1, nullable=True),
                            _str(obj, "tool_version"), _str(obj, "created"), sha, VERSION)
