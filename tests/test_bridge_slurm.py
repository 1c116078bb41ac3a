"""The bridge against the real slurmctld (JobSubmitPlugins=lua, site-config/job_submit.lua): plain
sbatch as a non-root user, the decision applied or refused, faults of the server and the config.

Every submission goes through ``sbatch`` run as a test user (runuser), the script on stdin.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import subprocess
import threading
import time
import uuid

import pytest

from vest_slurm.slurm.attach import attach, make_payload
from vest_slurm.estimate.record import MemoryEstimate

pytestmark = pytest.mark.slurm
GiB = 1 << 30
USER, EXEMPT = "vestbr-alice", "vestbr-exempt"


def estimate_line_script(need_gib: float, partition: str = "v100", gres: str = "gpu:v100:1",
                         extra: str = "", num_gpus: int = 1) -> str:
    est = {t: MemoryEstimate(p, c * GiB, int(need_gib * GiB), int(need_gib * GiB))
           for t, p, c in (("v100", "v100-16gb", 16), ("a100", "a100-40gb", 40), ("h100", "h100-80gb", 80))}
    return attach(plain_script(partition, gres, extra), make_payload(est, num_gpus=num_gpus))


def plain_script(partition: str = "v100", gres: str = "gpu:v100:1", extra: str = "") -> str:
    lines = ["#!/bin/bash", f"#SBATCH --partition={partition}" if partition else "",
             f"#SBATCH --gres={gres}" if gres else "", "#SBATCH --output=/dev/null", extra, "true", ""]
    return "\n".join(lines)


def sbatch(tb, script: str | bytes, *args: str, user: str = USER, timeout: float = 30):
    name = f"t-{uuid.uuid4().hex[:10]}"
    argv = ["sbatch", f"--job-name={name}", "--parsable", *args]
    if user != "root":
        argv = ["runuser", "-u", user, "--", "env", f"SLURM_CONF={tb.env['SLURM_CONF']}", *argv]
    data = script if isinstance(script, bytes) else script.encode("utf-8", "surrogateescape")
    p = subprocess.run(argv, input=data, capture_output=True, env=tb.env, cwd="/tmp", timeout=timeout)
    p.name = name
    p.out, p.err = p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")
    return p


def job_of(tb, name: str) -> list[dict]:
    """Records of the jobs with this name (22.05 may leave a FAILED record for a refused job)."""
    r = subprocess.run(["squeue", "--json"], capture_output=True, text=True, env=tb.env, timeout=10)
    jobs = json.loads(r.stdout)["jobs"]
    return [j for j in jobs if j.get("name") == name]


def queued(tb, name: str) -> list[dict]:
    return [j for j in job_of(tb, name) if j.get("job_state") not in ("FAILED",)]


def sinfo_answers(tb) -> None:
    """The controller answers another client (sinfo, within its own generous 30 s subprocess limit:
    a stalled controller, not a slow one, fails this). How much the plugin adds to submissions is
    scripts/bench_bridge.py's measure."""
    r = subprocess.run(["sinfo", "-h"], capture_output=True, text=True, env=tb.env, timeout=30)
    assert r.returncode == 0, r.stderr


def ctld_log(tb) -> str:
    return (tb.workdir / "log" / "slurmctld.log").read_text(errors="replace")


@pytest.fixture
def tb(bridge_slurm):
    """The bridge cluster reset to testbed.toml (reroute, unknown jobs allowed, fail open)."""
    for _ in ("before", "after"):
        if not bridge_slurm.server_alive():
            bridge_slurm.write_site()           # a server binds only once its config loads
            bridge_slurm.start_server()
        bridge_slurm.configure()
        if _ == "before":
            yield bridge_slurm


# ---------------------------------------------------------------- decisions

def test_too_big_for_requested_partition_is_rerouted_and_user_told(tb):
    p = sbatch(tb, estimate_line_script(20))
    assert p.returncode == 0, p.err
    assert "moved to partition a100" in p.err
    (job,) = job_of(tb, p.name)
    assert job["partition"] == "a100"
    assert "a100" in job["tres_per_node"]
    assert f"job={p.name} " in ctld_log(tb) and "action=modify reason=rerouted" in ctld_log(tb)


