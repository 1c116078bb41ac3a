"""A bridge testbed for one test module or session (tests/conftest.py's bridge_slurm, the audit tests)."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def bridge_testbed(prefix: str, **options):
    """A started BridgeTestbed (directives off unless asked) in a fresh directory, stopped and
    removed at the end. Not under pytest's tmp (mode 700): the test users' sbatch must read
    slurm.conf."""
    import shutil
    import tempfile

    from vest_slurm.bridge.testbed import BridgeTestbed

    workdir = tempfile.mkdtemp(prefix=prefix)
    os.chmod(workdir, 0o755)
    tb = BridgeTestbed(workdir, **{"directives": False, **options})
    try:
        tb.start()
        yield tb
    finally:
        tb.stop()
        shutil.rmtree(workdir, ignore_errors=True)
