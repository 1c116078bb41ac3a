"""Slurm accounting as `vest audit` reads it: pure parsers over strings, no I/O.

In: the text of ``sacct --parsable2 --format=SACCT_FIELDS`` (every Slurm from 22.05) or of
``sacct --json`` (the data_parser of 23.02 and newer), a Jobstats ``AdminComment``, a CSV
``job_id,peak_mib[,gpu_type]`` that any monitoring can write, and vest's own decision record.
Out: ``AcctJob`` (one per job, steps folded in) and peak bytes.

Where the measurement comes from (Slurm source, src/plugins/gpu/nvml/gpu_nvml.c and
src/common/slurmdb_defs.c): with ``AcctGatherType``/``gpu_nvml`` and ``AccountingStorageTRES``
naming ``gres/gpu``, slurmd adds ``gres/gpumem`` (NVML's usedGpuMemory of each task's process,
in bytes) to each step's TRES usage; ``TRESUsageInMax`` is the largest over the step's tasks.
``--parsable2`` prints it with ``convert_num_unit`` (1024-based K/M/G/T/P suffixes, two decimals
when not whole; no suffix = bytes; ``--noconvert`` prints bytes); ``--json`` gives the count in
bytes under ``steps[].tres.requested.max``. A job's peak is the largest over its steps. Slurm
22.05 has no ``gres/gpumem``: those jobs need Jobstats, ``vest monitor`` or a CSV.

Jobstats (PrincetonUniversity/jobstats, slurm/slurmctldepilog.sh): its slurmctld epilog runs
``sacctmgr update job ... set AdminComment=JS1:<base64 of gzipped JSON>``, replacing the whole
field; the JSON has per node ``gpu_used_memory`` {GPU index: bytes} (the Prometheus max over the
job of nvidia_gpu_memory_used_bytes). ``JS1:Short`` / ``JS1:None`` carry no data.

vest's record (written by the bridge into ``AdminComment``, see bridge/decide.py): one token
``vest1:g=<gres type>,n=<need MiB>,q=<request MiB>,f=<floor MiB>,fs=<d|c>``: the GPU type the job
was placed on, the estimate's need there (max of peak and required), what was requested after
headroom, and the CUDA-context floor in it (default or calibrated). Because Jobstats replaces
AdminComment, job_submit.lua also appends the token to the batch script as its last line,
``#VEST-RECORD vest1:...`` (a shell comment), which accounting keeps with
``AccountingStoreFlags=job_script``: so a job the bridge estimated from its ``#VEST`` directives
keeps its record under Jobstats too. The Lua drops every ``#VEST-RECORD`` line a user wrote, and
``script_record`` takes the last one. slurmdbd keeps one script text per hash of the script as
submitted (taken before job_submit runs), so identical scripts share the first one's line: the
audit uses it only where it names the GPU type the job ran on. A script without one (an exempt user's vsbatch job) still has
vsbatch's ``#VEST-ESTIMATE`` line (attach.py).
"""

from __future__ import annotations

import base64
import binascii
import csv
import gzip
import io
import json
import re
from dataclasses import dataclass

from ..errors import VestError

MiB = 1 << 20
SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "AllocTRES", "TRESUsageInMax", "AdminComment",
                "WorkDir")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_NUM = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([KMGTP]?)$")
RECORD_PREFIX = "vest1:"
RECORD_LINE = "#VEST-RECORD "           # job_submit.lua's line in the batch script
_RECORD = re.compile(r"vest1:([A-Za-z0-9_.,:=+-]*)")


class AccountingError(VestError):
    """Accounting output that cannot be read; who must act is in ``fix``."""

    def __init__(self, what: str, fix: str = "check the sacct command and its Slurm version (vest audit --help)"):
        super().__init__(what, fix)


@dataclass(frozen=True)
class AcctJob:
    """One finished job as accounting keeps it. ``gpumem_bytes``: the largest gres/gpumem over its
    steps, None when accounting has none."""
    job_id: str
    name: str = ""
    state: str = ""
    exit_code: str = ""
    gpu_type: str = ""
    gpus: int = 0
    gpumem_bytes: int | None = None
    admin_comment: str = ""
    work_dir: str = ""
    std_err: str = ""
    script: str = ""


@dataclass(frozen=True)
class Record:
    """vest's decision as the bridge recorded it. Sizes in bytes."""
    gpu_type: str
    need_bytes: int
    request_bytes: int
    floor_bytes: int
    floor: str          # "default" | "calibrated"


# ---------------------------------------------------------------- TRES strings

def parse_size(text: str) -> int:
    """A sacct usage count: ``1.50G`` -> bytes (1024-based suffixes), ``123`` -> 123 bytes."""
    m = _NUM.match(text.strip())
    if not m:
        raise AccountingError(f"cannot read the size {text!r}")
    return round(float(m.group(1)) * _UNITS[m.group(2)])


