"""The accounting parsers (slurm/accounting.py) on recorded output (tests/data/accounting/README.md
says where each file comes from), and `vest audit`'s join, OOM flagging, conformal headroom and
--apply (site/audit.py). No Slurm here: test_audit_slurm.py runs the same on the testbed."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from vest_slurm.site.audit import (AuditJob, apply, audit_types, conformal_quantile, is_cuda_oom, join, recommend,
                                   report_json, report_text)
from vest_slurm.errors import SiteConfigError
from vest_slurm.site.config import parse_site_config
from vest_slurm.slurm.accounting import (AccountingError, AcctJob, Record, decode_record, encode_record,
                                         jobstats_peak_bytes, jobstats_summary, parse_batch_script,
                                         parse_measured_csv, parse_sacct_json, parse_sacct_parsable, parse_size,
                                         script_record, tres_usage)

DATA = Path(__file__).parent / "data" / "accounting"
MiB, GiB = 1 << 20, 1 << 30


def read(name: str) -> str:
    return (DATA / name).read_text()


# ---------------------------------------------------------------- sizes and TRES strings

@pytest.mark.parametrize("text,bytes_", [("0", 0), ("123", 123), ("960K", 960 << 10), ("2046M", 2046 * MiB),
                                         ("13.50G", round(13.5 * GiB)), ("1T", 1 << 40), ("79.62G", round(79.62 * GiB))])
def test_sizes_as_sacct_prints_them(text, bytes_):
    # convert_num_unit: 1024-based, "%.2f%c" when not whole, no suffix = bytes (UNIT_NONE)
    assert parse_size(text) == bytes_


def test_bad_size_is_an_accounting_error():
    with pytest.raises(AccountingError):
        parse_size("12 GB")


def test_tres_usage_splits_name_value_pairs():
    u = tres_usage("cpu=00:00:02,energy=0,fs/disk=10484,gres/gpumem=13.50G,gres/gpuutil=97,mem=5.20G")
    assert u["gres/gpumem"] == "13.50G" and u["cpu"] == "00:00:02" and u["gres/gpuutil"] == "97"


# ---------------------------------------------------------------- sacct

def test_sacct_2205_parsable_from_the_testbed_has_no_gpumem():
    jobs = parse_sacct_parsable(read("sacct-22.05-parsable2.txt"))
    assert jobs and all(j.gpumem_bytes is None for j in jobs)
    gpu = [j for j in jobs if j.gpus]
    assert gpu and all(j.gpu_type in ("v100", "a100", "h100") for j in gpu)
    assert {j.state for j in jobs} >= {"COMPLETED", "FAILED"}
    assert any(decode_record(j.admin_comment) for j in jobs)          # the bridge's record, read back


def test_sacct_2302_parsable_folds_steps_and_takes_their_largest_gpumem():
    jobs = {j.job_id: j for j in parse_sacct_parsable(read("sacct-23.02-parsable2-gpumem.txt"))}
    assert set(jobs) == {"4101", "4102", "4103"}
    a = jobs["4101"]
    assert a.gpu_type == "a100" and a.gpus == 1 and a.gpumem_bytes == round(13.5 * GiB)   # step 0, not step 1's 2046M
    assert a.state == "COMPLETED" and a.work_dir == "/home/alice/run1"
    b = jobs["4102"]
    assert b.gpu_type == "h100" and b.gpus == 2 and b.state == "FAILED" and b.exit_code == "1:0"
    assert jobs["4103"].gpus == 0 and jobs["4103"].gpumem_bytes is None


def test_sacct_parsable_needs_its_header():
    with pytest.raises(AccountingError, match="header"):
        parse_sacct_parsable("4101|train|COMPLETED\n")


def test_sacct_json_2302_and_2405_give_the_same_fields():
    old = {j.job_id: j for j in parse_sacct_json(read("sacct-23.02-json-v0.0.39.json"))}
    assert old["4101"].gpumem_bytes == 14495514624 and old["4101"].gpu_type == "a100"
    assert decode_record(old["4101"].admin_comment).need_bytes == 14000 * MiB
    assert old["4102"].state == "FAILED" and old["4102"].exit_code == "1:0" and old["4102"].gpus == 2
    assert old["4102"].std_err == "/home/bob/exp/%x-%j.err"
    new = {j.job_id: j for j in parse_sacct_json(read("sacct-24.05-json-v0.0.41.json"))}
    j = new["5201"]
    assert j.state == "COMPLETED" and j.exit_code == "0:0" and j.gpu_type == "l40s"
    assert j.gpumem_bytes == 11811160064 and j.std_err == "/scratch/dan/5201.err"   # the larger of two steps


def test_sacct_json_that_is_not_sacct_is_refused():
    for text in ("not json", '{"meta": {}}'):
        with pytest.raises(AccountingError):
            parse_sacct_json(text)


def test_batch_script_as_2205_prints_it():
    assert parse_batch_script("Batch Script for 7\n" + "-" * 80 + "\n#!/bin/bash\ntrue\n\n") == "#!/bin/bash\ntrue\n\n"
    assert parse_batch_script("Batch Script for 7\n" + "-" * 80 + "\nNONE\n\n") == ""
    assert parse_batch_script("#!/bin/sh\nx\n") == "#!/bin/sh\nx\n"


# ---------------------------------------------------------------- Jobstats and the CSV

def test_jobstats_admincomment_of_its_docs():
    doc = jobstats_summary(read("jobstats-admincomment.txt"))
    assert doc["gpus"] == 1 and doc["nodes"]["della-k1g1"]["gpu_used_memory"]["1"] == 83314868224
    assert jobstats_peak_bytes(read("jobstats-admincomment.txt")) == 83314868224
    # the largest over nodes and GPUs
    assert jobstats_peak_bytes(read("jobstats-admincomment-2nodes.txt")) == 30000000000
    for none in ("", "JS1:Short", "JS1:None", "vest1:g=a100,n=1,q=2,f=3,fs=d"):
        assert jobstats_peak_bytes(none) is None


def test_damaged_jobstats_comment_is_an_error_not_a_number():
    with pytest.raises(AccountingError, match="Jobstats"):
        jobstats_summary("JS1:bm90IGd6aXA=")
    # Slurm 22.05's sacctmgr lowercases the value it sets (the testbed shows it): undecodable
    with pytest.raises(AccountingError):
        jobstats_summary(read("jobstats-admincomment.txt").strip().lower().replace("js1:", "JS1:"))


def test_measured_csv():
    m = parse_measured_csv("job_id,peak_mib,gpu_type\n4101,13824,a100\n4102,81500\n# a comment\n")
    assert m == {"4101": (13824 * MiB, "a100"), "4102": (81500 * MiB, "")}
    with pytest.raises(AccountingError, match="job_id,peak_mib"):
        parse_measured_csv("4101,lots\n")


def test_record_round_trip_and_damage():
    r = Record("a100", 14000 * MiB, 15656 * MiB, 1334 * MiB, "default")
    text = encode_record(r)
    assert text == "vest1:g=a100,n=14000,q=15656,f=1334,fs=d" and decode_record("x " + text + " y") == r
    assert decode_record("vest1:g=a100,n=lots") is None and decode_record("JS1:abc") is None


def test_script_record_is_the_last_record_line():
    a = encode_record(Record("a100", 14000 * MiB, 15656 * MiB, 1334 * MiB, "default"))
    b = encode_record(Record("h100", 9000 * MiB, 9900 * MiB, 1400 * MiB, "calibrated"))
    text = f"#!/bin/bash\n#SBATCH --gres=gpu:1\n# {a}\npython train.py\n#VEST-RECORD {a}\n#VEST-RECORD {b}\n"
    assert script_record(text) == decode_record(b)
    # a token that is not on a record line (a user's comment) is not vest's record
    assert script_record(f"#!/bin/bash\n# {a}\ntrue\n") is None and script_record("") is None
    assert script_record("#!/bin/bash\n#VEST-RECORD vest1:g=a100,n=lots\n") is None


# ---------------------------------------------------------------- the audit

SITE = """
[gpu.a100]
profile = "a100-40gb"
[gpu.h100]
profile = "h100-80gb"
context_mib = 1400
[partition.p]
gpu_types = ["a100", "h100"]
gpus_per_node = 4
[policy]
headroom_percent = 10
"""


def test_cuda_oom_from_stderr_and_what_cannot_be_told(tmp_path):
    err = tmp_path / "slurm-9.out"
    err.write_text("epoch 1\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    failed = AcctJob("9", state="FAILED", work_dir=str(tmp_path))
    assert is_cuda_oom(failed) == (True, "")
    (tmp_path / "slurm-10.out").write_text("ValueError: bad input\n")
    assert is_cuda_oom(AcctJob("10", state="FAILED", work_dir=str(tmp_path))) == (False, "")
    oom, note = is_cuda_oom(AcctJob("11", state="FAILED", work_dir=str(tmp_path)))
    assert not oom and "not readable" in note
    # sacct's own stderr pattern, expanded
    (tmp_path / "run-12.err").write_text("RuntimeError: CUDA error: out of memory\n")
    assert is_cuda_oom(AcctJob("12", name="run", state="FAILED", std_err=str(tmp_path / "%x-%j.err")))[0]
    assert is_cuda_oom(AcctJob("13", state="COMPLETED", work_dir=str(tmp_path))) == (False, "")


def test_join_prefers_csv_then_gpumem_then_jobstats():
    site = parse_site_config(SITE)
    rec = encode_record(Record("a100", 10 * GiB, 11 * GiB, 1334 * MiB, "default"))
    acct = [AcctJob("1", state="COMPLETED", gpu_type="a100", gpus=1, gpumem_bytes=9 * GiB, admin_comment=rec),
            AcctJob("2", state="COMPLETED", gpu_type="a100", gpus=1, gpumem_bytes=9 * GiB, admin_comment=rec),
            AcctJob("3", state="COMPLETED", gpu_type="a100", gpus=1,
                    admin_comment=read("jobstats-admincomment-2nodes.txt").strip()),
            AcctJob("4", state="COMPLETED", gpu_type="a100", gpus=1)]
    jobs = {j.job_id: j for j in join(acct, {"2": (8 * GiB, "")}, site)}
    assert (jobs["1"].measured_bytes, jobs["1"].measured_from) == (9 * GiB, "sacct-gpumem")
    assert (jobs["2"].measured_bytes, jobs["2"].measured_from) == (8 * GiB, "csv")
    assert (jobs["3"].measured_from, jobs["3"].record) == ("jobstats", None)   # Jobstats replaced the record
    assert jobs["4"].record is None and jobs["4"].measured_bytes is None


def test_join_takes_the_script_record_only_on_the_type_it_names():
    """Jobstats replaced AdminComment; the record line of the stored script stands in for it, except
    where it names another type (slurmdbd shares one text among identical scripts)."""
    site = parse_site_config(SITE)
    line = "#VEST-RECORD " + encode_record(Record("a100", 10 * GiB, 11 * GiB, 1334 * MiB, "default"))
    js = read("jobstats-admincomment-2nodes.txt").strip()
    script = f"#!/bin/bash\n#VEST --model torchvision:resnet50 --batch-size 64\ntrue\n{line}\n"
    acct = [AcctJob("1", state="COMPLETED", gpu_type="a100", gpus=1, admin_comment=js, script=script),
            AcctJob("2", state="COMPLETED", gpu_type="h100", gpus=1, admin_comment=js, script=script)]
    jobs = {j.job_id: j for j in join(acct, {}, site)}
    assert jobs["1"].record_from == "script-record" and jobs["1"].record.need_bytes == 10 * GiB
    assert jobs["1"].measured_from == "jobstats"
    assert jobs["2"].record is None and jobs["2"].record_from == ""


def test_conformal_quantile_level_and_small_samples():
    errs = [i / 100 for i in range(199)]            # n = 199: k = ceil(200 * 0.99) = 198
    q, ok = conformal_quantile(errs, 0.01)
    assert ok and q == errs[197]
    q, ok = conformal_quantile([0.1, -0.2, 0.05], 0.01)   # k = 4 > n: the largest, no 1% guarantee
    assert not ok and q == 0.1


def test_recommendation_recovers_a_floor_and_bounds_the_past_jobs():
    """Jobs of a stack whose floor is 900 MiB, estimates made with a default of 1334 and their
    rest of the estimate off by -4..+6%: the floor comes back from the small jobs, and with the
    headroom no past job is requested below its peak."""
    rest = [50 + 40 * i for i in range(120)]
    err = [((i * 37) % 11 - 4) / 100 for i in range(120)]
    measured = [900 + r * (1 + e) for r, e in zip(rest, err)]
    r = recommend(rest, measured, min_floor_mib=216)
    assert abs(r.context_mib - 900) <= 20 and r.guaranteed and r.n == 120
    assert 0 <= r.headroom_percent <= 6.1 and r.would_below <= math.floor(0.01 * 120)
    small = recommend(rest[:10], measured[:10], 216)
    assert not small.guaranteed and small.bound == pytest.approx(1 / 11)


def test_audit_types_counts_oom_as_below_and_smaller_types():
    site = parse_site_config(SITE)
    def job(i, t, need, measured, oom=False):
        return AuditJob(str(i), t, Record(t, need, round(need * 1.1), 1334 * MiB, "default"), "admin_comment",
                        measured, "csv", oom)
    jobs = [job(1, "h100", 10 * GiB, 9 * GiB), job(2, "h100", 10 * GiB, 12 * GiB),
            job(3, "h100", 30 * GiB, 70 * GiB, oom=True), job(4, "a100", 30 * GiB, 29 * GiB)]
    types = {a.gpu_type: a for a in audit_types(jobs, site)}
    h = types["h100"]
    assert h.jobs == 3 and h.oom_jobs == 1 and h.below_share == pytest.approx(2 / 3)
    assert h.smaller_type_jobs == 2            # the two 9-12 GiB jobs would have fit the A100 40GB
    assert h.floor == "calibrated" and h.floor_mib == 1400 and types["a100"].floor == "default"
    text = report_text(jobs, list(types.values()))
    assert "died of CUDA out of memory" in text and "needs at least 99" in text
    doc = report_json(jobs, list(types.values()))
    assert doc["types"][1]["recommendation"]["jobs"] == 3


def test_apply_validates_writes_and_keeps_a_backup(tmp_path):
    site_path = tmp_path / "site.toml"
    site_path.write_text("# our site\n" + SITE)
    site = parse_site_config(SITE)
    jobs = [AuditJob(str(i), "a100", Record("a100", (2000 + 100 * i) * MiB, 0, 1334 * MiB, "default"), "script",
                     (1600 + 100 * i) * MiB, "csv") for i in range(20)]
    types = audit_types(jobs, site)
    backup, new = apply(str(site_path), types, "20260101T000000")
    assert Path(backup).read_text() == "# our site\n" + SITE
    cfg = parse_site_config(site_path.read_text())
    assert cfg.gpu("a100").context_mib == types[0].recommendation.context_mib < 1334
    assert cfg.gpu("h100").context_mib == 1400 and "# our site" in site_path.read_text()
    assert cfg.policy.headroom_percent == types[0].recommendation.headroom_percent
    # a recommendation the config refuses (headroom over 100%) writes nothing
    bad = [AuditJob("1", "a100", Record("a100", 1000 * MiB, 0, 500 * MiB, "default"), "script", 1000 * MiB, "csv"),
           AuditJob("2", "a100", Record("a100", 5500 * MiB, 0, 500 * MiB, "default"), "script", 30000 * MiB, "csv")]
    before = site_path.read_text()
    with pytest.raises(SiteConfigError):
        apply(str(site_path), audit_types(bad, site), "20260101T000001")
    assert site_path.read_text() == before and not (tmp_path / "site.toml.bak-20260101T000001").exists()
