"""Shared fixtures. ``slurm``: one real Slurm on loopback for the whole session (vest_slurm.slurm.testbed).

The Slurm tests skip only when the Debian packages are missing (slurmctld slurmd slurm-client
slurm-wlm-basic-plugins munge); CI installs them, so there they run.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

# The accuracy benchmark's ground-truth mapping lives with the benchmark (scripts/groundtruth.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

# The trace cache (vest_slurm/estimate/tracecache.py): the tests' own, empty at the start of each run, never
# the user's ~/.cache (commands the tests run in subprocesses inherit it).
os.environ["VEST_CACHE_DIR"] = tempfile.mkdtemp(prefix="vest-test-cache-")

from vest_slurm.slurm.testbed import SlurmTestbed, missing_binaries


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm not installed (missing {', '.join(missing)}); apt-get install -y "
                    "--no-install-recommends slurmctld slurmd slurm-client slurm-wlm-basic-plugins "
                    "munge lua-cjson lua-socket")
    if os.geteuid() != 0:
        pytest.skip("the Slurm testbed needs root (munged, slurmd and mknod of fake GPU devices)")
    tb = SlurmTestbed(tmp_path_factory.mktemp("slurm"))
    tb.start()
    try:
        yield tb
    finally:
        tb.stop()


# --- the bridge (issue 5): a separate cluster with JobSubmitPlugins=lua and the decision server ---

BRIDGE_USERS = ("vestbr-alice", "vestbr-exempt")


@pytest.fixture(scope="session")
def bridge_users():
    """Two local users (the jobs of root are never checked): created here, removed afterwards."""
    import pwd
    import subprocess

    made = []
    for name in BRIDGE_USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "-M", "-s", "/bin/sh", name], check=True)
            made.append(name)
    try:
        yield BRIDGE_USERS
    finally:
        for name in made:
            subprocess.run(["userdel", name], check=False)


@pytest.fixture(scope="session")
def bridge_slurm(tmp_path_factory, bridge_users):
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm not installed (missing {', '.join(missing)})")
    if os.geteuid() != 0:
        pytest.skip("the Slurm testbed needs root")
    from vest_slurm.bridge.testbed import BridgeTestbed

    import shutil
    import tempfile

    # Not under pytest's tmp (mode 700): the test users' sbatch must read slurm.conf.
    workdir = tempfile.mkdtemp(prefix="vest-bridge-tb-")
    os.chmod(workdir, 0o755)
    tb = BridgeTestbed(workdir, directives=False, exempt_users=["root", bridge_users[1]])
    try:
        tb.start()
        yield tb
    finally:
        tb.stop()
        shutil.rmtree(workdir, ignore_errors=True)