def tres_usage(text: str) -> dict[str, str]:
    """``cpu=00:00:01,gres/gpumem=1.50G,mem=4M`` -> {name: value text}."""
    out = {}
    for part in (text or "").split(","):
        if "=" in part:
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def gpus_of(alloc_tres: str) -> tuple[str, int]:
    """(gres type, count) from AllocTRES: ``gres/gpu:a100=2`` -> ("a100", 2); untyped -> ("", n)."""
    typed, plain = ("", 0), 0
    for k, v in tres_usage(alloc_tres).items():
        if k.startswith("gres/gpu:") and v.isdigit():
            typed = (k.split(":", 1)[1], int(v))
        elif k == "gres/gpu" and v.isdigit():
            plain = int(v)
    return typed if typed[0] else ("", plain)


# ---------------------------------------------------------------- sacct --parsable2

def parse_sacct_parsable(text: str) -> list[AcctJob]:
    """``sacct --parsable2`` with its header line (any field order; SACCT_FIELDS are the ones used).
    Step rows (``12.batch``, ``12.0``) fold into their job: the largest gres/gpumem over them."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    head = lines[0].split("|")
    if "JobID" not in head:
        raise AccountingError("sacct output has no header line with JobID",
                              "run sacct with --parsable2 and without --noheader")
    jobs: dict[str, dict] = {}
    order: list[str] = []
    for ln in lines[1:]:
        cells = ln.split("|")
        if len(cells) < len(head):
            cells += [""] * (len(head) - len(cells))
        row = dict(zip(head, cells))
        jid = row["JobID"]
        base = jid.split(".", 1)[0]
        j = jobs.get(base)
        if j is None:
            j = jobs[base] = {"job_id": base, "gpumem": None}
            order.append(base)
        if "." not in jid:
            t, n = gpus_of(row.get("AllocTRES", ""))
            j.update(name=row.get("JobName", ""), state=row.get("State", "").split(" ")[0],
                     exit_code=row.get("ExitCode", ""), gpu_type=t, gpus=n,
                     admin_comment=row.get("AdminComment", ""), work_dir=row.get("WorkDir", ""),
                     std_err=row.get("StdErr", ""))
        mem = tres_usage(row.get("TRESUsageInMax", "")).get("gres/gpumem")
        if mem is not None:
            b = parse_size(mem)
            j["gpumem"] = b if j["gpumem"] is None else max(j["gpumem"], b)
    return [_job(jobs[k]) for k in order]


def _job(d: dict) -> AcctJob:
    return AcctJob(job_id=d["job_id"], name=d.get("name", ""), state=d.get("state", ""),
                   exit_code=d.get("exit_code", ""), gpu_type=d.get("gpu_type", ""), gpus=d.get("gpus", 0),
                   gpumem_bytes=d["gpumem"], admin_comment=d.get("admin_comment", "") or "",
                   work_dir=d.get("work_dir", "") or "", std_err=d.get("std_err", "") or "",
                   script=d.get("script", "") or "")


# ---------------------------------------------------------------- sacct --json

def _first(v) -> str:
    if isinstance(v, list):
        return str(v[0]) if v else ""
    return "" if v is None else str(v)


def _exit(v) -> str:
    """data_parser's PROCESS_EXIT_CODE: {"status": [...], "return_code": {"number": n, "set": b},
    "signal": {"id": {"number": s}}} (older plugins: a plain number)."""
    if isinstance(v, dict):
        rc = v.get("return_code")
        rc = rc.get("number", 0) if isinstance(rc, dict) else (rc or 0)
        sig = v.get("signal", {}) or {}
        sid = sig.get("id", 0) if isinstance(sig, dict) else 0
        sid = sid.get("number", 0) if isinstance(sid, dict) else (sid or 0)
        return f"{rc}:{sid}"
    return f"{v}:0" if v is not None else ""


def _tres_list_gpus(items) -> tuple[str, int]:
    typed, plain = ("", 0), 0
    for t in items or ():
        if t.get("type") == "gres" and str(t.get("name", "")).startswith("gpu:"):
            typed = (t["name"].split(":", 1)[1], int(t.get("count") or 0))
        elif t.get("type") == "gres" and t.get("name") == "gpu":
            plain = int(t.get("count") or 0)
    return typed if typed[0] else ("", plain)


def parse_sacct_json(text: str) -> list[AcctJob]:
    """``sacct --json`` (data_parser v0.0.39 and newer: Slurm 23.02+)."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise AccountingError(f"sacct --json output is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list):
        raise AccountingError("sacct --json output has no 'jobs' list")
    out = []
    for job in doc["jobs"]:
        peak = None
        for step in job.get("steps") or ():
            for t in (((step.get("tres") or {}).get("requested") or {}).get("max") or ()):
                if t.get("type") == "gres" and t.get("name") == "gpumem" and t.get("count") is not None:
                    peak = int(t["count"]) if peak is None else max(peak, int(t["count"]))
        t, n = _tres_list_gpus((job.get("tres") or {}).get("allocated"))
        comment = job.get("comment") or {}
        stderr = job.get("stderr_expanded") or job.get("stderr") or ""
        out.append(_job({"job_id": str(job.get("job_id")), "name": job.get("name", ""),
                         "state": _first((job.get("state") or {}).get("current")),
                         "exit_code": _exit(job.get("exit_code")), "gpu_type": t, "gpus": n, "gpumem": peak,
                         "admin_comment": comment.get("administrator", "") if isinstance(comment, dict) else "",
                         "work_dir": job.get("working_directory", ""), "std_err": stderr,
                         "script": job.get("script", "")}))
    return out


