"""The other GPU classes traced beside the first in forked children (estimate/ahead.py): the same
traces as one after another, the children's work not repeated here, and no child left behind."""

from __future__ import annotations

import functools
import os

import pytest
import torch  # noqa: F401

from test_shared_trace import traced  # noqa: F401  (the fixture: traces made in this process)
from vest_slurm.estimate import ahead, estimator, tracing
from vest_slurm.estimate.profiles import get_profile
from vest_slurm.estimate.workload import parse_workload_args

V100, A100 = get_profile("v100-16gb"), get_profile("a100-40gb")


def spec(precision):
    return parse_workload_args(["--model", "hf:tiny-llama", "--input", "seq32", "--batch-size", "2",
                                "--precision", precision])


@pytest.fixture
def here(traced, monkeypatch):
    """The traces made in this process (a child's are made in its own copy of the list), on a
    machine of two cores with one idle, whatever else runs on this one."""
    monkeypatch.setattr(ahead, "cores", lambda: 2)
    monkeypatch.setattr(ahead, "_idle_cores", lambda: 1.0)
    return traced


def _children() -> set[int]:
    """This process's child processes that have not been waited for (zombies included)."""
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                        out.add(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def test_the_second_class_is_traced_in_a_child_and_is_the_trace_made_here(here, monkeypatch):
    before = _children()
    monkeypatch.setenv("VEST_TRACE_AHEAD", "1")
    beside = estimator.trace_classes(spec("amp-bf16"), [A100, V100])
    assert here == [(8, 0)]                       # the V100's trace came from the child
    assert not ahead._AHEAD and _children() == before
    monkeypatch.setenv("VEST_TRACE_AHEAD", "0")
    here.clear()
    alone = estimator.trace_classes(spec("amp-bf16"), [A100, V100])
    assert here == [(8, 0), (7, 0)]
    for cls in (True, False):
        assert beside[cls].trace.events == alone[cls].trace.events
        assert beside[cls].trace.gpu_asked == alone[cls].trace.gpu_asked
    assert beside[False].trace.events != beside[True].trace.events   # bf16 on the V100 is another run


def test_a_child_whose_class_takes_the_first_trace_is_stopped(here, monkeypatch):
    """A CNN in fp32 asks the GPU nothing: the V100 takes the A100's trace (trace.holds_on) and
    the child tracing it is killed and waited for."""
    before = _children()
    monkeypatch.setenv("VEST_TRACE_AHEAD", "1")
    cnn = parse_workload_args(["--model", "torchvision:resnet18", "--input", "3x32x32", "--batch-size", "4"])
    got = estimator.trace_classes(cnn, [A100, V100])
    assert here == [(8, 0)] and got[True] is got[False]
    assert not ahead._AHEAD and _children() == before


def test_the_prober_traces_the_job_beside_too(here, monkeypatch):
    from vest_slurm.site.advice import Prober
    from vest_slurm.site.config import parse_site_config

    site = parse_site_config("""
[gpu.v100]
profile = "v100-16gb"
[gpu.a100]
profile = "a100-40gb"
[partition.gpu]
gpu_types = ["v100", "a100"]
gpus_per_node = 4
""")
    monkeypatch.setenv("VEST_TRACE_AHEAD", "1")
    prober = Prober.for_site(site, budget_s=600)
    ok, failed = prober.estimates(spec("amp-bf16"))
    assert sorted(ok) == ["a100", "v100"] and not failed and here == [(7, 0)] and prober.traces_made == 2
    assert not ahead._AHEAD


def test_an_error_in_the_child_is_the_error_made_here(here, monkeypatch):
    """A trace that fails in the child fails as it would here: the same EstimateError."""
    from vest_slurm.errors import EstimateError

    def refuses(sp, capability=(8, 0), total_memory_bytes=80 << 30, *rest):
        raise EstimateError(f"refused on sm{capability[0]}{capability[1]}", "nothing to do")

    monkeypatch.setattr(tracing, "trace_training", refuses)
    monkeypatch.setenv("VEST_TRACE_AHEAD", "1")
    got = estimator.trace_classes(spec("amp-bf16"), [A100, V100])
    assert isinstance(got[False], EstimateError) and "refused on sm70" in str(got[False])
    assert isinstance(got[True], EstimateError) and "refused on sm80" in str(got[True])


def test_no_child_where_no_core_is_idle(here, monkeypatch):
    monkeypatch.setenv("VEST_TRACE_AHEAD", "1")
    monkeypatch.setattr(ahead, "_idle_cores", lambda: 0.4)
    estimator.trace_classes(spec("amp-bf16"), [A100, V100])
    assert here == [(8, 0), (7, 0)]


@pytest.mark.parametrize("loadavg, own, idle", [
    ("1.59 1.00 1.09 1/110 7480", 1, 1.0),   # commands one after another (a benchmark): this one runs alone now
    ("0.40 0.75 0.82 2/110 7480", 1, 0.0),   # another task runnable now beside this one
    ("0.10 0.10 0.10 3/110 7480", 1, -1.0),
    ("0.40 0.75 0.82 2/110 7480", 2, 1.0),   # this process's OpenMP worker spinning after a CPU op
    ("0.40 0.75 0.82 3/110 7480", 2, 0.0),   # and another task
])
def test_idle_cores_are_those_no_other_task_runnable_now_takes(monkeypatch, loadavg, own, idle):
    """This process is among the runnable tasks, and so are its own spinning threads; the load
    average, which trails this process's own earlier work, does not count. Ahead children start
    where a core is free (MIN_IDLE_CORES)."""
    monkeypatch.setattr(ahead, "cores", lambda: 2)
    assert ahead._idle_cores(loadavg, own) == idle
    monkeypatch.setenv("VEST_TRACE_AHEAD", "1")
    monkeypatch.setattr(ahead, "_idle_cores", functools.partial(ahead._idle_cores, loadavg, own))
    assert ahead.enabled() == (idle >= 1)


def test_own_spinning_threads_leave_the_core_idle():
    """Right after torch's parallel CPU ops its OpenMP workers spin, runnable (read from /proc): they
    are this process's, so the gate does not count them against a child."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(1500, 1500)
        seen = []
        for _ in range(20):
            x @ x
            seen.append(ahead._own_runnable())
    finally:
        torch.set_num_threads(threads)
    assert max(seen) >= 2   # the workers are runnable right after the product


def test_what_a_child_asks_of_cudnn_is_kept_for_the_next_process(tmp_path, monkeypatch):
    """A child's cuDNN answers are saved to the answers file before its answer comes back (it
    leaves without the atexit handlers that save the parent's)."""
    import json

    from vest_slurm.estimate import cudnn_ws
    from vest_slurm.estimate.profiles import get_profile

    monkeypatch.setenv("VEST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ahead, "cores", lambda: 2)
    monkeypatch.setattr(ahead, "_idle_cores", lambda: 1.0)
    monkeypatch.setattr(cudnn_ws, "_ANSWERS", cudnn_ws._Answers())
    monkeypatch.setattr(ahead, "_AT_CHILD_END", [])
    assert cudnn_ws._ANSWERS.has("nothing") is False   # loads the (empty) file: the save is registered
    key = cudnn_ws.conv_key("fprop", (8, 64, 56, 56), (64, 64, 3, 3), (1, 1), (1, 1), (1, 1), "float32", False)
    cudnn_ws.workspace_bytes.cache_clear()
    assert ahead.start(("ask",), cudnn_ws.workspace_for, get_profile("a100-40gb"), key)
    ok, size = ahead.take(("ask",))
    assert ok and size > 0
    saved = json.loads(next((tmp_path / "cudnn").glob("workspaces-*.json")).read_text())
    assert any(k.endswith(key) for k in saved) and not cudnn_ws._ANSWERS._new   # asked in the child only


def test_no_child_is_copied_while_the_progress_line_is_drawn(monkeypatch):
    """The fork happens with the progress line's lock held (its ticker thread draws under it: a
    child copied mid-draw would hang at its first write to stderr, and its parent with it); the
    child gets a lock of its own and draws nothing."""
    from vest_slurm.estimate import progress

    monkeypatch.setattr(ahead, "cores", lambda: 2)
    monkeypatch.setattr(ahead, "_idle_cores", lambda: 1.0)
    monkeypatch.setenv("VEST_TRACE_AHEAD", "1")
    held, real_fork = [], os.fork
    monkeypatch.setattr(os, "fork", lambda: held.append(progress._lock.locked()) or real_fork())

    def in_child():
        progress.step("a step in the child")   # would block on a copied, held lock
        return progress._lock.locked(), progress._state["quiet"]

    assert ahead.start(("progress",), in_child)
    assert ahead.take(("progress",)) == (True, (False, True))
    assert held == [True] and not progress._lock.locked()


def test_a_cgroup_cpu_quota_bounds_the_cores(tmp_path, monkeypatch):
    """A login node's per-user CPU quota (cgroup v2 cpu.max on the user's slice, or v1's
    cfs_quota_us) bounds the cores the traces ahead and cuDNN's workers count on: two processes
    under a one-core quota take turns."""
    v2 = tmp_path / "v2"
    (v2 / "user.slice" / "user-1000.slice" / "session-3.scope").mkdir(parents=True)
    (v2 / "cpu.max").write_text("max 100000\n")
    (v2 / "user.slice" / "user-1000.slice" / "cpu.max").write_text("150000 100000\n")
    (v2 / "user.slice" / "user-1000.slice" / "session-3.scope" / "cpu.max").write_text("max 100000\n")
    own = tmp_path / "cgroup"
    own.write_text("0::/user.slice/user-1000.slice/session-3.scope\n")
    assert ahead._quota_cores(str(v2), str(own)) == 1.5
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "job").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us").write_text("400000\n")
    (v1 / "cpu,cpuacct" / "job" / "cpu.cfs_period_us").write_text("100000\n")
    own.write_text("4:memory:/job\n3:cpu,cpuacct:/job\n0::/\n")
    assert ahead._quota_cores(str(v1), str(own)) == 4.0
    own.write_text("3:cpu,cpuacct:/\n")   # no quota set anywhere
    assert ahead._quota_cores(str(v1), str(own)) is None
    monkeypatch.setattr(ahead, "_quota_cores", lambda: 1.5)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert ahead.cores() == 1
    monkeypatch.setattr(ahead, "_quota_cores", lambda: None)
    assert ahead.cores() == 4
