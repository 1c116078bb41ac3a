"""Fuzz targets of the bridge's inputs and their hypothesis strategies, shared by the test suite
(tests/test_bridge_fuzz.py, a few thousand cases) and scripts/fuzz.py (long runs).

What enters: generated job scripts (``#SBATCH`` and ``#VEST`` lines, ``#VEST-ESTIMATE`` lines valid,
corrupted or forged, odd encodings, CRLF, NUL, long lines), attached-estimate lines, and the bridge's
request lines (JSON with fields of every type, garbage bytes, the scripts above inside). What
leaves: nothing; each target raises AssertionError (or the unexpected exception) when an input gets
neither a decision nor a clear error:

- ``jobscript``: parse_job_script gives a JobScript or a VestError with a message and a fix;
- ``attached``: detach / decode give an estimate, None, or an AttachError with a reason;
- ``protocol``: decide_bytes (the server's and the per-call program's whole decision, the #VEST
  allow-list included) always gives a Decision whose wire line job_submit.lua accepts: one line of
  ASCII JSON, a known action, a log line without newline, and only settable fields with values of
  the Lua's character class.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import replace
from pathlib import Path

from hypothesis import strategies as st

from vest_slurm.bridge.decide import decide_bytes
from vest_slurm.bridge.protocol import ACTIONS, SETTABLE
from vest_slurm.errors import VestError
from vest_slurm.estimate.record import MemoryEstimate
from vest_slurm.site.config import load_site_config
from vest_slurm.slurm.attach import AttachError, attach, decode, detach, make_payload
from vest_slurm.slurm.jobscript import parse_job_script

REPO = Path(__file__).resolve().parents[1]
_BASE = load_site_config(str(REPO / "site-config" / "testbed.toml"))
# #VEST lines are read by the allow-list (directives=None: the per-call program's path, no trace)
SITE = replace(_BASE, bridge=replace(_BASE.bridge, allow_vest_directives=True))
GiB = 1 << 30
LUA_VALUE = re.compile(r"[A-Za-z0-9_.,:/=+-]{1,256}")     # job_submit.lua parse_answer

# ---------------------------------------------------------------- strategies

SBATCH_OPTIONS = ("--partition", "-p", "--gres", "--gpus", "-G", "--gpus-per-node", "--nodes", "-N",
                  "--ntasks", "-n", "--job-name", "-J", "--account", "-A", "--time", "-t", "--mem",
                  "--output", "-o", "--array", "--constraint", "--exclusive", "--hold", "--wrap",
                  "--gpus-per-task", "--cpus-per-task", "--no-such-option")
VALUES = ("v100", "a100", "h100", "gpu:v100:1", "gpu:a100:4", "gpu:2", "a100:1", "gpu:h100:0", "1", "0",
          "-1", "4294967294", "1-3", "2:00:00", "", "x" * 300, "'quoted value'", '"dq"', "a b", "$(touch /tmp/x)",
          "gpu:v100:1,gpu:a100:1", "gres/gpu:1", "café", "\u202e", "%s%n")
VEST_WORDS = ("--model", "torchvision:resnet18", "timm:resnet50", "hf:gpt2", "hf:/etc/passwd", "mlp:64-32",
              "--batch-size", "16", "0", "-3", "999999999", "--input", "3x224x224", "seq128", "--optimizer",
              "adam", "sgd-momentum", "os:system", "--precision", "amp-bf16", "fp32", "--model-args",
              "checkpoint_path=/x", "trust_remote_code=True", "--steps", "model=torchvision:resnet50",
              "batch=128", "=", "--", "'", '"', "\\", "file.py:build")

_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=80)
_surrogate_text = st.binary(max_size=80).map(lambda b: b.decode("utf-8", "surrogateescape"))


@st.composite
def sbatch_line(draw):
    prefix = draw(st.sampled_from(("#SBATCH ", "#SBATCH\t", "#SBATCH", "# SBATCH ", "#sbatch ")))
    words = []
    for _ in range(draw(st.integers(0, 4))):
        opt = draw(st.sampled_from(SBATCH_OPTIONS))
        val = draw(st.one_of(st.sampled_from(VALUES), _text))
        words.append(draw(st.sampled_from((f"{opt}={val}", f"{opt} {val}", opt))))
    return prefix + " ".join(words)


@st.composite
def vest_line(draw):
    prefix = draw(st.sampled_from(("#VEST ", "#VEST\t", "#VEST", "#VEST-ESTIMATE ", "#VESTX ")))
    words = draw(st.lists(st.one_of(st.sampled_from(VEST_WORDS), _text), max_size=8))
    return prefix + " ".join(words)


def _estimates(need_gib: float) -> dict:
    need = int(need_gib * GiB)
    return {t: MemoryEstimate(p, c * GiB, need, need)
            for t, p, c in (("v100", "v100-16gb", 16), ("a100", "a100-40gb", 40), ("h100", "h100-80gb", 80))}


@st.composite
def estimate_line(draw, body: str):
    """A #VEST-ESTIMATE line for ``body``: valid, or mutated (bytes flipped, cut, another version or
    hash, another GPU count)."""
    payload = make_payload(_estimates(draw(st.floats(0, 200, allow_nan=False))),
                           num_gpus=draw(st.integers(1, 8)))
    shebanged = body if body.startswith("#!") else "#!/bin/bash\n" + body   # attach needs one
    line = attach(shebanged, payload).split("\n")[1]
    how = draw(st.sampled_from(("valid", "flip", "cut", "version", "append", "garbage", "other-script")))
    if how == "flip" and line:
        i = draw(st.integers(0, len(line) - 1))
        line = line[:i] + draw(st.sampled_from(string.printable)) + line[i + 1:]
    elif how == "cut":
        line = line[:draw(st.integers(0, len(line)))]
    elif how == "version":
        line = line.replace(" v1 ", draw(st.sampled_from((" v2 ", " v0 ", " ", " v1  "))), 1)
    elif how == "append":
        line += draw(_text)
    elif how == "garbage":
        line = "#VEST-ESTIMATE v1 " + draw(st.text(alphabet=string.ascii_letters + "-_=", max_size=200))
    elif how == "other-script":
        line = attach(shebanged + "echo changed\n", payload).split("\n")[1]
    return line


@st.composite
def job_script(draw):
    """A job script as sbatch hands it to the controller."""
    shebang = draw(st.sampled_from(("#!/bin/bash", "#!/bin/sh", "#! /usr/bin/env bash", "", "#", "bash")))
    lines = draw(st.lists(st.one_of(sbatch_line(), vest_line(), _text, _surrogate_text,
                                    st.sampled_from(("python train.py --batch-size 64", "srun python x.py",
                                                     "torchrun --nproc_per_node=4 train.py", "true", "")),
                                    st.text(max_size=5).map(lambda t: t * 1000)), max_size=12))
    body = shebang + "\n" + "\n".join(lines) + "\n"
    if draw(st.booleans()):
        est = draw(estimate_line(body))
        first, _, rest = body.partition("\n")
        body = first + "\n" + est + "\n" + rest
    enc = draw(st.sampled_from(("plain", "crlf", "nul", "bom", "latin1")))
    if enc == "crlf":
        body = body.replace("\n", "\r\n")
    elif enc == "nul":
        i = draw(st.integers(0, len(body)))
        body = body[:i] + "\0" + body[i:]
    elif enc == "bom":
        body = "\ufeff" + body
    elif enc == "latin1":
        body = body.encode("utf-8", "surrogateescape").decode("latin-1")
    return body


_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64), st.floats(allow_nan=True),
                         _text, st.sampled_from(VALUES))
_json_value = st.recursive(_json_scalar, lambda c: st.one_of(st.lists(c, max_size=3),
                                                             st.dictionaries(_text, c, max_size=3)), max_leaves=6)
REQUEST_FIELDS = ("account", "partition", "tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket",
                  "gres", "comment", "name", "work_dir", "script", "min_nodes", "num_tasks", "ntasks_per_node")


@st.composite
def well_formed_request(draw) -> dict:
    """What a real submission sends: a GPU job with vsbatch's estimate (fits, must move, fits
    nowhere, or made for another script), one field then perhaps replaced by anything."""
    need = draw(st.sampled_from((4, 20, 60, 200)))
    part = draw(st.sampled_from(("v100", "a100", "h100")))
    body = f"#!/bin/bash\n#SBATCH --partition={part}\n#SBATCH --gres=gpu:{part}:1\n" + draw(_text) + "\ntrue\n"
    script = attach(body, make_payload(_estimates(need), num_gpus=draw(st.sampled_from((1, 1, 1, 2)))))
    if draw(st.integers(0, 5)) == 0:
        script += "echo changed\n"
    obj = {"v": 1, "uid": draw(st.sampled_from((1001, 1002, 4242))), "partition": part,
           "tres_per_node": f"gres:gpu:{part}:1", "script": script, "name": draw(_text)}
    if draw(st.booleans()):
        obj[draw(st.sampled_from(REQUEST_FIELDS))] = draw(_json_value)
    return obj


@st.composite
def request_line(draw) -> bytes:
    """A request line as job_submit.lua sends it, or one that went wrong on the way."""
    if draw(st.integers(0, 2)) == 0:
        return json.dumps(draw(well_formed_request()), ensure_ascii=False).encode("utf-8", "surrogateescape")
    obj: dict = {}
    if draw(st.integers(0, 9)):
        obj["v"] = 1
    else:
        obj["v"] = draw(_json_value)
    obj["uid"] = draw(st.one_of(st.sampled_from((1001, 1002, 0, 65534, 4294967295)), _json_value))
    for k in draw(st.lists(st.sampled_from(REQUEST_FIELDS), unique=True, max_size=8)):
        if k == "script":
            obj[k] = draw(st.one_of(job_script(), _json_value))
        elif k in ("partition",):
            obj[k] = draw(st.one_of(st.sampled_from(("v100", "a100", "h100", "v100,a100", "cpu")), _json_value))
        elif k.startswith("tres") or k == "gres":
            obj[k] = draw(st.one_of(st.sampled_from(("gres:gpu:v100:1", "gres:gpu:2", "gres/gpu:a100=1",
                                                     "gres:gpu:h100:0", "gpu:v100:1")), _json_value))
        else:
            obj[k] = draw(_json_value)
    try:
        data = json.dumps(obj, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogateescape")
    except (ValueError, UnicodeEncodeError):
        data = b"{}"
    how = draw(st.sampled_from(("json",) * 6 + ("cut", "bytes", "nested", "empty")))
    if how == "cut":
        data = data[:draw(st.integers(0, len(data)))]
    elif how == "bytes":
        data = draw(st.binary(max_size=300))
    elif how == "nested":
        data = b"[" * draw(st.integers(1, 100000)) + data
    elif how == "empty":
        data = b""
    return data


# ---------------------------------------------------------------- targets


def _clear(e: VestError) -> None:
    assert isinstance(e.what, str) and e.what.strip(), f"an error without a message: {e!r}"


def check_jobscript(text: str) -> str:
    try:
        js = parse_job_script(text, "job.sh")
    except VestError as e:
        _clear(e)
        assert e.fix, f"an error that says nothing to do: {e.what}"
        return "error"
    assert js is not None
    return "parsed"


def check_attached(text: str) -> str:
    try:
        body, est = detach(text)
    except AttachError as e:
        _clear(e)
        assert e.reason, e
        return f"refused-{e.reason}"
    assert isinstance(body, str)
    return "none" if est is None else "estimate"


def check_protocol(data: bytes) -> str:
    d = decide_bytes(data, SITE, users={1001: "alice", 1002: "bob"}.get)
    assert d.action in ACTIONS, d
    wire = d.wire()
    assert wire.endswith(b"\n") and b"\n" not in wire[:-1] and len(wire) <= 65536, wire[:200]
    a = json.loads(wire.decode("ascii"))
    assert a["v"] == 1 and a["action"] in ("allow", "modify", "refuse", "error")
    assert isinstance(a["msg"], str) and isinstance(a["log"], str) and "\n" not in a["log"]
    if a["action"] == "modify":
        assert a["set"] and set(a["set"]) <= set(SETTABLE), a["set"]
        assert all(isinstance(v, str) and LUA_VALUE.fullmatch(v) for v in a["set"].values()), a["set"]
    if a["action"] == "refuse":
        assert a["errno"] in (2002, 2072), a
    return f"{a['action']}:{a.get('reason', '')}"


TARGETS = {
    "jobscript": (job_script(), check_jobscript),
    "attached": (job_script(), check_attached),
    "protocol": (request_line(), check_protocol),
}


def decode_line_directly(line: str) -> str:
    """decode() on a bare line (no script): the estimate's own checks without the hash."""
    try:
        decode(line)
    except AttachError as e:
        return e.reason
    return "ok"
