"""vsbatch end to end against the real Slurm testbed (site-config/testbed.toml) with real estimates.

Workloads (checked with `vest estimate`): small_cnn at batch 8 needs ~0.6 GiB (fits the 16 GB V100);
a 4 x 16384^2 MLP with Adam needs ~20.5 GiB (not a V100; fits the A100 40 GB and the H100); a
2 x 65536^2 MLP needs ~160 GiB (fits nothing).

testbed.toml exempts root (the tests' user) from refusals; the refusal tests use a copy without
that exemption, and one test checks the exemption itself.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch  # noqa: F401  (vsbatch traces the jobs it places)

from vest_slurm.site import vsbatch
from vest_slurm.slurm.attach import detach
from slurm_wait import bounded, wait_done
from vest_slurm.slurm.cluster import SlurmCLI

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parent.parent
TESTBED = ROOT / "site-config" / "testbed.toml"
SMALL = f"#VEST --model {ROOT / 'tests' / 'data' / 'user_models.py'}:small_cnn --batch-size 8 --input 3x32x32"
_L = '["Linear",16384,16384],["ReLU"]'
WIDE = f"#VEST --model 'mlp:[{_L},{_L},{_L},{_L},[\"Linear\",16384,10]]' --input 16384 --batch-size 64"
HUGE = ("#VEST --model 'mlp:[[\"Linear\",65536,65536],[\"ReLU\"],[\"Linear\",65536,65536]]' "
        "--input 65536 --batch-size 64")


@pytest.fixture
def cli(slurm):
    return SlurmCLI(env=slurm.env, timeout_s=10)


@pytest.fixture
def strict_site(tmp_path):
    """testbed.toml without the root exemption."""
    p = tmp_path / "strict.toml"
    p.write_text(TESTBED.read_text().replace('exempt_users = ["root"]', "exempt_users = []"))
    return str(p)


def script(dirpath: Path, name: str, *header: str, body: str = 'echo "CVD=${CUDA_VISIBLE_DEVICES:-none}"') -> Path:
    p = dirpath / name
    p.write_text("\n".join(("#!/bin/bash",) + header + (body, "")))
    return p


def run_vsbatch(argv, env, cwd: Path, site: str | None = str(TESTBED)):
    """In process (torch is imported once for the session); returns (rc, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        rc = vsbatch.run((["--site-config", site] if site else []) + list(argv), env=env,
                         stdin=io.StringIO(""), stdout=out, stderr=err)
    finally:
        os.chdir(old)
    return rc, out.getvalue(), err.getvalue()


def test_job_that_fits_only_larger_gpus_is_routed_and_completes(slurm, cli, tmp_path):
    job = script(tmp_path, "wide.sh", "#SBATCH --time=5", "#SBATCH --comment=mine", WIDE)
    rc, out, err = run_vsbatch(["--json", job.name], slurm.env, tmp_path)
    assert rc == 0, err
    d = json.loads(out)
    assert d["action"] == "submit" and d["partition"] == "a100" and d["gres"] == "gpu:a100:1"
    assert d["estimates"]["v100"]["required_mib"] > 16220 > 0 and d["estimate_mib"] < 40550
    assert "placing on partition a100" in err and "smallest GPU that fits: a100" in err
    rec = wait_done(cli, d["job_id"])
    assert rec.state == "COMPLETED" and rec.node_list == "a100-node1" and rec.partition == "a100"
    assert rec.tres_per_node == "gres:gpu:a100:1"
    assert rec.name == "wide.sh"                 # the job name sbatch would have given
    assert rec.comment == "mine"                 # the user's comment untouched
    assert "CVD=0" in (tmp_path / f"slurm-{d['job_id']}.out").read_text()
    # the submitted script carries a valid attached estimate for every GPU type
    text = subprocess.run(["scontrol", "write", "batch_script", str(d["job_id"]), "-"], env=slurm.env,
                          capture_output=True, text=True, timeout=10).stdout
    original, attached = detach(text)
    assert original == job.read_text()
    assert {g.gpu_type for g in attached.gpus} == {"v100", "a100", "h100"} and attached.batch_size == 64


def test_job_that_fits_the_smallest_lands_there_via_the_console_script(slurm, cli, tmp_path):
    job = script(tmp_path, "small.sh", "#SBATCH --time=5", SMALL)
    r = subprocess.run(["vsbatch", "--site-config", str(TESTBED), "small.sh"], cwd=tmp_path, env=slurm.env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Submitted batch job "), r.stdout   # sbatch's own output
    job_id = int(r.stdout.split()[-1])
    rec = wait_done(cli, job_id)
    assert rec.state == "COMPLETED" and rec.node_list == "v100-node1" and rec.tres_per_node == "gres:gpu:v100:1"
    assert job.name == rec.name


def test_job_that_fits_nowhere_is_refused_and_nothing_is_queued(slurm, cli, tmp_path, strict_site):
    script(tmp_path, "huge.sh", "#SBATCH --time=5", HUGE)
    before = cli.queue_ids()
    rc, out, err = run_vsbatch(["--json", "huge.sh"], slurm.env, tmp_path, site=strict_site)
    assert rc == 3
    d = json.loads(out)
    assert d["action"] == "refuse" and d["reason"] == "no-fit" and d["partition"] is None and d["job_id"] is None
    assert d["estimate_mib"] > 80743
    kinds = {a["kind"] for a in d["advice"]}
    # nothing on one GPU, nor data parallel, fits its 128 GiB of weights, gradients and Adam state;
    # sharded over enough H100s it does, and the advice says so (per rank, estimated)
    assert {"batch", "amp", "gpus"} <= kinds and not any(a["fits"] for a in d["advice"] if a["kind"] != "sharded")
    sharded = [a for a in d["advice"] if a["kind"] == "sharded" and a["fits"]]
    assert sharded and all(a["num_gpus"] >= 2 and "--parallelism" in a["change"] for a in sharded)
    assert "does not fit on any GPU" in err and "The largest GPU here is h100" in err and "Nothing was queued" in err
    assert cli.queue_ids() == before


def test_exempt_user_is_warned_not_refused(slurm, tmp_path):
    script(tmp_path, "huge.sh", HUGE)
    rc, out, err = run_vsbatch(["--json", "--dry-run", "huge.sh"], slurm.env, tmp_path)   # testbed.toml: root exempt
    d = json.loads(out)
    assert rc == 0 and d["action"] == "submit" and d["partition"] == "h100"
    assert any("exempt" in w for w in d["warnings"])


def test_explicit_gres_that_fits_is_kept(slurm, cli, tmp_path):
    script(tmp_path, "wide.sh", "#SBATCH --time=5", WIDE)
    rc, out, err = run_vsbatch(["--json", "--gres=gpu:h100:1", "wide.sh"], slurm.env, tmp_path)
    assert rc == 0, err
    d = json.loads(out)
    assert d["partition"] == "h100" and d["gres"] == "gpu:h100:1" and not d["changed"]
    assert "--gres=gpu:h100:1" in d["sbatch_argv"]
    rec = wait_done(cli, d["job_id"])
    assert rec.state == "COMPLETED" and rec.node_list == "h100-node1" and rec.tres_per_node == "gres:gpu:h100:1"


def test_other_options_pass_through_unchanged(slurm, cli, tmp_path):
    script(tmp_path, "small.sh", SMALL, body='echo "task=${SLURM_ARRAY_TASK_ID} VEST_E2E=${VEST_E2E}"')
    rc, out, err = run_vsbatch(["--json", "--hold", "--time=3", "small.sh"], slurm.env, tmp_path)
    assert rc == 0, err
    first = json.loads(out)["job_id"]
    argv = ["--json", "--time=00:07:00", "-o", "out-%A_%a.txt", "--array=0-2", "--export=ALL,VEST_E2E=hello",
            f"--dependency=afterok:{first}", "small.sh"]
    rc, out, err = run_vsbatch(argv, slurm.env, tmp_path)
    assert rc == 0, err
    d = json.loads(out)
    for opt in ("--time=00:07:00", "--output=out-%A_%a.txt", "--array=0-2", "--export=ALL,VEST_E2E=hello",
                f"--dependency=afterok:{first}"):
        assert opt in d["sbatch_argv"], d["sbatch_argv"]
    job = d["job_id"]
    rec = cli.job(job)
    assert rec.time_limit == "00:07:00"
    assert rec.array_task_id == "0-2"
    assert rec.dependency.startswith(f"afterok:{first}")
    assert rec.std_out.startswith(str(tmp_path / f"out-{job}_"))
    assert rec.partition == "v100" and rec.tres_per_node == "gres:gpu:v100:1"
    subprocess.run(["scontrol", "release", str(first)], env=slurm.env, check=True, timeout=10)
    wait_done(cli, first)
    for task in range(3):
        deadline = time.monotonic() + 60
        f = tmp_path / f"out-{job}_{task}.txt"
        while not (f.exists() and "VEST_E2E" in f.read_text()):
            assert time.monotonic() < deadline, f"no output from task {task}"
            time.sleep(0.2)
        assert f.read_text().strip() == f"task={task} VEST_E2E=hello"   # --export reached the job


def test_script_without_vest_lines_passes_through(slurm, cli, tmp_path):
    script(tmp_path, "plain.sh", "#SBATCH --time=5", "#SBATCH --partition=a100")
    rc, out, err = run_vsbatch(["plain.sh"], slurm.env, tmp_path)
    assert rc == 0 and "no #VEST line" in err and out.startswith("Submitted batch job")
    rec = wait_done(cli, int(out.split()[-1]))
    assert rec.partition == "a100" and rec.tres_per_node == "" and rec.state == "COMPLETED"


# ---------------------------------------------------------------- bad input: message, exit code, nothing queued

@pytest.mark.parametrize("name, header, code, words", [
    ("missing.sh", None, 2, ["job script missing.sh not found"]),
    ("adir", "dir", 2, ["is a directory"]),
    ("badsbatch.sh", ["#SBATCH --no-such-option=1", SMALL], 2, ["line 2", "unknown sbatch option --no-such-option"]),
    ("badquote.sh", ["#SBATCH --comment='open", SMALL], 2, ["line 2", "unmatched"]),
    ("badvest.sh", ["#VEST --model"], 2, ["#VEST line(s) 2", "--model"]),
    ("badvest2.sh", ["#VESTmodel=x"], 2, ["line 2", "malformed #VEST line"]),
    ("badvest3.sh", [SMALL, "#VEST --batch-size -3"], 2, ["#VEST line(s) 2, 3", "--batch-size"]),
    ("nofile.sh", ["#VEST --model torchvision:no_such_net --batch-size 2"], 2, ["no_such_net"]),
])
def test_bad_scripts(slurm, cli, tmp_path, name, header, code, words):
    if header == "dir":
        (tmp_path / name).mkdir()
    elif header is not None:
        script(tmp_path, name, *header)
    before = cli.queue_ids()
    rc, out, err = run_vsbatch([name], slurm.env, tmp_path)
    assert rc == code, err
    for w in words:
        assert w in err, err
    assert "Traceback" not in err and "internal error" not in err
    assert cli.queue_ids() == before


def test_invalid_site_config(slurm, cli, tmp_path):
    script(tmp_path, "small.sh", SMALL)
    bad = tmp_path / "bad.toml"
    bad.write_text(TESTBED.read_text().replace("headroom_percent = 5", "headroom_pct = 5"))
    before = cli.queue_ids()
    rc, out, err = run_vsbatch(["small.sh"], slurm.env, tmp_path, site=str(bad))
    assert rc == 2 and "unknown key policy.headroom_pct" in err and "headroom_percent" in err
    assert cli.queue_ids() == before


def _conf_with_port(slurm, tmp_path, port: int) -> dict:
    text = slurm.conf_path.read_text()
    lines = [f"SlurmctldPort={port}" if ln.startswith("SlurmctldPort=") else ln for ln in text.splitlines()]
    conf = tmp_path / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    for f in ("gres.conf", "cgroup.conf"):
        (tmp_path / f).write_text((slurm.etc / f).read_text())
    return dict(slurm.env, SLURM_CONF=str(conf))


# A hang, not speed: vsbatch (its estimate included, which a cold trace cache makes take tens of
# seconds on a loaded machine) is given this long before the test calls it hung. How long vsbatch
# takes is scripts/bench_vsbatch.py's measure.
VSBATCH_HANG_S = 600.0


def test_controller_down_is_a_clear_error(slurm, cli, tmp_path):
    """Nothing listens where slurm.conf puts the controller: exit 4 with the fix, nothing queued, no hang."""
    script(tmp_path, "small.sh", SMALL)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]          # closed again: nothing listens there
    env = _conf_with_port(slurm, tmp_path, port)
    before = cli.queue_ids()
    rc, out, err = bounded(lambda: run_vsbatch(["small.sh"], env, tmp_path), VSBATCH_HANG_S, "vsbatch")
    assert rc == 4 and "controller" in err and "slurmctld" in err, err
    assert "nothing answers" in err and "the controller is down" in err, err
    assert cli.queue_ids() == before


def test_controller_too_slow_is_bounded_by_the_timeout(slurm, cli, tmp_path):
    """A controller that accepts and never answers: vsbatch gives up at VEST_SLURM_TIMEOUT_S (the
    message names that timeout: only the timeout path writes it), exit 4, nothing queued."""
    script(tmp_path, "small.sh", SMALL)
    with socket.socket() as mute:          # accepts connections (the kernel does), never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)
        env = _conf_with_port(slurm, tmp_path, mute.getsockname()[1])
        env["VEST_SLURM_TIMEOUT_S"] = "1.5"
        before = cli.queue_ids()
        rc, out, err = bounded(lambda: run_vsbatch(["small.sh"], env, tmp_path), VSBATCH_HANG_S, "vsbatch")
    assert rc == 4 and "did not answer within 1.5 s" in err and "too slow" in err, err
    assert cli.queue_ids() == before


def test_dry_run_prints_the_command_and_queues_nothing(slurm, cli, tmp_path):
    script(tmp_path, "wide.sh", "#SBATCH --time=5", WIDE)
    before = cli.queue_ids()
    rc, out, err = run_vsbatch(["--dry-run", "-t", "9", "wide.sh", "arg one"], slurm.env, tmp_path)
    assert rc == 0
    assert out.strip() == "sbatch --time=9 --partition=a100 --gres=gpu:a100:1 wide.sh 'arg one'"
    assert cli.queue_ids() == before


def test_resolve_script_path_as_sbatch(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "job.sh").write_text("#!/bin/bash\n")
    (tmp_path / "cwd").mkdir()
    cwd, path = str(tmp_path / "cwd"), f"/nonexistent:{tmp_path / 'bin'}"
    assert vsbatch.resolve_script_path("job.sh", cwd, path) == str(tmp_path / "bin" / "job.sh")
    (tmp_path / "cwd" / "job.sh").write_text("#!/bin/bash\n")
    assert vsbatch.resolve_script_path("job.sh", cwd, path) == str(tmp_path / "cwd" / "job.sh")   # cwd first
    assert vsbatch.resolve_script_path("./job.sh", cwd, path) == "./job.sh"
    assert vsbatch.resolve_script_path("nope.sh", cwd, path) == "nope.sh"
    assert vsbatch.resolve_script_path("job.sh", cwd, "") == "job.sh"


def test_two_node_sharded_job_runs_to_completed(slurm, cli, tmp_path):
    """A job over two nodes of one GPU type (the testbed's h100 partition has two): vsbatch places
    the sharded workload (fsdp2 over 8 GPUs, 4 per node) and it runs to COMPLETED on both nodes."""
    job = script(tmp_path, "two-node.sh", "#SBATCH --time=5", "#SBATCH --partition=h100", "#SBATCH --nodes=2",
                 "#SBATCH --gres=gpu:h100:4", "#SBATCH --ntasks-per-node=1",
                 SMALL + " --parallelism fsdp2 --num-gpus 8 --gpus-per-node 4",
                 body='srun hostname; echo "NODES=$SLURM_JOB_NUM_NODES"')
    rc, out, err = run_vsbatch(["--json", job.name], slurm.env, tmp_path)
    assert rc == 0, err
    d = json.loads(out)
    assert d["action"] == "submit" and d["partition"] == "h100", d
    rec = wait_done(cli, d["job_id"])
    assert rec.state == "COMPLETED", rec
    assert set(rec.node_list.replace("h100-node[1-2]", "h100-node1,h100-node2").split(",")) == {"h100-node1", "h100-node2"}
    assert "NODES=2" in (tmp_path / f"slurm-{d['job_id']}.out").read_text()


_BLOCK = '["Linear",32768,32768]'
# 16 x 32768^2 fp32 Linear layers with Adam under fsdp2 at batch 4: ~66 GiB per rank over 8 GPUs with the
# testbed's headroom (vest check), more than an H100's 80 GB over 4; a100 and v100 partitions have one node.
SHARDED_BIG = (f"#VEST --model 'mlp:[{','.join([_BLOCK] * 16)}]' --input 32768 --batch-size 4 --optimizer adam "
               "--parallelism fsdp2")


def test_num_gpus_auto_chooses_the_smallest_count_and_nodes_and_runs(slurm, cli, tmp_path):
    """#VEST --num-gpus auto: vsbatch chooses the fewest GPUs at which the sharded job fits per rank over
    the nodes Slurm has (h100: two nodes of 4), rewrites --nodes and --gres to match the script's torchrun
    line (which follows Slurm), and the job runs to COMPLETED on both nodes. At half the count it does
    not fit; the attached estimate is for the chosen count."""
    from vest_slurm.estimate.workload import parse_vest_line
    from vest_slurm.site.advice import Prober
    from vest_slurm.site.config import load_site_config

    job = script(tmp_path, "auto.sh", "#SBATCH --time=5", "#SBATCH --gres=gpu:1", "#SBATCH --ntasks-per-node=1",
                 SHARDED_BIG + " --num-gpus auto",
                 body=': torchrun --nnodes=$SLURM_NNODES --nproc_per_node=gpu train.py\n'
                      'srun hostname; echo "NODES=$SLURM_JOB_NUM_NODES GPUS=$SLURM_GPUS_ON_NODE"')
    rc, out, err = run_vsbatch(["--json", job.name], slurm.env, tmp_path)
    assert rc == 0, err
    d = json.loads(out)
    assert d["action"] == "submit" and d["partition"] == "h100" and d["gres"] == "gpu:h100:4", d
    assert d["workload"]["num_gpus"] == 8 and "--nodes=2" in d["sbatch_argv"], d["sbatch_argv"]
    assert "--gres=gpu:h100:4" in d["sbatch_argv"] and "--ntasks-per-node=1" in d["sbatch_argv"]
    assert "--num-gpus auto: 8 GPU(s), 2 node(s) x 4" in err and "global batch is 8 x 4" in err
    site = load_site_config(str(TESTBED))
    prober = Prober.for_site(site)
    spec = parse_vest_line(SHARDED_BIG[len("#VEST "):])
    need4 = prober.needed(spec.with_(num_gpus=4), "h100")
    assert need4 is not None and need4 > prober.capacity("h100")
    rec = wait_done(cli, d["job_id"])
    assert rec.state == "COMPLETED", rec
    assert set(rec.node_list.replace("h100-node[1-2]", "h100-node1,h100-node2").split(",")) == {"h100-node1", "h100-node2"}
    text = (tmp_path / f"slurm-{d['job_id']}.out").read_text()
    assert "NODES=2 GPUS=4" in text, text


@pytest.mark.parametrize("line, code, words", [
    (": torchrun --nproc_per_node=$NGPU train.py", 2, ["line 6: torchrun --nproc_per_node '$NGPU'",
                                                        "--nproc_per_node=$SLURM_GPUS_ON_NODE"]),
    (": torchrun --nnodes=1 --nproc_per_node=4 train.py", 3, ["--num-gpus auto", "Nothing was queued"]),
])
def test_num_gpus_auto_refuses_what_the_torchrun_line_does_not_allow(slurm, tmp_path, line, code, words):
    """A torchrun count vsbatch cannot read is refused with its line and what to write; a fixed one node
    of 4 where the job needs 8 GPUs is refused as not fitting (the script's count is never overridden)."""
    job = script(tmp_path, "auto.sh", "#SBATCH --time=5", "#SBATCH --gres=gpu:1", "#SBATCH --ntasks-per-node=1",
                 SHARDED_BIG + " --num-gpus auto", body=line)
    rc, out, err = run_vsbatch(["--json", job.name], slurm.env, tmp_path)
    assert rc == code, err
    for w in words:
        assert w in err, err
    assert json.loads(out)["job_id"] is None


def test_num_gpus_auto_is_for_sharded_jobs(slurm, tmp_path):
    job = script(tmp_path, "auto.sh", "#SBATCH --time=5", SMALL + " --num-gpus auto")
    rc, out, err = run_vsbatch([job.name], slurm.env, tmp_path)
    assert rc == 2 and "applies to sharded jobs" in err and "--parallelism fsdp2" in err, err


def test_nodes_and_gpus_per_node_are_placed_over_the_partitions_nodes(slurm, tmp_path, strict_site):
    """The per-node count and nodes come from #VEST --gpus-per-node (or #SBATCH --gres per node and
    --nodes) and are checked against the nodes Slurm reports: a two-node job goes to the only partition
    with two nodes (h100), asked for as --nodes=2 --gres=gpu:h100:4; three nodes are refused (naming each
    partition's shape); a --nodes that disagrees with #VEST's count is refused with the fix."""
    job = script(tmp_path, "shape.sh", "#SBATCH --time=5", SMALL + " --parallelism fsdp2 --num-gpus 8 --gpus-per-node 4")
    rc, out, err = run_vsbatch(["--dry-run", "--json", job.name], slurm.env, tmp_path, strict_site)
    assert rc == 0, err
    d = json.loads(out)
    assert d["partition"] == "h100" and "--nodes=2" in d["sbatch_argv"] and "--gres=gpu:h100:4" in d["sbatch_argv"], d
    job = script(tmp_path, "three.sh", "#SBATCH --time=5", "#SBATCH --nodes=3", "#SBATCH --gres=gpu:4",
                 SMALL + " --parallelism fsdp2")
    rc, out, err = run_vsbatch(["--dry-run", "--json", job.name], slurm.env, tmp_path, strict_site)
    assert rc == 3, err
    d = json.loads(out)
    assert d["reason"] == "too-many-gpus" and "12 in all on 3 nodes" in d["message"]
    assert "h100: 4 per node, 2 nodes" in d["message"], d["message"]
    job = script(tmp_path, "bad.sh", "#SBATCH --time=5", "#SBATCH --nodes=3",
                 SMALL + " --parallelism fsdp2 --num-gpus 8 --gpus-per-node 4")
    rc, out, err = run_vsbatch([job.name], slurm.env, tmp_path, strict_site)
    assert rc == 2 and "#SBATCH --nodes=3 but #VEST --num-gpus 8 with 4 per node needs 2 node(s)" in err, err


def test_num_gpus_auto_keeps_one_task_per_gpu(slurm, cli, tmp_path):
    """A job without torchrun that runs one task per GPU (--ntasks=4 over --gres=gpu:4): with
    --num-gpus auto choosing 8 GPUs over two nodes, it still runs one task per GPU, 8 in all
    (--ntasks-per-node=4 --ntasks=8), to COMPLETED."""
    job = script(tmp_path, "tasks.sh", "#SBATCH --time=5", "#SBATCH --gres=gpu:4", "#SBATCH --ntasks=4",
                 SHARDED_BIG + " --num-gpus auto", body="srun bash -c 'echo TASK=$SLURM_PROCID'")
    rc, out, err = run_vsbatch(["--json", job.name], slurm.env, tmp_path)
    assert rc == 0, err
    d = json.loads(out)
    argv = d["sbatch_argv"]
    assert d["workload"]["num_gpus"] == 8 and "--nodes=2" in argv and "--gres=gpu:h100:4" in argv, argv
    assert "--ntasks=8" in argv and "--ntasks-per-node=4" in argv, argv
    rec = wait_done(cli, d["job_id"])
    assert rec.state == "COMPLETED", rec
    text = (tmp_path / f"slurm-{d['job_id']}.out").read_text()
    assert sorted(line for line in text.split() if line.startswith("TASK=")) == sorted(f"TASK={i}" for i in range(8)), text
