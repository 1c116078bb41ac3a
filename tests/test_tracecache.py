"""The trace cache: a second estimate of the same workload reads the trace instead of tracing, and
anything that could change the trace changes the key."""

from __future__ import annotations

import pytest
import torch  # noqa: F401

from vest_slurm.estimate import estimator

from vest_slurm.estimate import tracecache

from vest_slurm.estimate import tracing
from vest_slurm.estimate.profiles import get_profile
from vest_slurm.estimate.workload import parse_workload_args

MLP = 'mlp:[["Linear",64,32],["ReLU"],["Linear",32,10]]'
A100 = get_profile("a100-40gb")


def spec(*argv):
    return parse_workload_args(["--model", MLP, "--input", "64", "--batch-size", "8", *argv])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VEST_CACHE_DIR", str(tmp_path))
    calls = []
    real = tracing.trace_training

    def counting(*a, **kw):
        calls.append(a[0])
        return real(*a, **kw)

    monkeypatch.setattr(tracing, "trace_training", counting)
    monkeypatch.setenv("VEST_TRACE_AHEAD", "0")   # counted in this process: no class traced in a child (ahead.py)
    return tmp_path, calls


def test_the_second_estimate_reads_the_trace(cache):
    path, calls = cache
    first = estimator.trace_for(spec(), A100, cache=True)
    second = estimator.trace_for(spec(), A100, cache=True)
    assert len(calls) == 1 and list(path.glob("traces/*/*.json.gz"))
    assert second.trace.events == first.trace.events and second.trace.step_ends == first.trace.step_ends
    assert second.seconds == first.seconds and "read from the trace cache" in second.trace.notes
    assert estimator.estimate_from_trace(second, spec(), A100) == estimator.estimate_from_trace(first, spec(), A100)


def test_what_changes_the_trace_changes_the_key(cache, monkeypatch):
    _, calls = cache
    estimator.trace_for(spec(), A100, cache=True)
    estimator.trace_for(spec("--batch-size", "16"), A100, cache=True)          # another workload
    estimator.trace_for(spec(), get_profile("v100-32gb"), cache=True)         # another GPU class
    assert len(calls) == 3
    k = tracecache.key(spec(), A100.capability, A100.total_bytes)
    monkeypatch.setattr(tracecache, "_code_digest", lambda: "other code or library versions")
    assert tracecache.key(spec(), A100.capability, A100.total_bytes) != k


def test_off_user_code_and_no_cache_flag_trace_every_time(cache, monkeypatch):
    path, calls = cache
    estimator.trace_for(spec(), A100)                     # the benchmarks: no cache
    estimator.trace_for(spec(), A100)
    user = parse_workload_args(["--model", "tests/data/user_models.py:small_cnn", "--input", "3x32x32",
                                "--batch-size", "2"])
    assert tracecache.key(user, A100.capability, A100.total_bytes) is None   # a factory may import anything
    monkeypatch.setenv("VEST_CACHE_DIR", "off")
    estimator.trace_for(spec(), A100, cache=True)
    estimator.trace_for(spec(), A100, cache=True)
    assert len(calls) == 4 and not list(path.glob("traces/*/*.json.gz"))


def test_a_failed_trace_fails_again_from_the_cache(cache):
    from vest_slurm.errors import EstimateError

    _, calls = cache
    errors = []
    for _ in range(2):
        with pytest.raises(EstimateError) as e:
            estimator.trace_for(spec("--input", "48"), A100, cache=True)   # the MLP takes 64 features
        errors.append((e.value.what, e.value.fix))
    assert len(calls) == 1 and errors[0] == errors[1] and "48" in errors[0][0] and errors[0][1]


def test_a_damaged_entry_is_a_miss_and_is_replaced(cache):
    path, calls = cache
    estimator.trace_for(spec(), A100, cache=True)
    (entry,) = path.glob("traces/*/*.json.gz")
    entry.write_bytes(b"not gzip")
    again = estimator.trace_for(spec(), A100, cache=True)
    assert len(calls) == 2 and again.trace.events
    assert tracecache.load(tracecache.key(spec(), A100.capability, A100.total_bytes)) is not None


