"""The cluster interface against a real Slurm (the session ``slurm`` fixture)."""

from __future__ import annotations

import os
import shutil

import pytest

from slurm_wait import bounded, wait_for_state
from vest_slurm.slurm.cluster import SlurmCLI, get_backend, reconcile, run_slurm
from vest_slurm.errors import SlurmError
from vest_slurm.slurm.testbed import SlurmTestbed
from vest_slurm.testbed import _pid_alive

pytestmark = pytest.mark.slurm


def test_cluster_info_shows_three_gpu_partitions(slurm):
    from vest_slurm.slurm.testbed import NODES

    info = SlurmCLI(env=slurm.env).cluster_info()
    by_name = {p.name: p for p in info.partitions}
    assert set(by_name) == {"v100", "a100", "h100"}
    for gtype in ("v100", "a100", "h100"):
        p = by_name[gtype]
        assert p.gpu_counts == {gtype: 4}, p.gpu_counts   # per node
        assert p.nodes == tuple(n.name for n in NODES if n.partition == gtype)   # h100: two nodes
        assert p.state == "UP"
    assert info.default_partition.name == "v100"
    assert info.gpu_types == {"v100", "a100", "h100"}
    assert reconcile(info, {"v100", "a100", "h100"}, {"v100", "a100", "h100"}) == []
    assert all(n.state == "idle" or n.state == "mixed" for n in info.nodes)


def test_gpu_job_runs_to_completed_on_a100_and_sees_its_gpu(slurm, tmp_path):
    cli = SlurmCLI(env=slurm.env)
    out = tmp_path / "out-%j.txt"
    script = "#!/bin/bash\necho CVD=$CUDA_VISIBLE_DEVICES JOBGPUS=$SLURM_JOB_GPUS\n"
    job_id, stdout, stderr, rc = cli.submit(
        ["--gres=gpu:a100:1", "-p", "a100", "-o", str(out), "-J", "vest test job"], input=script)
    assert rc == 0, stderr
    assert job_id is not None and f"Submitted batch job {job_id}" in stdout
    assert job_id in cli.queue_ids()
    rec = wait_for_state(cli, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"})
    assert rec.state == "COMPLETED", dict(rec)
    assert rec.node_list == "a100-node1"
    assert rec.partition == "a100"
    assert rec.name == "vest test job"
    assert rec.gpu_counts == {"a100": 1}
    text = (tmp_path / f"out-{job_id}.txt").read_text()
    assert "CVD=0" in text, text


def test_sbatch_refusal_is_returned_not_raised(slurm):
    cli = SlurmCLI(env=slurm.env)
    before = cli.queue_ids()
    job_id, stdout, stderr, rc = cli.submit(["-p", "nosuch", "--wrap", "true"])
    assert (job_id, rc) == (None, 1)
    assert "invalid partition" in stderr.lower()
    assert cli.queue_ids() == before


def test_job_that_does_not_exist_is_none(slurm):
    assert SlurmCLI(env=slurm.env).job(987654) is None


def test_backend_is_cli_when_pyslurm_is_absent_or_mismatched(slurm):
    backend, why = get_backend(env=slurm.env)
    assert backend.name == "cli"
    assert "command-line tools" in why

    class FakePyslurm:  # a pyslurm built for another release
        __version__ = "25.11.0"

    backend, why = get_backend(env=slurm.env, pyslurm_module=FakePyslurm)
    assert backend.name == "cli" and "25.11.0" in why and "22.05" in why


def test_repeated_calls_answer_the_same(slurm):
    """Five calls in a row answer as the first (the partitions and node names; node states may move
    with other tests' jobs). How fast they are is scripts/bench_vsbatch.py's measure (its "cluster"
    phase: sinfo --json + scontrol show partition)."""
    cli = SlurmCLI(env=slurm.env)
    first = cli.cluster_info()
    assert {p.name for p in first.partitions} == {"v100", "a100", "h100"}
    for _ in range(5):
        again = cli.cluster_info()
        assert again.partitions == first.partitions
        assert [n.name for n in again.nodes] == [n.name for n in first.nodes]


# A hang, not speed: a call that the tool bounds by timeout_s is given that plus this much (a loaded
# machine's scheduling noise is far below it) before the test calls it hung.
HANG_MARGIN_S = 60.0


def test_dead_controller_gives_slurm_error_not_a_hang(slurm, tmp_path):
    # A second testbed, stopped: its slurm.conf names a port where nothing listens any more.
    dead = SlurmTestbed(tmp_path / "dead")
    dead.write_config()
    cli = SlurmCLI(env=dead.env, timeout_s=1.5)
    for call in (cli.cluster_info, cli.queue_ids, lambda: cli.submit(["--wrap", "true"])):
        with pytest.raises(SlurmError) as e:
            bounded(call, cli.timeout_s + HANG_MARGIN_S, f"{call} against a dead controller")
        assert "controller" in str(e.value)
        assert "nothing answers" in e.value.what
        assert e.value.fix and "slurmctld" in e.value.fix


def test_missing_binary_is_a_slurm_error(slurm):
    env = dict(slurm.env, PATH="/nonexistent")
    with pytest.raises(SlurmError) as e:
        run_slurm(["sinfo-does-not-exist"], env=env, timeout_s=1)
    assert "not installed" in e.value.what


def _running(argv) -> bool:
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:-1] == [a.encode() for a in argv]:
                    return True
        except OSError:   # not a process, or gone meanwhile
            continue
    return False