# ---------------------------------------------------------------- sacct --batch-script

def parse_batch_script(text: str) -> str:
    """The script of ``sacct --batch-script --jobs=ID`` (src/sacct/options.c _print_script): a
    "Batch Script for ID" line and a rule of dashes before it unless the header is off (22.05 prints
    them even with --noheader); "NONE" where accounting did not keep it (no
    AccountingStoreFlags=job_script) -> "". 22.05 adds a newline after the script; the caller tries
    both (site/audit.py)."""
    lines = text.split("\n", 2)
    if text.startswith("Batch Script for ") and len(lines) == 3 and set(lines[1]) == {"-"}:
        text = lines[2]
    return "" if text.strip() in ("", "NONE") else text


# ---------------------------------------------------------------- Jobstats

def jobstats_summary(admin_comment: str) -> dict | None:
    """The Jobstats JSON of an ``AdminComment`` (``JS1:`` + base64 of gzip), None where there is none."""
    s = (admin_comment or "").strip()
    if not s.startswith("JS1:") or s in ("JS1:Short", "JS1:None"):
        return None
    try:
        return json.loads(gzip.decompress(base64.b64decode(s[4:].replace(" ", ""))))
    except (binascii.Error, OSError, EOFError, ValueError) as e:
        raise AccountingError(f"a Jobstats AdminComment cannot be decoded: {e}",
                              "check the Jobstats epilog (slurmctldepilog.sh) of the site") from None


def jobstats_peak_bytes(admin_comment: str) -> int | None:
    """The largest per-GPU used memory of a Jobstats summary, over nodes and GPUs."""
    doc = jobstats_summary(admin_comment)
    if not doc:
        return None
    peaks = [int(v) for node in (doc.get("nodes") or {}).values()
             for v in ((node or {}).get("gpu_used_memory") or {}).values()]
    return max(peaks) if peaks else None


def jobstats_comment(summary: dict) -> str:
    """The AdminComment Jobstats writes for ``summary`` (the format above; tests and the testbed)."""
    return "JS1:" + base64.b64encode(gzip.compress(json.dumps(summary).encode("ascii"))).decode("ascii")


# ---------------------------------------------------------------- CSV from any monitor

def parse_measured_csv(text: str) -> dict[str, tuple[int, str]]:
    """``job_id,peak_mib[,gpu_type]`` (a header line is optional) -> {job id: (bytes, gpu type)}."""
    out = {}
    for i, row in enumerate(csv.reader(io.StringIO(text))):
        if not row or not row[0].strip() or row[0].strip().startswith("#"):
            continue
        if i == 0 and row[0].strip().lower() in ("job_id", "jobid"):
            continue
        try:
            mib = float(row[1])
        except (IndexError, ValueError):
            raise AccountingError(f"measured CSV line {i + 1}: {','.join(row)!r} is not job_id,peak_mib[,gpu_type]",
                                  "write one line per job: job_id,peak_mib[,gpu_type]") from None
        out[row[0].strip()] = (round(mib * MiB), row[2].strip() if len(row) > 2 else "")
    return out


# ---------------------------------------------------------------- vest's record

def encode_record(r: Record) -> str:
    fs = "c" if r.floor == "calibrated" else "d"
    return (f"{RECORD_PREFIX}g={r.gpu_type},n={-(-r.need_bytes // MiB)},q={-(-r.request_bytes // MiB)},"
            f"f={r.floor_bytes // MiB},fs={fs}")


def decode_record(text: str) -> Record | None:
    """vest's record in an AdminComment (or any text), None where there is none or it is damaged."""
    m = _RECORD.search(text or "")
    if not m:
        return None
    kv = dict(p.split("=", 1) for p in m.group(1).split(",") if "=" in p)
    try:
        return Record(kv["g"], int(kv["n"]) * MiB, int(kv["q"]) * MiB, int(kv["f"]) * MiB,
                      "calibrated" if kv.get("fs") == "c" else "default")
    except (KeyError, ValueError):
        return None


def script_record(script: str) -> Record | None:
    """vest's record in a stored batch script: its last ``#VEST-RECORD`` line (job_submit.lua's;
    the Lua drops any the user wrote), None where there is none or it is damaged."""
    lines = [ln for ln in (script or "").splitlines() if ln.startswith(RECORD_LINE)]
    return decode_record(lines[-1][len(RECORD_LINE):].strip()) if lines else None
