"""Parsers of Slurm's output, over output recorded from the real 22.05 testbed (tests/data/slurm,
captured with vest_slurm.slurm.testbed) and over hostile values."""

from __future__ import annotations

from pathlib import Path

import pytest

from vest_slurm.slurm.cluster import (
    JOB_KEY_ORDER,
    ClusterInfo,
    JobRecord,
    PartitionInfo,
    build_cluster_info,
    controller_address,
    gpu_counts,
    parse_gres,
    parse_sbatch_output,
    parse_scontrol_jobs,
    parse_scontrol_line,
    parse_scontrol_nodes,
    parse_scontrol_partitions,
    parse_sinfo_json,
    parse_sinfo_version,
    parse_squeue_json,
    parse_time_minutes,
    reconcile,
)
from vest_slurm.errors import SlurmError

DATA = Path(__file__).parent / "data" / "slurm"


def read(name: str) -> str:
    return (DATA / name).read_text()


# --- sbatch, version ---------------------------------------------------------------------------

def test_sbatch_output():
    assert parse_sbatch_output(read("sbatch-ok.txt")) == 1
    assert parse_sbatch_output(read("sbatch-parsable.txt")) == 6
    assert parse_sbatch_output("123;cluster1\n") == 123
    assert parse_sbatch_output(read("sbatch-bad-partition.out")) is None
    assert parse_sbatch_output("") is None
    assert parse_sbatch_output("sbatch: error: Submitted batch job 5 was a lie") is None


def test_recorded_refusals_have_no_job_id_and_exit_1():
    for name in ("sbatch-bad-partition", "sbatch-bad-gres"):
        assert read(f"{name}.rc").strip() == "1"
        assert read(f"{name}.out") == ""
        assert read(f"{name}.err").startswith("sbatch: error:")


def test_sinfo_version():
    assert parse_sinfo_version(read("sinfo-version.txt")) == "22.05.8"
    assert parse_sinfo_version("slurm 23.02.1\n") == "23.02.1"
    assert parse_sinfo_version("garbage") == ""


# --- gres ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("gpu:a100:4", {"a100": 4}),
    ("gpu:a100:4(S:0-1)", {"a100": 4}),
    ("gpu:4", {"": 4}),
    ("gpu", {"": 1}),
    ("gpu:a100:1(IDX:0)", {"a100": 1}),
    ("gpu:a100:0(IDX:N/A)", {"a100": 0}),
    ("gpu:a100:2(IDX:0,2),gpu:v100:1(IDX:3)", {"a100": 2, "v100": 1}),
    ("gpu:nvidia_a100-sxm4-80gb:8(S:0-1),mps:400", {"nvidia_a100-sxm4-80gb": 8}),
    ("gres:gpu:v100:1", {"v100": 1}),          # TresPerNode on 22.05
    ("gres/gpu:v100:1", {"v100": 1}),          # TresPerNode on newer releases
    ("gpu:a100:2,gpu:a100:2", {"a100": 4}),
    ("mps:100,shard:8", {}),
    ("(null)", {}), ("N/A", {}), ("", {}), (None, {}),
    ("gpu:a100:lots", {}),                      # unreadable count: skipped, not a crash
    (":::,,,()", {}),
])
def test_gpu_counts(text, expected):
    assert gpu_counts(text) == expected


def test_parse_gres_keeps_detail_and_suffixes():
    (item,) = parse_gres("gpu:h100:4(IDX:0-3)")
    assert (item.name, item.type, item.count, item.detail) == ("gpu", "h100", 4, "IDX:0-3")
    (mps,) = parse_gres("mps:1K")
    assert mps.count == 1024


# --- sinfo --json ------------------------------------------------------------------------------

def test_sinfo_json_idle():
    nodes = {n.name: n for n in parse_sinfo_json(read("sinfo-idle.json"))}
    assert set(nodes) == {"v100-node1", "a100-node1", "h100-node1"}
    a = nodes["a100-node1"]
    assert a.partitions == ("a100",)
    assert a.gres == "gpu:a100:4" and a.gpu_counts == {"a100": 4}
    assert a.gpus_used == {"a100": 0}
    assert a.state == "idle" and a.cpus == 4 and a.real_memory_mb == 4000