def test_timeout_is_a_slurm_error_and_the_command_is_killed(slurm):
    """A command past timeout_s is killed and reported with the timeout; it would sleep an hour."""
    argv = [shutil.which("sleep"), "3599.25"]
    with pytest.raises(SlurmError) as e:
        bounded(lambda: run_slurm(argv, env=slurm.env, timeout_s=0.5), 0.5 + HANG_MARGIN_S, "run_slurm(sleep)")
    assert "did not answer within 0.5 s" in e.value.what
    assert not _running(argv)   # killed and reaped before run_slurm raised


def test_testbed_script_start_status_stop(slurm, tmp_path):
    """scripts/slurm-testbed.sh: a second, detached testbed beside the session one."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "slurm-testbed.sh"
    d = tmp_path / "tb"
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    run = lambda *a: subprocess.run([str(script), *a], capture_output=True, text=True, env=env,
                                    timeout=60)
    started = run("start", str(d))
    try:
        assert started.returncode == 0, started.stderr
        assert started.stdout.strip() == f"export SLURM_CONF={d / 'etc' / 'slurm.conf'}"
        status = run("status", str(d))
        assert status.returncode == 0 and "a100-node1" in status.stdout and "idle" in status.stdout
        conf_env = dict(env, SLURM_CONF=str(d / "etc" / "slurm.conf"))
        info = SlurmCLI(env=conf_env).cluster_info()
        assert {p.name for p in info.partitions} == {"v100", "a100", "h100"}
        pid = int((d / "testbed.pid").read_text())
    finally:
        stopped = run("stop", str(d))
    assert stopped.returncode == 0, stopped.stderr
    assert not (d / "testbed.pid").exists()
    assert not _pid_alive(pid)   # gone, or a zombie waiting for init to reap it
    assert run("status", str(d)).returncode == 3


def test_testbed_with_job_submit_lua(slurm, tmp_path):
    """JobSubmitPlugins=lua with the given file beside slurm.conf: its refusal reaches the user."""
    lua = tmp_path / "refuse_bad.lua"
    lua.write_text(
        'function slurm_job_submit(job_desc, part_list, submit_uid)\n'
        '  if job_desc.name == "bad" then\n'
        '    slurm.log_user("vest test: refused")\n'
        '    return slurm.ERROR\n'
        '  end\n'
        '  return slurm.SUCCESS\n'
        'end\n'
        'function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)\n'
        '  return slurm.SUCCESS\n'
        'end\n'
        'return slurm.SUCCESS\n')
    with SlurmTestbed(tmp_path / "tb", job_submit_lua=str(lua)) as tb:
        assert "JobSubmitPlugins=lua" in tb.conf_path.read_text()
        cli = SlurmCLI(env=tb.env)
        job_id, _, stderr, rc = cli.submit(["-J", "bad", "--wrap", "true"])
        assert (job_id, rc) == (None, 1) and "vest test: refused" in stderr
        job_id, _, stderr, rc = cli.submit(["-J", "good", "--wrap", "true"])
        assert rc == 0 and job_id is not None, stderr


def test_pyslurm_backend_is_chosen_when_versions_match(slurm):
    """With a stand-in for pyslurm 22.5 (the API of pyslurm >= 23.2), get_backend picks it and
    cluster_info reads its objects; submission stays with sbatch."""
    from types import SimpleNamespace

    nodes = {
        "a100-node1": SimpleNamespace(partitions=["a100"], configured_gres={"gpu:a100": 4},
                                      allocated_gres={"gpu:a100": {"count": 1, "indexes": "0"}},
                                      state="MIXED", total_cpus=4, real_memory=4000, reason=None),
    }
    parts = {"a100": SimpleNamespace(is_default=True, state="UP", max_time=1440, total_cpus=4)}

    class FakePyslurm:
        __version__ = "22.5.0"
        Nodes = SimpleNamespace(load=lambda: nodes)
        Partitions = SimpleNamespace(load=lambda: parts)

    backend, why = get_backend(env=slurm.env, pyslurm_module=FakePyslurm)
    assert backend.name == "pyslurm" and "22.5.0" in why
    info = backend.cluster_info()
    (p,) = info.partitions
    assert (p.name, p.nodes, p.gpu_counts, p.default, p.max_time_minutes) == (
        "a100", ("a100-node1",), {"a100": 4}, True, 1440)
    assert info.nodes[0].gpus_used == {"a100": 1} and info.nodes[0].state == "mixed"
    job_id, _, _, rc = backend.submit(["-p", "a100", "--wrap", "true"])
    assert rc == 0 and job_id is not None