def test_too_big_refused_when_policy_refuses_and_nothing_queued(tb):
    tb.configure(on_user_choice_too_small="refuse")
    p = sbatch(tb, estimate_line_script(20))
    assert p.returncode == 1
    assert "does not fit on the GPUs you asked for" in p.err
    assert "Invalid generic resource" in p.err       # ESLURM_INVALID_GRES on the second line
    assert queued(tb, p.name) == []


def test_fits_nowhere_refused(tb):
    p = sbatch(tb, estimate_line_script(200))
    assert p.returncode == 1 and "does not fit on any GPU" in p.err
    assert queued(tb, p.name) == []


def test_job_that_fits_passes_unchanged(tb):
    p = sbatch(tb, estimate_line_script(4))
    assert p.returncode == 0, p.err
    (job,) = job_of(tb, p.name)
    assert job["partition"] == "v100" and job["tres_per_node"] == "gres:gpu:v100:1"
    assert p.err == ""


@pytest.mark.parametrize("policy", ["allow", "warn", "refuse"])
def test_job_without_estimate_follows_unknown_job_policy(tb, policy):
    tb.configure(unknown_jobs=policy)
    p = sbatch(tb, plain_script())
    if policy == "refuse":
        assert p.returncode == 1 and "vsbatch" in p.err and "Access/permission denied" in p.err
        assert queued(tb, p.name) == []
    else:
        assert p.returncode == 0, p.err
        assert len(queued(tb, p.name)) == 1
        assert ("vsbatch" in p.err) == (policy == "warn")


def test_cpu_job_without_estimate_always_passes(tb):
    tb.configure(unknown_jobs="refuse")
    p = sbatch(tb, plain_script(partition="", gres=""))
    assert p.returncode == 0, p.err


def test_root_and_exempt_users_pass_untouched(tb):
    tb.configure(unknown_jobs="refuse", on_user_choice_too_small="refuse")
    for user in ("root", EXEMPT):
        p = sbatch(tb, estimate_line_script(200), user=user)
        assert p.returncode == 0, (user, p.err)
        (job,) = job_of(tb, p.name)
        assert job["partition"] == "v100"
    assert "reason=exempt" in ctld_log(tb)
    # and the same job from a user who is not exempt is refused: the exemption is what let it through
    assert sbatch(tb, estimate_line_script(200)).returncode == 1


def test_gpus_option_is_rerouted_in_its_own_family(tb):
    s = estimate_line_script(20, gres="", extra="#SBATCH --gpus=v100:1")
    p = sbatch(tb, s)
    assert p.returncode == 0, p.err
    (job,) = job_of(tb, p.name)
    assert job["partition"] == "a100" and "a100:1" in job["tres_per_job"]


# ---------------------------------------------------------------- faults

class FakeServer:
    """Listens on the bridge's socket and misbehaves: hang, or answer ``reply``. ``accepted`` is set
    once the plugin has connected."""

    def __init__(self, path: str, reply: bytes | None):
        self.path, self.reply = path, reply
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.path.exists(path):
            os.unlink(path)
        self.sock.bind(path)
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.stop = threading.Event()
        self.accepted = threading.Event()
        self.held = []
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted.set()
            if self.reply is None:
                self.held.append(c)          # never answers
            else:
                try:
                    c.settimeout(1)
                    c.recv(1 << 20)
                    c.sendall(self.reply)
                except OSError:
                    pass
                c.close()

    def close(self):
        self.stop.set()
        self.t.join()
        for c in self.held:
            c.close()
        self.sock.close()
        os.unlink(self.path)


BRIDGE_TIMEOUT_S = 0.5      # below the default fallback_burst_ms (0.6 s), so that the timeout is the limit
# sbatch's own limit in these tests: the bridge's timeout plus a margin far above a loaded machine's
# noise, so that only a plugin that does not give up at its timeout (a hang) exceeds it
SBATCH_LIMIT_S = BRIDGE_TIMEOUT_S + 60.0


