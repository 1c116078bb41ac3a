"""The test suite's own rules (issue 22): a machine without what the Slurm tests need stops the run
with the fix instead of skipping them, and in CI any skip (but a test marked gpu) fails the run.

The pytest runs here are subprocesses on a few-line test file, or on one Slurm test where the
Slurm fixtures fail before any daemon starts. A process is made to look unprivileged, or to lack
slurmd, by a sitecustomize module on its PYTHONPATH (it replaces os.geteuid, shutil.which), since
the tests themselves run as root on a machine that has the packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import prereqs

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"

SAMPLE = """
import pytest

def test_passes():
    pass

def test_skips():
    pytest.skip("no frobnicator here")

@pytest.mark.gpu
def test_needs_a_gpu():
    pytest.skip("CUDA is not available")
"""


def _env(tmp_path, ci=None, pretend=None, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "VEST_CI", "VEST_SKIP_SLURM", "PYTEST_ADDOPTS")}
    path = [str(TESTS)]
    if pretend:
        fake = tmp_path / "pretend"
        fake.mkdir(exist_ok=True)
        (fake / "sitecustomize.py").write_text(pretend)
        path.insert(0, str(fake))
    env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if ci:
        env[ci] = "1"
    env.update(extra)
    return env


def _pytest(tmp_path, *args, env):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


NOT_ROOT = "import os\nos.geteuid = lambda: 1000\n"
NO_SLURMD = ("import shutil\n_which = shutil.which\n"
             "shutil.which = lambda p, *a, **k: None if p == 'slurmd' else _which(p, *a, **k)\n")


# ---- in CI a skip fails the session ----

def test_a_skip_outside_ci_is_listed_and_passes(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    r = _pytest(tmp_path, "-p", "ci_skips", "-rs", "test_sample.py", env=_env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed, 2 skipped" in r.stdout and "no frobnicator here" in r.stdout
    assert "fail the CI run" not in r.stdout


def test_in_ci_a_skip_fails_the_session_and_a_gpu_test_may_skip(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    for var in ("CI", "VEST_CI"):
        r = _pytest(tmp_path, "-p", "ci_skips", "test_sample.py", env=_env(tmp_path, ci=var))
        assert r.returncode == 1, (var, r.stdout + r.stderr)
        summary = r.stdout[r.stdout.index("skipped tests fail the CI run"):]
        assert "1 skipped; in CI" in summary
        assert "test_sample.py::test_skips: Skipped: no frobnicator here" in summary
        assert "test_needs_a_gpu" not in summary
    only_gpu = _pytest(tmp_path, "-p", "ci_skips", "test_sample.py", "-k", "not test_skips",
                       env=_env(tmp_path, ci="VEST_CI"))
    assert only_gpu.returncode == 0, only_gpu.stdout
    assert "1 passed, 1 skipped" in only_gpu.stdout and "fail the CI run" not in only_gpu.stdout


def test_in_ci_a_module_skipped_at_import_fails_the_session(tmp_path):
    (tmp_path / "test_mod.py").write_text("import pytest\npytest.importorskip('no_such_module_vest')\n"
                                          "def test_x():\n    pass\n")
    r = _pytest(tmp_path, "-p", "ci_skips", "test_mod.py", env=_env(tmp_path, ci="CI"))
    assert r.returncode == 1 and "test_mod.py: Skipped: could not import 'no_such_module_vest'" in r.stdout, r.stdout


def test_in_ci_a_failing_run_keeps_its_status(tmp_path):
    (tmp_path / "test_fail.py").write_text("import pytest\ndef test_f():\n    assert False\n"
                                           "def test_s():\n    pytest.skip('why')\n")
    r = _pytest(tmp_path, "-p", "ci_skips", "test_fail.py", env=_env(tmp_path, ci="VEST_CI"))
    assert r.returncode == 1 and "1 failed" in r.stdout and "test_fail.py::test_s: Skipped: why" in r.stdout


def test_ci_false_is_not_ci(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    r = _pytest(tmp_path, "-p", "ci_skips", "test_sample.py", env=_env(tmp_path, CI="false"))
    assert r.returncode == 0, r.stdout


# ---- what the Slurm tests need: stop with the fix, never skip ----

def test_prerequisites_name_what_is_missing_and_the_fix(monkeypatch):
    monkeypatch.setattr(prereqs.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(prereqs, "_which", lambda p: None if p in ("slurmd", "munged") else "/usr/bin/" + p)
    prereqs.missing_slurm.cache_clear()
    try:
        missing = prereqs.missing_slurm()
    finally:
        prereqs.missing_slurm.cache_clear()
    assert len(missing) == 2 and missing[0].startswith("root") and "munged, slurmd" in missing[1]
    text = prereqs.message(missing, missing)
    assert "bash scripts/install.sh" in text and "VEST_SKIP_SLURM=1" in text
    # torch missing cannot be deselected: no opt-out offered
    assert "VEST_SKIP_SLURM" not in prereqs.message(["python cannot import torch (x)", *missing], missing)


def test_the_installed_machine_has_everything():
    """This machine runs the Slurm tests (root, Debian's packages, torch), as CI must."""
    prereqs.missing_slurm.cache_clear()
    assert prereqs.missing_python() == [] and prereqs.missing_slurm() == ()


def test_slurm_fixture_fails_with_the_fix_when_not_root(tmp_path):
    node = "tests/test_cluster.py::test_cluster_info_shows_three_gpu_partitions"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", node],
                       capture_output=True, text=True, cwd=REPO, timeout=600, env=_env(tmp_path, pretend=NOT_ROOT))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 error" in r.stdout and "skipped" not in r.stdout
    assert "root (the testbed runs munged" in r.stdout and "Fix: bash scripts/install.sh" in r.stdout


