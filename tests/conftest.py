"""Shared fixtures. ``slurm``: one real Slurm on loopback for the whole session (vest_slurm.slurm.testbed).

The Slurm tests do not skip. Where the machine lacks what they need (root, the Debian packages:
tests/prereqs.py), the fixtures fail with what is missing and the fix (``bash scripts/install.sh``),
unless the run deselected them: ``-m "not slurm"``, or ``VEST_SKIP_SLURM=1`` (which deselects the
tests marked slurm here too). A test that uses a Slurm fixture is marked slurm whether or not its
module says so. In CI (``CI`` or ``VEST_CI`` set) any skip fails the session (tests/ci_skips.py),
except tests marked ``gpu``, which need a real CUDA GPU.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
from bridge_tb import bridge_testbed

# The accuracy benchmark's ground-truth mapping lives with the benchmark (scripts/groundtruth.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

# The trace cache (vest_slurm/estimate/tracecache.py): the tests' own, empty at the start of each run, never
# the user's ~/.cache (commands the tests run in subprocesses inherit it).
os.environ["VEST_CACHE_DIR"] = tempfile.mkdtemp(prefix="vest-test-cache-")

import ci_skips
import prereqs
from vest_slurm.slurm.testbed import SlurmTestbed

SLURM_FIXTURES = ("slurm", "bridge_slurm", "slurm_prereqs")


def pytest_configure(config):
    ci_skips.install(config)
    if os.environ.get("VEST_SKIP_SLURM") == "1" and ci_skips.in_ci():
        raise pytest.UsageError("VEST_SKIP_SLURM=1 is refused in CI (CI or VEST_CI is set): CI runs the Slurm tests")


@pytest.hookimpl(tryfirst=True)   # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slurm") is None and any(f in item.fixturenames for f in SLURM_FIXTURES):
            item.add_marker(pytest.mark.slurm)
    if os.environ.get("VEST_SKIP_SLURM") == "1":
        dropped = [i for i in items if i.get_closest_marker("slurm") is not None]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [i for i in items if i.get_closest_marker("slurm") is None]


@pytest.fixture(scope="session")
def slurm_prereqs():
    """Root and the Slurm packages: a test that needs them fails here, with the fix, where they are missing."""
    missing = prereqs.missing_slurm()
    if missing:
        pytest.fail(prereqs.message(missing, missing), pytrace=False)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory, slurm_prereqs):
    tb = SlurmTestbed(tmp_path_factory.mktemp("slurm"))
    tb.start()
    try:
        yield tb
    finally:
        tb.stop()


# --- the bridge (issue 5): a separate cluster with JobSubmitPlugins=lua and the decision server ---

BRIDGE_USERS = ("vestbr-alice", "vestbr-exempt")


@pytest.fixture(scope="session")
def bridge_users(slurm_prereqs):
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
def bridge_slurm(tmp_path_factory, slurm_prereqs, bridge_users):
    with bridge_testbed("vest-bridge-tb-", exempt_users=["root", bridge_users[1]]) as tb:
        yield tb