def _during(tb, fake_reply, fail, script=None):
    """One submission while a fake server holds the bridge's socket; (sbatch's result, the
    controller's log written since the submission began). The default job carries no estimate, so
    that the Lua cannot decide it by itself (testbed.toml allows #VEST directives: Python must read
    them) and the fail mode applies."""
    tb.configure(fail=fail, timeout_s=BRIDGE_TIMEOUT_S)
    tb.stop_server()
    tb.wait_budget_refilled()        # earlier faults drew on the bucket: this call must try the server
    fake = FakeServer(str(tb.socket_path), fake_reply)
    log_start = len(ctld_log(tb))
    try:
        box = {}
        job = script if script is not None else plain_script()
        t = threading.Thread(target=lambda: box.update(p=sbatch(tb, job, timeout=SBATCH_LIMIT_S)))
        t.start()
        assert fake.accepted.wait(SBATCH_LIMIT_S), "the plugin never connected to the bridge's socket"
        sinfo_answers(tb)                     # while the plugin waits on the bad server
        t.join()
        return box["p"], ctld_log(tb)[log_start:]
    finally:
        fake.close()
        tb.start_server()


def _fail_mode_line(log: str, fail: str) -> str:
    lines = [ln for ln in log.splitlines() if f"fail={fail} " in ln and "vest-bridge: action=" in ln]
    assert len(lines) == 1, log
    return lines[0]


@pytest.mark.parametrize("fail", ["open", "closed"])
def test_server_hung_past_timeout(tb, fail):
    """The bridge gives up at the call's limit (the timeout, or less when the budget across calls
    holds less): the outcome its fail mode says and its log line, whose ms= (the plugin's own clock)
    is at least that limit less the 50 ms the Lua keeps in hand (job_submit.lua ask_server); the
    submission ends within sbatch's limit (timeout + margin)."""
    p, log = _during(tb, None, fail)
    line = _fail_mode_line(log, fail)
    assert "reason=bridge-timeout" in line and "via=server" in line, line
    limit_ms = float(re.search(r" limit_ms=([0-9.]+)", line).group(1))
    assert 0 < limit_ms <= BRIDGE_TIMEOUT_S * 1000, line
    assert float(re.search(r" ms=([0-9.]+)", line).group(1)) >= limit_ms - 50, line
    if fail == "open":
        assert p.returncode == 0, p.err
        assert job_of(tb, p.name)[0]["partition"] == "v100"       # let through undecided
    else:
        assert p.returncode == 1 and "memory check is unavailable" in p.err
        # the plugin's own refusal (its log line above), not sbatch giving up while the controller
        # creates the job anyway (past MessageTimeout): so no job record is to come
        assert queued(tb, p.name) == []


@pytest.mark.parametrize("reply", [
    b"garbage\n",
    b'{"v":1,"action":"modify","reason":"x","set":{"partition":"a100; touch /tmp/pwned"},"msg":"","log":"x","errno":0}\n',
    b'{"v":1,"action":"launch","msg":"","log":"x"}\n',
    b"[" * 5000 + b"\n",
])
@pytest.mark.parametrize("fail", ["open", "closed"])
def test_server_answering_garbage(tb, reply, fail):
    p, log = _during(tb, reply, fail)
    assert "reason=bridge-" in _fail_mode_line(log, fail)
    assert p.returncode == (0 if fail == "open" else 1), p.err
    if fail == "closed":
        assert queued(tb, p.name) == []
    else:
        assert job_of(tb, p.name)[0]["partition"] == "v100"
    assert not os.path.exists("/tmp/pwned")


@pytest.mark.parametrize("reply", [None, b"garbage\n"])
@pytest.mark.parametrize("fail", ["open", "closed"])
def test_a_job_with_vsbatchs_estimate_is_decided_by_the_lua_when_the_server_fails(tb, reply, fail):
    """A server that hangs or answers garbage: the job carrying vsbatch's estimate is still decided
    (rerouted to a100) by job_submit.lua itself, under either fail mode."""
    p, log = _during(tb, reply, fail, script=estimate_line_script(20))
    assert p.returncode == 0, p.err
    assert job_of(tb, p.name)[0]["partition"] == "a100"
    (line,) = [ln for ln in log.splitlines() if f"job={p.name} " in ln]
    assert "action=modify reason=rerouted" in line and "via=lua after=server-" in line, line


