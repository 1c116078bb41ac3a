"""One-shot commands (estimate/oneshot.py): `vest` and `vsbatch` leave without the interpreter's teardown but
with everything a normal exit does (output, exit code, atexit handlers), and freeze the collector's
long-lived objects; the bridge, which lives on, does neither."""

import json
import os
import subprocess
import sys

import pytest

# Registered before the command runs: at exit it says whether it ran, and how many objects the
# collector had frozen (gc.get_freeze_count), on stderr.
_PROBE = ("import atexit, gc, sys\n"
          "atexit.register(lambda: print('atexit ran, frozen', gc.get_freeze_count(), file=sys.stderr, flush=True))\n")


def _vest(code: str, tmp_path):
    env = dict(os.environ, VEST_CACHE_DIR=str(tmp_path), VEST_QUIET="1")
    return subprocess.run([sys.executable, "-c", _PROBE + code], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)


def test_vest_estimate_leaves_with_its_output_exit_code_and_atexit_handlers(tmp_path):
    """The estimate's JSON is whole on stdout, the exit code is 0, atexit handlers ran (ours keep
    cuDNN's answers for the next process: the file is there), and the trace ran with torch's
    objects frozen out of the collector's scans."""
    r = _vest("from vest_slurm.cli import main\n"
              "main(['estimate', '--model', 'torchvision:resnet18', '--input', '3x64x64', '--batch-size', '4',"
              " '--gpu', 'a100-40gb', '--json'])\n"
              "print('main returned', file=sys.stderr)\n", tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["estimates"][0]["gpu"] == "a100-40gb"
    assert "main returned" not in r.stderr   # it left from main
    frozen = [line for line in r.stderr.splitlines() if line.startswith("atexit ran")]
    assert frozen and int(frozen[0].split()[-1]) > 100_000, r.stderr
    assert list((tmp_path / "cudnn").glob("workspaces-*.json"))


def test_an_error_keeps_its_exit_code_after_torch_was_imported(tmp_path):
    """A failure after the trace started leaves through the same path with its own exit code."""
    (tmp_path / "site.toml").write_text("not toml [")
    r = _vest("import torch\nfrom vest_slurm.cli import main\n"
              "main(['estimate', '--model', 'torchvision:resnet18', '--input', '3x64x64', '--batch-size', '4',"
              " '--site-config', 'site.toml'])\n", tmp_path)
    assert r.returncode == 2, r.stderr
    assert "site.toml" in r.stderr and "atexit ran" in r.stderr


@pytest.mark.parametrize("one_shot", [True, False])
def test_only_a_one_shot_process_freezes(tmp_path, one_shot):
    """settle() freezes in a command's process and nowhere else: the bridge's worker estimates in a
    process that lives on, where frozen garbage would stay for good."""
    r = _vest("from vest_slurm.estimate import oneshot\n"
              + ("oneshot.begin()\n" if one_shot else "")
              + "import gc; oneshot.settle(); print(gc.get_freeze_count())\n", tmp_path)
    assert r.returncode == 0, r.stderr
    assert (int(r.stdout) > 0) == one_shot


def test_the_bridge_command_is_not_one_shot(tmp_path):
    """`vest bridge ...` (the server's and the systemd unit's command line) is not marked."""
    r = _vest("from vest_slurm import cli\nfrom vest_slurm.estimate import oneshot\n"
              "try:\n    cli.main(['bridge', '--help'])\nexcept SystemExit:\n    pass\n"
              "print(oneshot._ONE_SHOT)\n", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "False"


def test_a_scripts_run_is_one_shot_too():
    """The child that runs a training script with fake CUDA freezes what its imports and its first
    step left alive (dynamic/bootstrap.py, standins.ScriptState.step)."""
    from vest_slurm.dynamic.launch import parse_train_command
    from vest_slurm.dynamic.runner import estimate_command
    from vest_slurm.errors import EstimateError
    from vest_slurm.estimate.profiles import get_profile

    scripts = os.path.join(os.path.dirname(__file__), "data", "scripts")
    with pytest.raises(EstimateError) as e:
        estimate_command(parse_train_command(["python", "reports_frozen_objects.py"]), [get_profile("a100-40gb")],
                         cwd=scripts)
    frozen = int(str(e.value).split("frozen ")[1].split()[0])
    assert frozen > 100_000, str(e.value)


CONV_SCRIPT = """import torch, torch.nn as nn
m = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 30 * 30, 10)).cuda()
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(4):
    loss = m(torch.randn(8, 3, 32, 32, device="cuda")).sum(); opt.zero_grad(); loss.backward(); opt.step()
"""


def test_a_scripts_estimate_ends_without_the_teardown_of_cudnns_frontend(tmp_path):
    """The dynamic estimate's process imports no torch, but asks cuDNN's frontend (a nanobind
    module) about the script's convolutions: freed at a normal exit it printed "nanobind: leaked
    ..." after the table. It leaves as the other one-shot commands do."""
    (tmp_path / "train.py").write_text(CONV_SCRIPT)
    r = _vest("from vest_slurm.cli import main\n"
              "main(['estimate', '--gpu', 'h100-80gb', '--', 'python', 'train.py'])\n", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "h100-80gb" in r.stdout and "atexit ran" in r.stderr
    assert "nanobind" not in r.stderr and "leaked" not in r.stderr, r.stderr
