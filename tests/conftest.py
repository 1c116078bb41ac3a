"""Shared fixtures. ``slurm``: one real Slurm on loopback for the whole session (vest_slurm.testbed).

The Slurm tests skip only when the Debian packages are missing (slurmctld slurmd slurm-client
slurm-wlm-basic-plugins munge); CI installs them, so there they run.
"""

from __future__ import annotations

import os

import pytest

from vest_slurm.testbed import SlurmTestbed, missing_binaries


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