def test_server_killed_the_lua_decides_and_the_per_call_program_reads_directives(tb):
    tb.stop_server(kill=True)                       # leaves the socket file, as a crash would
    tb.wait_budget_refilled()
    log_start = len(ctld_log(tb))
    p = sbatch(tb, estimate_line_script(20))
    assert p.returncode == 0, p.err
    assert job_of(tb, p.name)[0]["partition"] == "a100"
    q = sbatch(tb, plain_script())
    assert q.returncode == 0, q.err
    log = ctld_log(tb)[log_start:]
    (lp,) = [ln for ln in log.splitlines() if f"job={p.name} " in ln]
    (lq,) = [ln for ln in log.splitlines() if f"job={q.name} " in ln]
    assert "via=lua after=server-connect" in lp, lp
    assert "via=program" in lq and "reason=no-estimate" in lq, lq


@pytest.mark.parametrize("fail", ["open", "closed"])
def test_server_killed_and_config_broken(tb, fail):
    tb.configure(fail=fail)
    tb.stop_server(kill=True)
    tb.wait_budget_refilled()
    tb.write_site("this is [not toml\n")             # the Lua keeps the last good facts
    p = sbatch(tb, plain_script())                     # the Lua leaves it to the program, which fails
    sinfo_answers(tb)
    assert p.returncode == (0 if fail == "open" else 1), p.err
    if fail == "closed":
        assert queued(tb, p.name) == []
    (line,) = [ln for ln in ctld_log(tb).splitlines() if f"job={p.name}" in ln]
    # the program answers "error" (no site config); on a loaded machine its Python start may
    # instead run past the call's limit: either way the fail mode, never a decision
    assert re.search(r"reason=bridge-(error|timeout|budget) ", line), line


@pytest.mark.parametrize("fail", ["open", "closed"])
def test_request_in_flight_when_the_server_dies_is_decided(tb, fail):
    """By the Lua for a job with vsbatch's estimate, by the per-call program for one without (the
    Lua leaves reading a script for #VEST lines to Python)."""
    tb.configure(fail=fail, timeout_s=2)
    tb.stop_server()
    tb.wait_budget_refilled()
    fake = FakeServer(str(tb.socket_path), b"")       # reads the request, closes without an answer
    log_start = len(ctld_log(tb))
    try:
        p = sbatch(tb, estimate_line_script(20))
        tb.wait_budget_refilled()
        q = sbatch(tb, plain_script())
    finally:
        fake.close()
        tb.start_server()
    log = ctld_log(tb)[log_start:]
    assert fake.accepted.is_set()
    assert p.returncode == 0 and q.returncode == 0, (p.err, q.err)
    assert job_of(tb, p.name)[0]["partition"] == "a100"           # decided, not let through
    (line,) = [ln for ln in log.splitlines() if f"job={p.name} " in ln]
    assert "action=modify reason=rerouted" in line and "via=lua after=server-io" in line, line
    (line,) = [ln for ln in log.splitlines() if f"job={q.name} " in ln]
    assert "via=program after=server-io" in line, line


