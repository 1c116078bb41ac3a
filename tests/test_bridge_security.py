"""The controller's side never runs code a job names (issue 21), against the real slurmctld.

Each hostile job script names code that leaves a marker file behind if any of it runs: a model
factory in a file, a ``module:function`` factory with ``--model-args``, a ``module:Class``
optimizer (a module in the decision server's own working directory, which is on its import path),
an ``hf:`` directory holding a config and modeling code. Submitted with plain sbatch by a plain
user to the bridge cluster with ``allow_vest_directives`` on: no marker, the log says why, and the
job gets the site's unknown-job policy. The directive worker itself is checked for its user, its
writes and its sockets; ``vest bridge test``, ``vest check`` and ``vsbatch`` run as root on a
user's hostile script run none of it either.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from test_bridge_slurm import USER, ctld_log, queued, sbatch
from vest_slurm.bridge.directives import DirectiveEstimator, DirectiveFailed
from vest_slurm.site.config import load_site_config

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[1]
EVIL_MODULE = "vest_evil_optimizer_mod"


def _code(marker: Path) -> str:
    return (f"open({str(marker)!r}, 'a').write('ran ' + __name__ + '\\n')\n"
            "import torch\n"
            "def build(**kw):\n    return torch.nn.Linear(4, 4)\n"
            "class Evil(torch.optim.SGD):\n    pass\n")


@pytest.fixture(scope="module")
def hostile():
    """World-readable files a user could write: a factory, an hf-style directory; the marker's
    directory is world-writable, so code running as any user could leave it."""
    d = Path(tempfile.mkdtemp(prefix="vest-hostile-"))
    os.chmod(d, 0o777)
    marker = d / "MARKER"
    (d / "evil.py").write_text(_code(marker))
    hf = d / "llama-3-8b"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "modeling_evil.Evil"}}))
    (hf / "modeling_evil.py").write_text(_code(marker))
    for p in [d, hf, *d.rglob("*")]:
        os.chmod(p, 0o777 if p.is_dir() else 0o644)
    yield d, marker
    shutil.rmtree(d, ignore_errors=True)


def hostile_lines(d: Path, marker: Path) -> dict[str, str]:
    return {
        "file-factory": f"--model {d}/evil.py:build --batch-size 1 --input 4",
        "module-function": f"--model subprocess:getoutput --model-args '{{\"cmd\": \"touch {marker}\"}}' --batch-size 1 --input 4",
        "module-optimizer": f"--model torchvision:resnet18 --batch-size 1 --optimizer {EVIL_MODULE}:Evil",
        "hf-directory": f"--model hf:{d}/llama-3-8b --batch-size 1 --input seq8",
    }


REASONS = {"file-factory": "directives-refused-model-code", "module-function": "directives-refused-model-code",
           "module-optimizer": "directives-refused-bad-value", "hf-directory": "directives-refused-model-path"}


def job(line: str) -> str:
    return f"#!/bin/bash\n#SBATCH --partition=v100\n#SBATCH --gres=gpu:v100:1\n#SBATCH --output=/dev/null\n#VEST {line}\ntrue\n"


@pytest.fixture(scope="module")
def dtb(bridge_slurm, hostile):
    """The bridge cluster with the directive worker on, unknown jobs refused (so that a job that got
    the unknown-job policy is visible), and a module the server could import in its working dir."""
    d, marker = hostile
    (bridge_slurm.workdir / f"{EVIL_MODULE}.py").write_text(_code(marker))
    bridge_slurm.stop_server()
    bridge_slurm.directives = True
    bridge_slurm.start_server()
    bridge_slurm.configure(unknown_jobs="refuse")
    deadline = time.monotonic() + 180
    while "action=worker-start" not in bridge_slurm.log_path.read_text() and time.monotonic() < deadline:
        assert "action=worker-unavailable" not in bridge_slurm.log_path.read_text(), bridge_slurm.log_path.read_text()
        time.sleep(0.2)
    try:
        yield bridge_slurm
    finally:
        (bridge_slurm.workdir / f"{EVIL_MODULE}.py").unlink()
        bridge_slurm.stop_server()
        bridge_slurm.directives = False
        bridge_slurm.start_server()
        bridge_slurm.configure()


@pytest.mark.parametrize("case", list(REASONS))
def test_hostile_directive_runs_nothing_and_gets_the_unknown_job_policy(dtb, hostile, case):
    d, marker = hostile
    p = sbatch(dtb, job(hostile_lines(d, marker)[case]))
    assert not marker.exists(), marker.read_text()
    assert p.returncode == 1 and queued(dtb, p.name) == []          # unknown_jobs = refuse
    assert "no usable memory estimate" in p.err and "never runs code a job names" in p.err
    line = next(ln for ln in dtb.log_path.read_text().splitlines() if f"job={p.name} " in ln)
    assert f"reason={REASONS[case]}" in line and "unknown_jobs=refuse" in line and "detail=" in line
    assert f"job={p.name} " in ctld_log(dtb)


def test_allowed_directive_is_traced_by_the_worker_and_placed(dtb):
    """The same path with a model named from a library: the worker traces it (the first
    submission may find it still tracing: over budget, refused here; the answer is kept)."""
    line = """--model 'mlp:[["Linear",4096,4096],["ReLU"],["Linear",4096,10]]' --batch-size 64 --input 4096"""
    deadline = time.monotonic() + 120
    while True:
        p = sbatch(dtb, job(line))
        if p.returncode == 0 or time.monotonic() > deadline:
            break
        assert "directives-over-budget" in dtb.log_path.read_text()
        time.sleep(1)
    assert p.returncode == 0, p.err
    assert len(queued(dtb, p.name)) == 1
    assert "source=directives" in next(ln for ln in dtb.log_path.read_text().splitlines() if f"job={p.name} " in ln)


# ---------------------------------------------------------------- the worker, confined

def _site(**bridge):
    site = load_site_config(str(REPO / "site-config" / "testbed.toml"))
    return replace(site, bridge=replace(site.bridge, **{"allow_vest_directives": True, "timeout_s": 8.0, **bridge}))


@pytest.fixture(scope="module")
def worker_user(slurm_prereqs):
    """An unprivileged user of its own (root makes it: the worker drops privileges to it), so the worker's writes could not hide among nobody's."""
    name = "vest-dirworker"
    made = False
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True)
        made = True
    yield name
    if made:
        subprocess.run(["userdel", name], check=False)


def test_worker_runs_as_the_configured_user_without_writes_or_sockets(worker_user):
    open_dir = Path(tempfile.mkdtemp(prefix="vest-open-", dir="/var/tmp"))
    os.chmod(open_dir, 0o777)                 # writable by anyone: only the confinement stops it
    host_tmp = Path(tempfile.gettempdir()) / f"vest-worker-probe-{os.getpid()}"
    lines = []
    est = DirectiveEstimator(lambda: _site(directive_user=worker_user), lines.append)
    try:
        probe = est.probe([str(open_dir / "x"), str(host_tmp), "/var/tmp/vest-probe", "/dev/shm/vest-probe",
                           str(REPO / "vest-probe"), "/tmp/inside-ok"])
    finally:
        est.close()
    pw = pwd.getpwnam(worker_user)
    assert (probe["uid"], probe["euid"], probe["gid"], probe["groups"]) == (pw.pw_uid, pw.pw_uid, pw.pw_gid, [])
    writes = probe["writes"]
    assert writes.pop("/tmp/inside-ok") == "written"          # its private tmpfs, over the host's /tmp
    writes.pop(str(host_tmp))                                 # written there too, if at all: not on the host
    assert all(v.startswith("refused") for v in writes.values()), writes
    assert not (open_dir / "x").exists() and not host_tmp.exists() and not (REPO / "vest-probe").exists()
    assert not Path("/tmp/inside-ok").exists()
    assert all(v.startswith("refused") for v in probe["sockets"].values()), probe["sockets"]
    assert probe["exec"] == "refused"
    assert any(f"user={worker_user}" in ln and "network=none" in ln for ln in lines), lines
    shutil.rmtree(open_dir)


def test_worker_over_its_cpu_limit_is_stopped_and_replaced(worker_user):
    est = DirectiveEstimator(lambda: _site(directive_user=worker_user, directive_cpu_s=1.0, timeout_s=9.0))
    from vest_slurm.estimate.allowlist import parse_untrusted

    heavy = parse_untrusted(["--model", "hf:llama-3-8b", "--batch-size", "1", "--input", "seq2048"])
    small = parse_untrusted(["--model", 'mlp:[["Linear",8,4]]', "--batch-size", "2", "--input", "8"])
    try:
        fut_deadline = time.monotonic() + 300
        result = None
        while result is None and time.monotonic() < fut_deadline:
            try:
                result = est(tuple(heavy.to_argv()), 1, {"h100": "h100-80gb"})
            except DirectiveFailed as e:
                result = e
        assert isinstance(result, DirectiveFailed) and result.reason == "directives-limit", result
        with pytest.raises(DirectiveFailed):             # kept as failed: costs nothing the second time
            est(tuple(heavy.to_argv()), 1, {"h100": "h100-80gb"})
        ok = None
        while ok is None and time.monotonic() < fut_deadline:
            ok = est(tuple(small.to_argv()), 1, {"h100": "h100-80gb"})
        assert ok and ok["h100-80gb"][1] > 0                 # a new worker answers
    finally:
        est.close()


# ---------------------------------------------------------------- admin commands, as root

@pytest.fixture
def alice_job(hostile, bridge_users):
    """A job directory of the test user's: a hostile #VEST job and a training script with the marker."""
    d, marker = hostile
    home = Path(tempfile.mkdtemp(prefix="vest-alice-"))
    (home / "train.py").write_text(_code(marker) + "raise SystemExit(0)\n")
    (home / "dyn.sh").write_text("#!/bin/bash\n#SBATCH --gres=gpu:v100:1\npython train.py\n")
    for case, line in hostile_lines(d, marker).items():
        (home / f"{case}.sh").write_text(job(line))
    pw = pwd.getpwnam(USER)
    for p in [home, *home.iterdir()]:
        os.chown(p, pw.pw_uid, pw.pw_gid)
    yield home
    shutil.rmtree(home, ignore_errors=True)