def test_the_least_recently_used_traces_go_first(cache, monkeypatch):
    import os

    path, calls = cache
    monkeypatch.setattr(tracecache, "MAX_TRACES", 2)
    for b in ("1", "2", "3"):
        estimator.trace_for(spec("--batch-size", b), A100, cache=True)
        entry = max(path.glob("traces/*/*.json.gz"), key=os.path.getmtime)
        os.utime(entry, (0, {"1": 100, "2": 200, "3": 300}[b]))   # in order of use, far apart
    # storing the third left the two most recently used: batch 2 and 3
    estimator.trace_for(spec("--batch-size", "2"), A100, cache=True)
    estimator.trace_for(spec("--batch-size", "3"), A100, cache=True)
    assert len(calls) == 3 and len(list(path.glob("traces/*/*.json.gz"))) == 2
    estimator.trace_for(spec("--batch-size", "1"), A100, cache=True)   # gone: traced again
    assert len(calls) == 4


def test_an_unwritable_cache_costs_nothing_but_the_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("VEST_CACHE_DIR", str(blocker / "cache"))   # a path under a file: mkdir fails
    assert estimator.trace_for(spec(), A100, cache=True).trace.events


def test_vest_estimate_twice_gives_the_same_answer_from_the_cache(tmp_path):
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, VEST_CACHE_DIR=str(tmp_path))
    argv = [sys.executable, "-m", "vest_slurm.cli", "estimate", "--model", "torchvision:resnet18", "--input",
            "3x64x64", "--batch-size", "4", "--gpu", "a100-40gb", "--gpu", "h100", "--json"]
    out = [subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300) for _ in range(2)]
    assert all(r.returncode == 0 for r in out), out[0].stderr + out[1].stderr
    assert len(list(tmp_path.glob("traces/*/*.json.gz"))) == 1   # one trace: both GPUs are sm80+
    first, second = (json.loads(r.stdout)["estimates"] for r in out)
    assert first == second


def test_an_estimate_from_the_cache_imports_no_torch(tmp_path):
    """The second process reads the trace and the cuDNN answers from the cache and asks no torch
    question: the job's cuDNN version comes from the installed files (cudnn_ws.job_cudnn_version)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, VEST_CACHE_DIR=str(tmp_path), VEST_QUIET="1")
    code = ("import sys, io, contextlib\nfrom vest_slurm.cli import run\n"
            "sys.argv = ['vest', 'estimate', '--model', 'torchvision:resnet18', '--input', '3x64x64',"
            " '--batch-size', '4', '--gpu', 'a100-40gb', '--json']\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    assert run() == 0\n"
            "print(out.getvalue().strip().splitlines()[-1][-1], 'torch' in sys.modules)\n")
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr + runs[1].stderr
    assert runs[0].stdout.split() == ["}", "True"]    # the first traced: torch was imported
    assert runs[1].stdout.split() == ["}", "False"]   # the second read the cache: no torch


def test_cudnn_answers_are_kept_for_the_next_process(tmp_path):
    """A workspace cuDNN's heuristics gave is stored when the process ends; the next process reads
    it without asking cuDNN (here: asking would fail)."""
    import os
    import subprocess
    import sys

    from vest_slurm.estimate import cudnn_ws

    assert cudnn_ws.available(), "cuDNN's Python frontend (a dependency) does not load: bash scripts/install.sh"
    ask = ("from vest_slurm.estimate import cudnn_ws; from vest_slurm.estimate.profiles import get_profile; "
           "k = cudnn_ws.conv_key('fprop', (8, 64, 56, 56), (64, 64, 3, 3), (1, 1), (1, 1), (1, 1), 'float32', False); ")
    env = dict(os.environ, VEST_CACHE_DIR=str(tmp_path))
    first = subprocess.run([sys.executable, "-c", ask + "print(cudnn_ws.workspace_for(get_profile('a100'), k))"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert list((tmp_path / "cudnn").glob("workspaces-*.json"))
    offline = ask + ("cudnn_ws._plan_workspaces = None; "   # calling it would raise: answered from disk
                     "print(cudnn_ws.workspace_for(get_profile('a100'), k))")
    second = subprocess.run([sys.executable, "-c", offline], env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout and int(first.stdout) > 0


def test_cudnn_answers_keep_the_last_written(tmp_path, monkeypatch):
    """The answers file is bounded: past MAX_ANSWERS the oldest entries go when it is written."""
    import json

    from vest_slurm.estimate import cudnn_ws

    answers = cudnn_ws._Answers()
    answers._path, answers._data = tmp_path / "cudnn" / "workspaces-test.json", {}
    monkeypatch.setattr(cudnn_ws._Answers, "MAX_ANSWERS", 3)
    for i in range(2):
        answers.get(f"k{i}", lambda i=i: i)
    answers.save()
    for i in range(2, 5):
        answers.get(f"k{i}", lambda i=i: i)
    answers.save()
    assert json.loads(answers._path.read_text()) == {"k2": 2, "k3": 3, "k4": 4}