def test_a_test_using_a_slurm_fixture_is_marked_slurm_and_deselected_on_request(tmp_path):
    # test_dynamic.py's vsbatch test uses the slurm fixture; VEST_SKIP_SLURM=1 deselects it even
    # without -m (a plain pytest run), as -m "not slurm" does
    node = "tests/test_dynamic.py::test_vsbatch_places_a_script_by_its_training_command"
    for args, extra in (((), {"VEST_SKIP_SLURM": "1"}), (("-m", "not slurm"), {})):
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, node],
                           capture_output=True, text=True, cwd=REPO, timeout=600,
                           env=_env(tmp_path, pretend=NOT_ROOT, **extra))
        assert r.returncode == 5 and "1 deselected" in r.stdout, (args, r.stdout + r.stderr)   # 5: no test ran


def test_the_opt_out_is_refused_in_ci(tmp_path):
    node = "tests/test_suite_habits.py::test_ci_false_is_not_ci"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node], capture_output=True,
                       text=True, cwd=REPO, timeout=600, env=_env(tmp_path, ci="CI", VEST_SKIP_SLURM="1"))
    assert r.returncode == 4 and "VEST_SKIP_SLURM=1 is refused in CI" in r.stderr, r.stdout + r.stderr


def _run_tests(tmp_path, *args, pretend=None, **extra):
    return subprocess.run(["bash", str(REPO / "scripts" / "run-tests.sh"), *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=600, env=_env(tmp_path, pretend=pretend, **extra))


def test_run_tests_stops_before_pytest_where_slurm_tests_cannot_run(tmp_path):
    for pretend, what in ((NOT_ROOT, "root (the testbed"), (NO_SLURMD, "the programs slurmd (Debian packages")):
        r = _run_tests(tmp_path, "--collect-only", pretend=pretend)
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stdout == "" and what in r.stderr and "Fix: bash scripts/install.sh" in r.stderr
        assert "VEST_SKIP_SLURM=1 bash scripts/run-tests.sh" in r.stderr


def test_run_tests_opt_out_deselects_and_is_refused_in_ci(tmp_path):
    (tmp_path / "test_two.py").write_text("import pytest\n@pytest.mark.slurm\ndef test_s():\n    pass\n"
                                          "def test_u():\n    pass\n")
    r = _run_tests(tmp_path, str(tmp_path / "test_two.py"), pretend=NOT_ROOT, VEST_SKIP_SLURM="1")
    assert r.returncode == 0 and "1 passed, 1 deselected" in r.stdout, r.stdout + r.stderr
    assert "the Slurm tests are deselected, not run" in r.stderr
    refused = _run_tests(tmp_path, str(tmp_path / "test_two.py"), VEST_SKIP_SLURM="1", VEST_CI="1")
    assert refused.returncode == 2 and "refused in CI" in refused.stderr and refused.stdout == ""