def _vest(*args, cwd):
    env = dict(os.environ, PYTHONPATH=str(REPO), VEST_SITE_CONFIG=str(REPO / "site-config" / "testbed.toml"))
    return subprocess.run([sys.executable, "-m", "vest_slurm.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


@pytest.mark.parametrize("case", list(REASONS))
def test_bridge_test_as_root_on_a_hostile_script(alice_job, hostile, case):
    d, marker = hostile
    r = _vest("bridge", "test", str(alice_job / f"{case}.sh"), "--user", USER, cwd=alice_job)
    assert not marker.exists()
    assert r.returncode == 0, r.stderr
    assert f"({REASONS[case]})" in r.stdout and "never runs code a job names" in r.stdout


@pytest.mark.parametrize("case", list(REASONS))
def test_vest_check_as_root_reads_a_users_script_as_the_bridge_does(alice_job, hostile, case):
    d, marker = hostile
    r = _vest("check", str(alice_job / f"{case}.sh"), "--no-search", cwd=alice_job)
    assert not marker.exists()
    assert r.returncode == 2 and f"belongs to {USER}" in r.stderr and "as root" in r.stderr, r.stderr
    assert f"runuser -u {USER}" in r.stderr


def test_root_does_not_run_a_users_training_script(alice_job, hostile):
    d, marker = hostile
    for args in (("check", str(alice_job / "dyn.sh"), "--no-search"), ("estimate", "--", "python", "train.py")):
        r = _vest(*args, cwd=alice_job)
        assert not marker.exists()
        assert r.returncode == 2 and f"belongs to {USER}" in r.stderr, r.stderr
    env = dict(os.environ, PYTHONPATH=str(REPO), VEST_SITE_CONFIG=str(REPO / "site-config" / "testbed.toml"))
    r = subprocess.run([sys.executable, "-m", "vest_slurm.vsbatch", "--dry-run", "dyn.sh"], capture_output=True,
                       text=True, cwd=alice_job, env=env, timeout=300)
    assert not marker.exists()
    assert r.returncode == 2 and f"belongs to {USER}" in r.stderr, r.stderr


def test_root_does_not_run_a_users_python_environment(bridge_users, tmp_path):
    """A script of root's own, but the command names a user's venv (directly, or activated by the job
    script): its Python is that user's code; nothing of it runs, not even the cuDNN probe."""
    marker = tmp_path / "ran"
    venv = Path(tempfile.mkdtemp(prefix="vest-alice-venv-"))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
        site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
        (site / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
        pw = pwd.getpwnam(USER)
        for p in [venv, *venv.rglob("*")]:
            os.lchown(p, pw.pw_uid, pw.pw_gid)
        work = tmp_path / "job"
        work.mkdir()
        (work / "train.py").write_text("import torch\n")
        (work / "job.sh").write_text(f"#!/bin/bash\n#SBATCH --gres=gpu:v100:1\nsource {venv}/bin/activate\npython train.py\n")
        for args in (("estimate", "--", str(venv / "bin" / "python"), "train.py"),
                     ("check", str(work / "job.sh"), "--no-search")):
            r = _vest(*args, cwd=work)
            assert r.returncode == 2 and f"{venv} belongs to {USER}" in r.stderr, r.stderr
        assert not marker.exists()
    finally:
        shutil.rmtree(venv, ignore_errors=True)