@pytest.mark.parametrize("fail", ["open", "closed"])
def test_budget_across_calls_with_the_server_down(tb, fail):
    """A burst with no server, of jobs the Lua leaves to Python (no estimate, #VEST directives
    allowed: Python reads the script): the per-call program's time, summed over the calls, stays within the
    bucket (fallback_burst_ms plus fallback_ms_per_s over the burst, plus one call past it); the
    other calls take the fail mode at once (reason=bridge-budget); none is admitted undecided
    under fail closed; the breaker opened once and closes when the server is back."""
    tb.configure(fail=fail, fallback_ms_per_s=100, fallback_burst_ms=600, timeout_s=2)
    warm = sbatch(tb, estimate_line_script(20))          # the server answers: the breaker is closed
    assert warm.returncode == 0 and f"job={warm.name} " in ctld_log(tb).rsplit("breaker=", 1)[-1], warm.err
    tb.stop_server(kill=True)
    tb.wait_budget_refilled()
    log_start = len(ctld_log(tb))
    results: list = []
    def client():
        for _ in range(3):
            results.append(sbatch(tb, plain_script(),
                                  timeout=SBATCH_LIMIT_S))
    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tb.start_server()
    after = sbatch(tb, estimate_line_script(20))
    log = ctld_log(tb)[log_start:]
    lines = [ln for ln in log.splitlines() if "vest-bridge: action=" in ln]
    assert len(lines) == len(results) + 1, log
    assert log.count("breaker=open") == 1 and log.count("breaker=closed") == 1, log
    assert any("reason=bridge-budget" in ln and "via=lua" in ln for ln in lines), log
    # Each call's whole time, by the plugin's own clock: lua_ms= on a decision, ms= on a fail mode.
    spent = sum(float(re.search(r" lua_ms=([0-9.]+)", ln).group(1)) if " lua_ms=" in ln
                else float(re.search(r" ms=([0-9.]+)", ln).group(1)) for ln in lines[:-1])
    stamps = [datetime.datetime.fromisoformat(ln.split("]", 1)[0].lstrip("[")) for ln in lines[:-1]]
    span_s = (max(stamps) - min(stamps)).total_seconds() + 1.0   # + the first call's own time
    assert spent <= 600 + 100 * span_s + 600, (spent, span_s, log)
    for r in results:
        jobs = queued(tb, r.name)
        if fail == "closed":     # decided by the program (unknown_jobs = allow), or refused
            assert r.returncode == 0 and jobs[0]["partition"] == "v100" or r.returncode == 1 and jobs == [], r.err
        else:
            assert r.returncode == 0, r.err
    assert after.returncode == 0 and job_of(tb, after.name)[0]["partition"] == "a100"
    assert "via=server" in lines[-1], lines[-1]


def test_server_restarted_by_its_supervisor_is_found_without_a_controller_reload(tb):
    """Restart=always, RestartSec=0 (the shipped unit) played by the testbed's supervisor: after a
    SIGKILL the new server is asked again (its rewrite of vest-bridge.json closes the breaker) with
    no `scontrol reconfigure`."""
    before = tb.status()["pid"]
    tb.supervise()
    try:
        tb.server.kill()
        def new_server():
            try:
                return tb.status()["pid"] != before
            except OSError:
                return False
        deadline = time.monotonic() + 60                  # a hang bound, not a speed check
        while not new_server():
            assert time.monotonic() < deadline, "the supervisor did not bring a server back"
            time.sleep(0.05)
        log_start = len(ctld_log(tb))
        p = sbatch(tb, estimate_line_script(20))
        assert p.returncode == 0 and job_of(tb, p.name)[0]["partition"] == "a100", p.err
        line = [ln for ln in ctld_log(tb)[log_start:].splitlines() if f"job={p.name} " in ln][0]
        assert "via=server" in line, line
        assert tb.restarts == 1
    finally:
        tb.stop_server()


def test_config_broken_while_serving_keeps_last_good(tb):
    tb.configure(on_user_choice_too_small="refuse")
    tb.configure("[policy\nbroken = \n")
    assert tb.status()["problem"]
    p = sbatch(tb, estimate_line_script(20))
    assert p.returncode == 1 and "does not fit" in p.err       # the last good rules still hold
    assert "result=failed" in tb.log_path.read_text()


# ---------------------------------------------------------------- hostile input

HOSTILE = "'\"; $(touch /tmp/pwned) `touch /tmp/pwned` | & > < \\ %s %n {} \t"


