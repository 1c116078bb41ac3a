"""In CI a skipped test is a failure: the pytest hooks that make it one (loaded by tests/conftest.py).

A skip in CI means a test that should have run did not, and the run still goes green: the Slurm
tests on a machine without the packages, a test whose optional input went missing. So when the
environment variable ``CI`` or ``VEST_CI`` is set (``.ci/run`` exports ``VEST_CI=1``), every skip
is listed with its reason at the end of the run and the session fails (exit status 1).

The one exception: tests marked ``gpu`` need a real CUDA GPU and skip on the CPU machines that
run CI. A test deselected on purpose (``-m "not slurm"``, ``VEST_SKIP_SLURM=1``) is not a skip.
"""

from __future__ import annotations

import os

import pytest

GPU_MARKER = "gpu: needs a real CUDA GPU; the only tests that may skip in CI (on its CPU machines)"


def in_ci() -> bool:
    return any(os.environ.get(v, "").strip().lower() not in ("", "0", "false", "no") for v in ("CI", "VEST_CI"))


def install(config) -> None:
    """Register the marker and the ledger (tests/conftest.py calls this from its pytest_configure)."""
    config.addinivalue_line("markers", GPU_MARKER)
    if not config.pluginmanager.has_plugin(_SkipLedger.NAME):
        config.pluginmanager.register(_SkipLedger(), _SkipLedger.NAME)


pytest_configure = install   # as a plugin of its own: pytest -p ci_skips


def _reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:   # (path, line, "Skipped: reason")
        return f"{lr[2]} ({lr[0]}:{lr[1]})"
    return str(lr)


class _SkipLedger:
    NAME = "vest-ci-skips"

    def __init__(self):
        self.skips: list[tuple[str, str]] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        outcome.get_result().vest_gpu = item.get_closest_marker("gpu") is not None

    def pytest_runtest_logreport(self, report):
        if report.skipped and not hasattr(report, "wasxfail") and not getattr(report, "vest_gpu", False):
            self.skips.append((report.nodeid, _reason(report)))

    def pytest_collectreport(self, report):
        if report.skipped:   # a module-level skip: none of its tests ran
            self.skips.append((report.nodeid, _reason(report)))

    def pytest_sessionfinish(self, session, exitstatus):
        if in_ci() and self.skips and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if not (in_ci() and self.skips):
            return
        tr = terminalreporter
        tr.section("skipped tests fail the CI run", sep="=", red=True, bold=True)
        tr.line(f"{len(self.skips)} skipped; in CI (CI or VEST_CI set) only tests marked gpu may skip:")
        for nodeid, reason in self.skips:
            tr.line(f"  {nodeid}: {reason}")
        tr.line("Make them run here (the Slurm tests: bash scripts/install.sh, as root), or, for a test that "
                "needs a real CUDA GPU, mark it @pytest.mark.gpu.")
