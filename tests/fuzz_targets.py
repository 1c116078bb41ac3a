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
import dataclasses
from dataclasses import replace
from pathlib import Path

from hypothesis import strategies as st

from vest_slurm.bridge.decide import decide, decide_bytes
from vest_slurm.bridge.protocol import ACTIONS, INT_FIELDS, NO_VAL, SETTABLE, STRING_FIELDS, parse_request
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


# ---------------------------------------------------------------- job_submit.lua's own decision
# Site rules and job descriptions as slurmctld hands them to job_submit.lua (tests/
# test_bridge_lua_decide.py; the "lua" target below mutates them).

LUA_SITES = {name: load_site_config(str(REPO / "site-config" / name)) for name in ("testbed.toml", "example-site.toml")}
USERS = ("alice", "bob", "root")
MiB = 1 << 20


@st.composite
def site_rules(draw):
    site = LUA_SITES[draw(st.sampled_from(sorted(LUA_SITES)))]
    pol, br = site.policy, site.bridge
    msgs = pol.messages
    if draw(st.booleans()):
        msgs = dataclasses.replace(msgs, reroute=draw(st.sampled_from([
            msgs.reroute, "Moved to {partition} ({gres}), {user}: {requested} too small. See {help_url}.",
            "Moved. {{literal braces}} {partition!r}", "  padded {gres}  ", "{partition:>10}"])),
            refuse=draw(st.sampled_from([msgs.refuse, "", "Ask {user} about {reason}. Help: {help_url}"])))
    pol = dataclasses.replace(
        pol, headroom_percent=draw(st.sampled_from([0.0, 5.0, 10.0, 12.5, 33.3])),
        headroom_bytes=draw(st.sampled_from([0, 256 * MiB, 1000 * MiB + 7])),
        selection=draw(st.sampled_from(["smallest-fit", "cost"])),
        on_user_choice_too_small=draw(st.sampled_from(["reroute", "warn", "refuse"])),
        exempt_users=draw(st.sampled_from([(), ("bob",)])),
        help_url=draw(st.sampled_from(["", "https://help.example/gpu"])), messages=msgs)
    br = dataclasses.replace(br, unknown_jobs=draw(st.sampled_from(["allow", "warn", "refuse"])),
                             allow_vest_directives=draw(st.booleans()))
    gpus = tuple(dataclasses.replace(g, cost=draw(st.sampled_from([None, 1.0, 2.5, g.cost])),
                                     memory_bytes=draw(st.sampled_from([None, g.memory_bytes, 20 * GiB])))
                 for g in site.gpus)
    parts = tuple(dataclasses.replace(p, max_gpus_per_job=draw(st.sampled_from([None, 2, 8])),
                                      nodes=draw(st.sampled_from([None, 1, 3])),
                                      cost=draw(st.sampled_from([None, p.cost, 0.5])))
                  for p in site.partitions)
    return dataclasses.replace(site, policy=pol, bridge=br, gpus=gpus, partitions=parts)


