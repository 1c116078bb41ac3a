"""`vest audit` on the command line: read accounting (sacct, or files of its output), join, report,
and with --apply write the recommendation into the site config.

In: options; sacct's output (run through slurm.cluster.run_slurm, or read from --sacct-json /
--sacct-parsable files); --measured CSV. Out: the report on stdout (text or --json); exit 0, or
the tool's error codes (errors.py).
"""

from __future__ import annotations

import json
import time

from ..errors import SlurmError, VestError

SACCT_TIMEOUT_S = 120.0
# sacct's codes of the states a job ends in (sacct --helpstate): completed, failed, timeout,
# out-of-memory (host), cancelled, node fail, deadline, preempted
FINISHED_STATES = ("CD", "F", "TO", "OOM", "CA", "NF", "DL", "PR")


def add_audit_parser(sub) -> None:
    p = sub.add_parser("audit", help="finished jobs: estimates against measured peaks; the floor and headroom they recommend",
                       description="Join finished jobs' vest estimates with their measured peak GPU memory (sacct "
                                   "gres/gpumem, Jobstats AdminComment, or --measured CSV), per GPU type; recommend "
                                   "context_mib and headroom (a conformal bound); --apply writes them to the site config.")
    p.add_argument("--site-config", metavar="PATH", help="site configuration (else $VEST_SITE_CONFIG, else /etc/vest/site.toml)")
    p.add_argument("--starttime", default="now-30days", help="sacct --starttime (default now-30days)")
    p.add_argument("--endtime", default=None, help="sacct --endtime")
    p.add_argument("--jobs", default=None, metavar="ID,...", help="only these job ids (sacct --jobs)")
    p.add_argument("--sacct-json", metavar="FILE", help="read `sacct --json` output from FILE instead of running sacct")
    p.add_argument("--sacct-parsable", metavar="FILE",
                   help="read `sacct --parsable2 --format=...` output from FILE instead of running sacct")
    p.add_argument("--measured", metavar="FILE", help="CSV job_id,peak_mib[,gpu_type] of measured peaks (any monitor)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--apply", action="store_true",
                   help="write the recommended context_mib per GPU type and headroom_percent into the site config "
                        "(validated first; the old file is kept as PATH.bak-<time>)")
    p.set_defaults(func=cmd_audit)


def sacct_argv(ns) -> list[str]:
    from ..slurm.accounting import SACCT_FIELDS

    # With --state, sacct selects the jobs that ended in those states within the window (by end
    # time); without it, by eligible time, which slurmdbd can leave Unknown for a job that ran
    # within a second of its submission (seen on 22.05): such jobs would be missed.
    argv = ["sacct", "--allusers", "--parsable2", "--format=" + ",".join(SACCT_FIELDS), f"--starttime={ns.starttime}",
            "--state=" + ",".join(FINISHED_STATES)]
    argv.append(f"--endtime={ns.endtime or 'now'}")
    if ns.jobs:
        argv.append(f"--jobs={ns.jobs}")
    return argv


def _scripts(job_ids: list[str]) -> dict[str, str]:
    """Each job's stored batch script (AccountingStoreFlags=job_script; sacct --batch-script, 22.05+)."""
    from ..slurm.accounting import parse_batch_script
    from ..slurm.cluster import run_slurm

    out = {}
    for jid in job_ids:
        r = run_slurm(["sacct", "--batch-script", f"--jobs={jid}"], timeout_s=SACCT_TIMEOUT_S)
        if r.returncode == 0 and (script := parse_batch_script(r.stdout)):
            out[jid] = script
    return out


def read_accounting(ns):
    from dataclasses import replace

    from ..slurm.accounting import parse_sacct_json, parse_sacct_parsable
    from ..slurm.cluster import run_slurm

    if ns.sacct_json:
        with open(ns.sacct_json) as f:
            return parse_sacct_json(f.read())
    if ns.sacct_parsable:
        with open(ns.sacct_parsable) as f:
            return parse_sacct_parsable(f.read())
    r = run_slurm(sacct_argv(ns), timeout_s=SACCT_TIMEOUT_S)
    if r.returncode != 0:
        raise SlurmError(f"sacct failed: {(r.stderr or r.stdout).strip()[:300]}",
                         "vest audit needs Slurm accounting (slurmdbd); ask the site admins, or give --sacct-json FILE")
    jobs = parse_sacct_parsable(r.stdout)
    need = [j.job_id for j in jobs if j.gpu_type and "vest1:" not in j.admin_comment]
    scripts = _scripts(need) if need else {}
    return [replace(j, script=scripts.get(j.job_id, "")) for j in jobs]


def cmd_audit(ns) -> int:
    from ..slurm.accounting import parse_measured_csv
    from .audit import apply, audit_types, join, report_json, report_text
    from .targets import site_for_estimate

    site = site_for_estimate(ns.site_config)
    if ns.apply and site is None:
        raise VestError("vest audit --apply: no site config to write", "give --site-config PATH")
    measured = {}
    if ns.measured:
        with open(ns.measured) as f:
            measured = parse_measured_csv(f.read())
    jobs = join(read_accounting(ns), measured, site)
    types = audit_types(jobs, site)
    if ns.json:
        doc = report_json(jobs, types)
    else:
        print(report_text(jobs, types))
    if ns.apply:
        backup, _ = apply(site.path, types, time.strftime("%Y%m%dT%H%M%S"))
        msg = f"wrote {site.path} (the old one kept as {backup})"
        if ns.json:
            doc["applied"] = {"path": site.path, "backup": backup}
        else:
            print(msg)
    if ns.json:
        print(json.dumps(doc, indent=2))
    return 0