def test_shell_metacharacters_in_every_field(tb):
    p = sbatch(tb, estimate_line_script(20), f"--comment={HOSTILE}", "--chdir=/tmp",
               f"--job-name=x{HOSTILE}")
    assert p.returncode == 0, p.err
    assert not os.path.exists("/tmp/pwned")
    line = [ln for ln in ctld_log(tb).splitlines() if "action=modify" in ln][-1]
    assert "'" not in line and '"' not in line and "$(" not in line       # encoded, not raw


def test_metacharacters_through_the_fallback_program(tb):
    tb.stop_server(kill=True)
    tb.wait_budget_refilled()
    p = sbatch(tb, estimate_line_script(20, extra=f"# {HOSTILE}"), f"--comment={HOSTILE}")
    assert p.returncode == 0 and not os.path.exists("/tmp/pwned")


def test_very_long_comment_and_binary_script(tb):
    # Binary bytes after the estimate line: the hash is over the bytes, so the estimate still holds.
    body = attach(plain_script(extra="# \udcff\udcfe\x01\x7f binary"),
                  make_payload({"v100": MemoryEstimate("v100-16gb", 16 * GiB, 20 * GiB, 20 * GiB),
                                "a100": MemoryEstimate("a100-40gb", 40 * GiB, 20 * GiB, 20 * GiB)}))
    p = sbatch(tb, body.encode("utf-8", "surrogateescape"), "--comment=" + "c" * 1000)
    assert p.returncode == 0, p.err
    assert job_of(tb, p.name)[0]["partition"] == "a100"
    assert f"job={p.name} " in ctld_log(tb)
    # A comment Slurm itself finds too long: the bridge still decides, then Slurm refuses the job.
    p = sbatch(tb, body.encode("utf-8", "surrogateescape"), "--comment=" + "c" * 50_000)
    assert f"job={p.name} " in ctld_log(tb)
    assert p.returncode == 1 and "too long" in p.err
    assert queued(tb, p.name) == []


def test_script_of_several_mb(tb):
    s = estimate_line_script(20, extra=("# " + "x" * 1000 + "\n") * 3000)  # about 3 MB, hashed
    p = sbatch(tb, s)
    assert p.returncode == 0, p.err
    assert job_of(tb, p.name)[0]["partition"] == "a100"                   # the hash still checks out


def test_forged_and_malformed_estimates_are_not_trusted(tb):
    tb.configure(unknown_jobs="refuse")
    good = estimate_line_script(4)
    tampered = good.replace("true\n", "rm -rf ~\n")                       # script changed after vsbatch
    garbage = good.split("\n", 2)
    garbage[1] = "#VEST-ESTIMATE v1 !!!not-base64!!!"
    for script in (tampered, "\n".join(garbage), good.replace("#VEST-ESTIMATE v1", "#VEST-ESTIMATE v9")):
        p = sbatch(tb, script)
        assert p.returncode == 1 and "no usable memory estimate" in p.err, p.err
        assert queued(tb, p.name) == []


def test_testbed_script_start_bridge(tmp_path, slurm_prereqs):
    """scripts/slurm-testbed.sh start DIR --bridge: JobSubmitPlugins=lua, this job_submit.lua and a
    decision server configured from site-config/testbed.toml."""
    from pathlib import Path

    from vest_slurm.bridge.server import query_status
    script = Path(__file__).resolve().parent.parent / "scripts" / "slurm-testbed.sh"
    d = tmp_path / "tb"
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    run = lambda *a: subprocess.run([str(script), *a], capture_output=True, text=True, env=env, timeout=90)
    started = run("start", str(d), "--bridge")
    try:
        assert started.returncode == 0, started.stderr
        conf = (d / "etc" / "slurm.conf").read_text()
        assert "JobSubmitPlugins=lua" in conf
        assert (d / "etc" / "job_submit.lua").resolve() == (script.parent.parent / "site-config" / "job_submit.lua")
        facts = json.loads((d / "etc" / "vest-bridge.json").read_text())
        st = query_status(facts["socket_path"])
        assert st["generation"] >= 1 and st["fail"] == "open" and st["config"] == str(d / "etc" / "vest-site.toml")
    finally:
        stopped = run("stop", str(d))
    assert stopped.returncode == 0, stopped.stderr