def _script(draw, site, partition, gres, total: int) -> str | None:
    kind = draw(st.sampled_from(["estimate", "estimate", "estimate", "plain", "none", "tampered", "foreign"]))
    body = "\n".join(["#!/bin/bash", f"#SBATCH --partition={partition}" if partition else "",
                      f"#SBATCH --gres={gres}" if gres else "", draw(st.sampled_from(["", "# é ünïcode", "#VEST model=x"])),
                      "srun true", ""])
    if kind == "none":
        return None
    if kind == "plain":
        return body
    names = [g.name for g in site.gpus] + ["mi300"]
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    est = {}
    for t in chosen:
        g = site.gpu(t)
        profile = g.profile if g is not None and draw(st.integers(0, 9)) else "other-profile"
        need = draw(st.one_of(st.integers(1, 100 * 1024), st.integers(8 * 1024, 40 * 1024))) * MiB \
            + draw(st.integers(0, MiB - 1))
        est[t] = MemoryEstimate(profile, 0, draw(st.sampled_from([need, need // 2])), need)
    num = total if draw(st.integers(0, 4)) else draw(st.sampled_from([1, 2, 4, 8]))
    text = attach(body, make_payload(est, num_gpus=num, batch_size=draw(st.sampled_from([None, 32]))))
    if kind == "tampered":
        text = text.replace("srun true", "srun false")
    if kind == "foreign":
        head, line, rest = text.split("\n", 2)
        text = "\n".join([head, line.replace("v1", "v2"), rest])
    return text


@st.composite
def job_desc(draw, site):
    parts = [p.name for p in site.partitions]
    types = [g.name for g in site.gpus] + ["k80"]
    partition = draw(st.one_of(st.none(), st.sampled_from(parts + ["debug", ""]),
                               st.lists(st.sampled_from(parts + ["cpu"]), min_size=2, max_size=3, unique=True).map(",".join)))
    n = draw(st.sampled_from([1, 1, 2, 4, 8, 16]))
    t = draw(st.one_of(st.none(), st.sampled_from(types)))
    pre = draw(st.sampled_from(["gres:", "gres/"]))
    typed = f"gpu:{t}:{n}" if t else f"gpu:{n}"
    form = draw(st.sampled_from(["gres", "gres", "gres+shard", "gpus", "gpus-per-task", "none", "odd"]))
    job: dict = {}
    if form == "gres":
        job["tres_per_node"] = pre + typed
    elif form == "gres+shard":
        job["tres_per_node"] = f"{pre}{typed},{pre}shard:2"
    elif form == "gpus":
        job["tres_per_job"] = pre + typed
    elif form == "gpus-per-task":
        job["tres_per_task"] = pre + typed
        job["num_tasks"] = draw(st.sampled_from([1, 2, NO_VAL]))
    elif form == "odd":
        job["tres_per_node"] = draw(st.sampled_from([f"{pre}gpu:a100:1,{pre}gpu:v100:1", f"{pre}gpu::1",
                                                     f"{pre}gpu:a100:x", f"{pre}gpu:a 100:1", f"{pre}none"]))
    job["min_nodes"] = draw(st.sampled_from([1, 1, 2, NO_VAL]))
    nodes = job["min_nodes"] if job["min_nodes"] != NO_VAL else 1
    tasks = job.get("num_tasks", NO_VAL)
    total = {"gres": n * nodes, "gres+shard": n * nodes, "gpus": n,
             "gpus-per-task": n * (tasks if tasks != NO_VAL else nodes)}.get(form, 1)
    if partition is not None:
        job["partition"] = partition
    job["account"] = draw(st.sampled_from(["physics", "physics", "physics", "admins", "bio"]))
    job["name"] = draw(st.sampled_from(["train", "x y 'z'"]))
    job["user_name"] = draw(st.sampled_from(USERS + ("alice",) * 6))
    script = _script(draw, site, partition, None, total)
    if script is not None:
        job["script"] = script
    return job


def python_answer(job: dict, uid: int, site) -> dict:
    """decide.py's wire answer, less its log line, to the request job_submit.lua would send."""
    req = {"v": 1, "uid": uid, **{k: v for k, v in job.items() if k != "user_name"}}
    d = decide(parse_request(json.dumps(req).encode("utf-8", "surrogateescape")), site,
               users=lambda _uid: job.get("user_name"))
    out = json.loads(d.wire())
    out.pop("log")
    return out


def lua_answer(L, job: dict, uid: int) -> tuple[dict | None, str | None]:
    """job_submit.lua's own answer, less its log line, or None and why it leaves the job to Python."""
    r = L.decide_local(job, uid)
    a = r["answer"]
    if a is None:
        return None, r["why"]
    a.pop("log")
    if a.get("set") == []:              # cjson writes an empty table as []
        a["set"] = {}
    return a, None



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


# The site the "lua" target decides on: directives off, so that the Lua decides the GPU jobs without
# an estimate too (with them on it leaves those to Python).
SITE_LUA = replace(_BASE, bridge=replace(_BASE.bridge, allow_vest_directives=False))
_LUA: list = []


def _lua_state():
    if not _LUA:
        import tempfile

        from lua_run import LuaJob
        from vest_slurm.bridge.luaconf import write_lua_conf
        d = Path(tempfile.mkdtemp(prefix="vest-fuzz-lua-"))
        write_lua_conf(SITE_LUA, d / "vest-bridge.json")
        _LUA.append(LuaJob(d))
    return _LUA[0]


@st.composite
def lua_job(draw) -> bytes:
    """{"uid": N, "job": job_desc} as JSON bytes (mutated as bytes by scripts/fuzz.py)."""
    job = draw(job_desc(SITE_LUA))
    uid = 0 if job["user_name"] == "root" else 1001
    return json.dumps({"uid": uid, "job": job}, ensure_ascii=False).encode("utf-8", "surrogateescape")


def _as_slurm_gives(obj: object) -> tuple[int, dict] | None:
    """A job description of the types slurmctld's job_desc has (strings, uint32 counts), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("job"), dict):
        return None
    uid = obj.get("uid")
    if not isinstance(uid, int) or isinstance(uid, bool) or not 0 <= uid < 2**32:
        return None
    job = {}
    for k, v in obj["job"].items():
        if k in STRING_FIELDS or k == "user_name":
            if isinstance(v, str):
                job[k] = v
        elif k in INT_FIELDS and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32:
            job[k] = v
    try:
        json.dumps(job, ensure_ascii=False).encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:            # a surrogate no byte string makes: not from slurmctld
        return None
    return uid, job


def check_lua(data: bytes) -> str:
    """The Lua's answer, where it gives one, is decide.py's (all but the log line)."""
    try:
        got = _as_slurm_gives(json.loads(data.decode("utf-8", "surrogateescape")))
    except (ValueError, RecursionError):
        got = None
    if got is None:
        return "not-a-job"
    uid, job = got
    a, why = lua_answer(_lua_state(), job, uid)
    if a is None:
        return f"lua-left:{why}"
    want = python_answer({**job, "user_name": job.get("user_name")}, uid, SITE_LUA)
    assert a == want, (job, a, want)
    return f"lua-decided:{a['action']}"


TARGETS = {
    "jobscript": (job_script(), check_jobscript),
    "attached": (job_script(), check_attached),
    "protocol": (request_line(), check_protocol),
    "lua": (lua_job(), check_lua),
}


def decode_line_directly(line: str) -> str:
    """decode() on a bare line (no script): the estimate's own checks without the hash."""
    try:
        decode(line)
    except AttachError as e:
        return e.reason
    return "ok"
