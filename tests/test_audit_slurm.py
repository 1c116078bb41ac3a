"""`vest audit` end to end on the testbed with real accounting (slurmdbd + MariaDB on loopback):
jobs placed by the bridge (which records its decision in AdminComment) and by vsbatch (whose
estimate is in the stored batch script), one that dies of CUDA out of memory, a Jobstats-style
epilog that replaces one job's AdminComment, measured peaks given as a CSV (no GPU here), and
--apply on a copy of the site config.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from bridge_tb import bridge_testbed
from slurm_wait import wait_until
from vest_slurm.cli import run as vest_run
from vest_slurm.estimate.record import MemoryEstimate
from vest_slurm.site import vsbatch
from vest_slurm.slurm.accounting import decode_record, jobstats_comment
from vest_slurm.slurm.attach import attach, make_payload

pytestmark = pytest.mark.slurm
GiB = 1 << 30
USER = "vestbr-alice"
ROOT = Path(__file__).resolve().parent.parent
MLP = "#VEST --model 'mlp:[[\"Linear\",1024,1024],[\"ReLU\"],[\"Linear\",1024,10]]' --input 1024 --batch-size 8"
# A job whose stored script is read back is submitted held and released once its accounting row
# exists. On 22.05 slurmctld asks slurmdbd whether it needs a job's script only from its db-index
# thread, which passes every 5 s (accounting_storage_slurmdbd.c, _set_db_inx_thread); a job that ends
# before that pass is recorded by its completion message alone, and one that starts while the pass is
# in flight sends its start through the agent, which gets no answer: either way the script is never
# sent (sacct --batch-script: NONE). A fixed sleep in the job (2 s) and then waiting in the job for its
# own row both failed in full-suite runs; a held job cannot start or end before the pass.
HOLD = "#SBATCH --hold"


def accounting_log(tb, job_id: str) -> str:
    """What the controller and slurmdbd logged about ``job_id`` (for a failure's message)."""
    lines = []
    for name in ("slurmctld.log", "slurmdbd.log"):
        path = tb.slurm.log_dir / name
        if path.exists():
            lines += [f"{name}: {ln}" for ln in path.read_text(errors="replace").splitlines()
                      if re.search(rf"JobId={job_id}\b|\bjob {job_id}\b", ln) or "script" in ln.lower()]
    return "\n".join(lines[-40:])


def release_when_recorded(tb, ids: list[str]) -> None:
    def recorded() -> bool:
        rows = sacct(tb, "--format=JobID", "-X", f"--jobs={','.join(ids)}").splitlines()[1:]
        return set(ids) <= {ln.split("|")[0] for ln in rows}
    wait_until(recorded, 60, f"jobs {ids} recorded in accounting while held")
    r = subprocess.run(["scontrol", "release", ",".join(ids)], capture_output=True, text=True, env=tb.env,
                       timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def acct(bridge_users):
    with bridge_testbed("vest-acct-tb-", accounting=True, directives=True, exempt_users=["root"]) as tb:
        deadline = time.monotonic() + 180     # the directive worker imports torch first
        while "action=worker-start" not in tb.log_path.read_text() and time.monotonic() < deadline:
            assert "action=worker-unavailable" not in tb.log_path.read_text(), tb.log_path.read_text()
            time.sleep(0.2)
        yield tb


def attached(body: str, need_gib: float, partition="v100", gres="gpu:v100:1") -> str:
    est = {t: MemoryEstimate(p, c * GiB, int(need_gib * GiB), int(need_gib * GiB))
           for t, p, c in (("v100", "v100-16gb", 16), ("a100", "a100-40gb", 40), ("h100", "h100-80gb", 80))}
    text = "\n".join(["#!/bin/bash", f"#SBATCH --partition={partition}", f"#SBATCH --gres={gres}", body, ""])
    return attach(text, make_payload(est, num_gpus=1))


def sbatch_as(tb, user: str, script: str, cwd: str, name: str = "") -> str:
    argv = ["sbatch", f"--job-name={name or 'a-' + uuid.uuid4().hex[:8]}", "--parsable"]
    argv = ["runuser", "-u", user, "--", "env", f"SLURM_CONF={tb.env['SLURM_CONF']}", *argv]
    p = subprocess.run(argv, input=script.encode(), capture_output=True, env=tb.env, cwd=cwd, timeout=60)
    assert p.returncode == 0, p.stderr.decode()
    return p.stdout.decode().strip().split(";")[0]


def sacct(tb, *args: str) -> str:
    r = subprocess.run(["sacct", "--allusers", "--parsable2", *args], capture_output=True, text=True,
                       env=tb.env, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def decision_line(tb, name: str) -> str:
    """The bridge's log line for job ``name``: the server's log, else the controller's (the Lua logs
    there, e.g. when it answered without the server); waited for, the server writes it after it answers."""
    def find() -> str:
        for path in (tb.log_path, tb.slurm.log_dir / "slurmctld.log"):
            for ln in path.read_text(errors="replace").splitlines():
                if f"job={name} " in ln and "vest-bridge: action=" in ln:
                    return ln
        return ""
    wait_until(lambda: find() != "", 30, f"the bridge's decision for {name} logged")
    return find()


def finished(tb, ids: list[str]) -> bool:
    out = sacct(tb, "--format=JobID,State", f"--jobs={','.join(ids)}")
    states = dict(ln.split("|")[:2] for ln in out.splitlines()[1:] if "." not in ln.split("|")[0])
    return len(states) == len(ids) and all(s in ("COMPLETED", "FAILED") for s in states.values())


def vest(env: dict, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    old = dict(os.environ)
    os.environ.update(env)
    import contextlib

    try:
        with contextlib.redirect_stdout(out):
            rc = vest_run(list(argv))
    finally:
        os.environ.clear()
        os.environ.update(old)
    return rc, out.getvalue()


def test_audit_end_to_end_with_slurmdbd(acct, tmp_path):
    tb = acct
    jobdir = tempfile.mkdtemp(prefix="vest-acct-jobs-")
    os.chmod(jobdir, 0o777)
    try:
        # 1. the bridge places a user's job (6 GiB needed; v100 asked) and records its decision
        placed = sbatch_as(tb, USER, attached("true", 6), jobdir)
        # 2. another, whose AdminComment a Jobstats-style epilog will replace
        replaced = sbatch_as(tb, USER, attached("true", 20, "a100", "gpu:a100:1"), jobdir)
        # 2b. a job the bridge estimates from its #VEST directives (no attached estimate), whose
        # AdminComment the epilog will replace too; it also carries a forged record line, which the
        # Lua drops
        forged = "#VEST-RECORD vest1:g=v100,n=1,q=1,f=1,fs=c"
        deadline = time.monotonic() + 120
        while True:     # the first submission may find the worker still tracing: allowed without an estimate
            name = f"d-{uuid.uuid4().hex[:8]}"
            # a script of its own each time: slurmdbd keeps one text per hash of the submitted script
            # (its stored script is read back: held until recorded, as the vsbatch job, see HOLD)
            text = "\n".join(["#!/bin/bash", "#SBATCH --partition=v100", "#SBATCH --gres=gpu:v100:1", HOLD, MLP,
                              "true", f"# {name}", forged, ""])
            directive = sbatch_as(tb, USER, text, jobdir, name)
            line = decision_line(tb, name)
            if "source=directives" in line or time.monotonic() > deadline:
                break
            assert "directives-over-budget" in line, line
            subprocess.run(["scancel", directive], env=tb.env, timeout=30)
            time.sleep(1)
        # 3. a job that dies of CUDA out of memory (its stderr: slurm-<id>.out in its directory)
        oom = sbatch_as(tb, USER, attached(
            "echo 'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB' >&2; exit 1", 4), jobdir)
        # 4. vsbatch (root: exempt from the bridge, so the estimate lives only in the stored script,
        # read back: held until recorded, see HOLD)
        job = Path(jobdir) / "mlp.sh"
        job.write_text("\n".join(["#!/bin/bash", "#SBATCH --time=5", HOLD, MLP, "true", ""]))
        out, err = io.StringIO(), io.StringIO()
        cwd = os.getcwd()
        os.chdir(jobdir)
        try:
            rc = vsbatch.run(["--site-config", str(tb.config_path), "--json", job.name], env=tb.env,
                             stdin=io.StringIO(""), stdout=out, stderr=err)
        finally:
            os.chdir(cwd)
        assert rc == 0, err.getvalue()
        by_vsbatch = str(json.loads(out.getvalue())["job_id"])
        release_when_recorded(tb, [directive, by_vsbatch])
        ids = [placed, replaced, directive, oom, by_vsbatch]
        wait_until(lambda: finished(tb, ids), 120, "the five jobs finished in accounting")

        # the bridge's record is in AdminComment (read back through the real slurmdbd)
        ac = dict(ln.split("|")[:2] for ln in sacct(tb, "--format=JobID,AdminComment",
                                                   f"--jobs={placed},{replaced},{directive}").splitlines()[1:])
        rec = decode_record(ac[placed])
        assert rec is not None and rec.gpu_type == "v100" and rec.need_bytes == 6 * GiB
        assert rec.floor == "default" and rec.request_bytes > rec.need_bytes
        by_directives = decode_record(ac[directive])
        assert by_directives is not None and by_directives.need_bytes > 1 << 20, tb.log_path.read_text()[-3000:]
        # and as the stored script's last line, the user's forged one dropped
        def stored_script() -> str:
            out = subprocess.run(["sacct", "--batch-script", f"--jobs={directive}"], capture_output=True, text=True,
                                 env=tb.env, timeout=30).stdout
            return out if "#!/bin/bash" in out else ""
        # slurmdbd applies the script from the controller's agent queue, ahead of the job's end
        stored = wait_until(stored_script, 30, lambda: f"job {directive}'s script stored ({accounting_log(tb, directive)})")
        assert forged not in stored and stored.rstrip().splitlines()[-1] == f"#VEST-RECORD {ac[directive]}", stored
        # a Jobstats-style epilog (slurm/slurmctldepilog.sh: sacctmgr ... set AdminComment=JS1:...)
        js = jobstats_comment({"nodes": {"a100-node1": {"gpu_used_memory": {"0": 19 * GiB}}}, "total_time": 5})
        for jid in (replaced, directive):
            r = subprocess.run(["sacctmgr", "-i", "update", "job", "where", f"jobid={jid}", "set",
                                f"AdminComment={js}"], capture_output=True, text=True, env=tb.env, timeout=30)
            assert r.returncode == 0, r.stderr
        wait_until(lambda: "vest1:" not in sacct(tb, "--format=JobID,AdminComment", f"--jobs={replaced},{directive}"),
                   30, "the epilog's AdminComment replaced vest's")

        measured = tmp_path / "measured.csv"
        measured.write_text(f"job_id,peak_mib\n{placed},{5.5 * 1024:.0f}\n{replaced},{19 * 1024}\n"
                            f"{oom},16000\n{by_vsbatch},700\n")
        site = tmp_path / "site.toml"
        site.write_text(tb.config_path.read_text())
        rc, text = vest(tb.env, "audit", "--site-config", str(site), "--measured", str(measured),
                        "--starttime", "now-1hours", "--json")
        assert rc == 0
        doc = json.loads(text)
        jobs = {j["job_id"]: j for j in doc["jobs"]}
        assert jobs[placed]["estimate_from"] == "admin_comment" and jobs[placed]["gpu_type"] == "v100"
        # the records survived the epilog: the bridge's line in the stored script
        assert jobs[replaced]["estimate_from"] == "script-record" and jobs[replaced]["gpu_type"] == "a100"
        assert jobs[replaced]["need_mib"] == 20 * 1024 and jobs[replaced]["measured_mib"] == 19 * 1024
        assert jobs[directive]["estimate_from"] == "script-record" and jobs[directive]["gpu_type"] == "v100"
        assert jobs[directive]["need_mib"] * (1 << 20) == by_directives.need_bytes
        assert jobs[directive]["measured_mib"] is None     # no measurement given: left out of the types
        assert jobs[oom]["cuda_oom"] is True and jobs[placed]["cuda_oom"] is False
        assert jobs[by_vsbatch]["estimate_from"] == "script" and jobs[by_vsbatch]["measured_from"] == "csv"
        types = {t["gpu_type"]: t for t in doc["types"]}
        assert types["v100"]["cuda_oom_jobs"] == 1 and types["v100"]["request_below_share"] > 0
        assert types["a100"]["recommendation"]["jobs"] == 1

        # --apply: validated first. The OOM job's 16000 MiB against a ~4.5 GiB request asks for a
        # headroom over policy's 100% limit: refused, nothing written
        before = site.read_text()
        rc, text = vest(tb.env, "audit", "--site-config", str(site), "--measured", str(measured),
                        "--starttime", "now-1hours", "--apply")
        assert rc != 0 and site.read_text() == before and not list(tmp_path.glob("site.toml.bak-*"))
        # measured peaks the policy can take: written, the old file kept
        measured.write_text(f"job_id,peak_mib\n{placed},{5.5 * 1024:.0f}\n{replaced},{19 * 1024}\n"
                            f"{oom},4700\n{by_vsbatch},700\n")
        rc, text = vest(tb.env, "audit", "--site-config", str(site), "--measured", str(measured),
                        "--starttime", "now-1hours", "--apply")
        assert rc == 0 and "wrote" in text
        backups = list(tmp_path.glob("site.toml.bak-*"))
        assert len(backups) == 1 and backups[0].read_text() == before
        from vest_slurm.site.config import load_site_config

        new = load_site_config(str(site))
        # three v100 jobs and one a100 job: too few for a floor (MIN_FLOOR_JOBS), the headroom is fitted
        assert new.gpu("a100").context_mib is None and new.gpu("v100").context_mib is None
        assert new.policy.headroom_percent == max(t["recommendation"]["headroom_percent"]
                                                  for t in json.loads(vest(tb.env, "audit", "--site-config", str(backups[0]),
                                                                           "--measured", str(measured), "--starttime",
                                                                           "now-1hours", "--json")[1])["types"]
                                                  if t["recommendation"])
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)