def test_sinfo_json_busy_and_drained():
    nodes = {n.name: n for n in parse_sinfo_json(read("sinfo-busy.json"))}
    assert nodes["h100-node1"].state == "mixed"
    assert nodes["h100-node1"].gpus_used == {"h100": 4}
    assert nodes["a100-node1"].gres_used == "gpu:a100:1(IDX:1)"
    v = nodes["v100-node1"]
    assert v.state == "idle" and v.state_flags == ("DRAIN",)
    assert v.reason == "maint window Partition=x, y"


def test_sinfo_json_controller_down_is_an_error():
    # Recorded: sinfo exits 0 after ~9 s of retries, with an "errors" list in the JSON.
    with pytest.raises(SlurmError) as e:
        parse_sinfo_json(read("sinfo-controller-down.json"))
    assert "controller" in e.value.what and "slurmctld" in e.value.fix
    with pytest.raises(SlurmError):
        parse_squeue_json(read("squeue-controller-down.json"))


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", "{", "\x00\xff"])
def test_sinfo_json_garbage_is_an_error(text):
    with pytest.raises(SlurmError):
        parse_sinfo_json(text)


def test_sinfo_json_newer_layout_state_list():
    text = '{"nodes": [{"name": "n1", "state": ["IDLE", "DRAIN"], "partitions": ["p"], "gres": "gpu:l40s:2"}], "errors": []}'
    (n,) = parse_sinfo_json(text)
    assert (n.state, n.state_flags, n.gpu_counts) == ("idle", ("DRAIN",), {"l40s": 2})


# --- scontrol show -o ---------------------------------------------------------------------------

def test_scontrol_partitions():
    parts = parse_scontrol_partitions(read("scontrol-partition.txt"))
    assert [p["PartitionName"] for p in parts] == ["v100", "a100", "h100"]
    assert [p["Default"] for p in parts] == ["YES", "NO", "NO"]
    assert parts[0]["Nodes"] == "v100-node1"
    assert parts[0]["TRES"] == "cpu=4,mem=4000M,node=1,billing=4"
    assert parts[0]["JobDefaults"] == "(null)"
    assert parts[1]["MaxTime"] == "UNLIMITED" and parts[1]["State"] == "UP"


def test_scontrol_nodes_values_with_spaces():
    nodes = {n["NodeName"]: n for n in parse_scontrol_nodes(read("scontrol-node-busy.txt"))}
    v = nodes["v100-node1"]
    assert v["OS"] == "Linux 6.18.44-fc-v782 #1 SMP PREEMPT_DYNAMIC @0"
    assert v["Reason"] == "maint window Partition=x, y [root@2026-11-29T21:23:03]"
    assert v["State"] == "IDLE+DRAIN"
    assert v["Partitions"] == "v100"        # not "x, y ..." from inside the reason
    assert v["AllocTRES"] == ""
    assert nodes["h100-node1"]["AllocTRES"] == "cpu=2,mem=1000M"
    idle = parse_scontrol_nodes(read("scontrol-node-idle.txt"))
    assert {n["Gres"] for n in idle} == {"gpu:v100:4", "gpu:a100:4", "gpu:h100:4"}


def test_scontrol_job_completed():
    (job,) = parse_scontrol_jobs(read("scontrol-job-completed.txt"))
    rec = JobRecord(job)
    assert rec.job_id == 1 and rec.state == "COMPLETED" and rec.partition == "a100"
    assert rec.node_list == "a100-node1" and rec.tres_per_node == "gres:gpu:a100:1"
    assert rec.gpu_counts == {"a100": 1}
    assert rec.std_out == "/tmp/jobs/out-1.txt" and rec["AllocNode:Sid"] == "localhost:2537"
    assert rec.dependency == "" and rec["Dependency"] == "(null)"
    assert rec["ReqB:S:C:T"] == "0:0:*:*" and rec["CPUs/Task"] == "1"


def test_scontrol_job_dependency_and_time():
    (job,) = parse_scontrol_jobs(read("scontrol-job-dependency.txt"))
    rec = JobRecord(job)
    assert rec.dependency == "afterok:2(unfulfilled)" and rec.reason == "Dependency"
    assert rec.time_limit == "01:00:00" and parse_time_minutes(rec.time_limit) == 60


def test_scontrol_job_array_with_hostile_name_and_comment():
    # Recorded from: sbatch -J 'name with spaces Partition=evil UserId=x'
    #   --comment 'a b=c, d TresPerNode=gres:gpu:h100:9' --array=1-3%2 -p h100 --gres=gpu:h100:2
    #   -o '/tmp/jobs/o %A_%a.txt'
    jobs = [JobRecord(j) for j in parse_scontrol_jobs(read("scontrol-job-array-hostile.txt"))]
    assert len(jobs) == 3
    for rec in jobs:
        assert rec.name == "name with spaces Partition=evil UserId=x"
        assert rec.partition == "h100"
        assert rec["UserId"] == "root(0)"
        assert rec.comment == "a b=c, d TresPerNode=gres:gpu:h100:9"
        assert rec.tres_per_node == "gres:gpu:h100:2"
        assert rec.array_job_id == "3"
        assert rec.std_out.startswith("/tmp/jobs/o 3_")
    assert sorted(r.array_task_id for r in jobs) == ["1", "2", "3"]
    assert {r.state for r in jobs} == {"PENDING", "RUNNING"}


def test_scontrol_without_key_order_is_naive_but_total():
    (first, *_) = [parse_scontrol_line(ln) for ln in read("scontrol-job-array-hostile.txt").splitlines()]
    assert first["JobName"] == "name with spaces"     # the naive reading is fooled ...
    assert first["Partition"] == "evil"                # ... which is why key orders exist


@pytest.mark.parametrize("name", [
    "StdOut=/evil NodeList=h100-node9",
    "Partition=a100 TresPerNode=gres:gpu:a100:8 JobState=COMPLETED",
    "x" * 5000,
    "quote\"'`$(rm -rf /);|&",
    "tab\there",
    "=",
    " = JobId=7 ",
    "Ünïcödé名前",
])
def test_hostile_job_names_do_not_change_other_fields(name):
    template = read("scontrol-job-completed.txt").strip()
    line = template.replace("JobName=j.sh", f"JobName={name}")
    (job,) = parse_scontrol_jobs(line)
    assert job["JobId"] == "1"
    assert job["JobName"] == name.rstrip(" ")
    assert job["Partition"] == "a100" and job["JobState"] == "COMPLETED"
    assert job["NodeList"] == "a100-node1" and job["StdOut"] == "/tmp/jobs/out-1.txt"
    assert job["TresPerNode"] == "gres:gpu:a100:1"


def test_hostile_late_comment_does_not_change_tres():
    template = read("scontrol-job-completed.txt").strip()
    line = template.replace("StdErr=", "Comment=run TresPerNode=gres:gpu:h100:8 Power= x StdErr=")
    (job,) = parse_scontrol_jobs(line)
    assert job["Comment"] == "run TresPerNode=gres:gpu:h100:8 Power= x"
    assert job["TresPerNode"] == "gres:gpu:a100:1" and job["Power"] == ""


def test_unknown_keys_from_a_newer_slurm_are_kept():
    line = "JobId=5 JobName=a b NewKey=1 JobState=RUNNING Partition=p Shiny=x y"
    (job,) = parse_scontrol_jobs(line)
    assert job["JobName"] == "a b NewKey=1"     # inside a free-text value: text
    assert job["JobState"] == "RUNNING" and job["Partition"] == "p"
    assert job["Shiny"] == "x y"


def test_scontrol_empty_and_blank_lines():
    assert parse_scontrol_jobs("") == []
    assert parse_scontrol_jobs("\n\n  \n") == []
    assert parse_scontrol_line("no keys here") == {}
    assert JOB_KEY_ORDER[0] == ("JobId",)


# --- squeue --json -----------------------------------------------------------------------------

def test_squeue_json():
    entries = parse_squeue_json(read("squeue.json"))
    by_id = {e.job_id: e for e in entries}
    assert by_id[1].state == "COMPLETED" and by_id[1].partition == "a100"
    assert by_id[2].state == "RUNNING" and by_id[2].nodes == "a100-node1"
    assert by_id[4].state == "PENDING"
    tasks = sorted((e.array_job_id, e.array_task_id) for e in entries if e.array_job_id)
    assert tasks == [(3, 1), (3, 2), (3, 3)]
    assert by_id[7].name == "name with spaces Partition=evil UserId=x"
    # The submission sbatch refused with "Requested node configuration is not available" still
    # has a job record (FAILED) on 22.05: callers counting queued jobs must look at the state.
    assert by_id[5].state == "FAILED" and by_id[5].tres_per_node == "gres:gpu:a100:9"


# --- times, cluster info, reconcile ------------------------------------------------------------

@pytest.mark.parametrize("text, minutes", [
    ("UNLIMITED", None), ("INFINITE", None), ("NONE", None), ("30", 30), ("1:00:00", 60),
    ("00:05:00", 5), ("2-12", 2 * 1440 + 720), ("1-00:00:00", 1440), ("10:30", 11),
])
def test_time_minutes(text, minutes):
    assert parse_time_minutes(text) == minutes


def recorded_cluster() -> ClusterInfo:
    return build_cluster_info(parse_sinfo_json(read("sinfo-idle.json")),
                              parse_scontrol_partitions(read("scontrol-partition.txt")))


def test_build_cluster_info():
    info = recorded_cluster()
    assert [p.name for p in info.partitions] == ["v100", "a100", "h100"]
    assert info.partition("a100") == PartitionInfo(
        name="a100", nodes=("a100-node1",), gpu_counts={"a100": 4}, default=False, state="UP",
        max_time="UNLIMITED", max_time_minutes=None, default_time="NONE", total_cpus=4)
    assert info.default_partition.name == "v100"
    assert info.partition("nosuch") is None


def test_partition_without_nodes_and_mixed_gpu_nodes():
    nodes = parse_sinfo_json('{"errors": [], "nodes": ['
                             '{"name": "n1", "partitions": ["mix"], "gres": "gpu:a100:4"},'
                             '{"name": "n2", "partitions": ["mix"], "gres": "gpu:a100:8,gpu:t4:1"}]}')
    info = build_cluster_info(nodes, [{"PartitionName": "mix", "MaxTime": "2-00:00:00"},
                                      {"PartitionName": "empty", "Nodes": "(null)"}])
    assert info.partition("mix").gpu_counts == {"a100": 8, "t4": 1}
    assert info.partition("mix").max_time_minutes == 2880
    assert info.partition("empty").nodes == () and info.partition("empty").gpu_counts == {}


def test_reconcile():
    info = recorded_cluster()
    assert reconcile(info, {"v100", "a100", "h100"}, {"v100", "a100", "h100"}) == []
    warnings = reconcile(info, {"v100", "a100", "l40s"}, {"v100", "a100", "gone"})
    assert any("'h100'" in w and "no GPU type entry" in w for w in warnings)
    assert any("'l40s'" in w and "matches no node" in w for w in warnings)
    assert any("'gone'" in w and "does not exist" in w for w in warnings)
    assert any("Slurm partition 'h100'" in w for w in warnings)


def test_controller_address(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=ctl1(10.0.0.5)\nSlurmctldHost=ctl2\n"
                    "SlurmctldPort=6817-6820  # range\n")
    assert controller_address({"SLURM_CONF": str(conf)}) == ("10.0.0.5", 6817)
    conf.write_text("ControlMachine=head\n")
    assert controller_address({"SLURM_CONF": str(conf)}) == ("head", 6817)
    assert controller_address({"SLURM_CONF": str(tmp_path / "missing")}) is None
