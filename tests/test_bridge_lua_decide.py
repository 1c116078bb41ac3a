"""job_submit.lua's own decision (used when no server answers) against the Python decision
(bridge/decide.py), in the Lua 5.1 that slurmctld links (tests/lua_run.py): on generated site rules
and job descriptions, every answer the Lua gives is the server's answer (action, reason, fields set,
the user's message, errno, AdminComment record: all but the admin log line), and the jobs vsbatch
and sbatch write are decided by the Lua itself, not left to Python."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_targets import LUA_SITES as SITES, job_desc, lua_answer as _lua, python_answer as _python, site_rules
from lua_run import LuaJob, liblua
from vest_slurm.bridge.luaconf import write_lua_conf
from vest_slurm.bridge.protocol import NO_VAL
from vest_slurm.estimate.record import MemoryEstimate
from vest_slurm.slurm.attach import attach, make_payload

pytestmark = pytest.mark.skipif(liblua() is None, reason="liblua5.1 (slurmctld's Lua) is not installed")
GiB = 1 << 30


@pytest.fixture(scope="module")
def lua(tmp_path_factory):
    d = tmp_path_factory.mktemp("lua")
    write_lua_conf(SITES["testbed.toml"], d / "vest-bridge.json")
    L = LuaJob(d)
    yield L, d
    L.close()


COUNTS = {"decided": 0, "left": 0}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_the_luas_answer_is_the_servers(lua, data):
    L, d = lua
    site = data.draw(site_rules())
    write_lua_conf(site, d / "vest-bridge.json")
    job = data.draw(job_desc(site))
    uid = 0 if job["user_name"] == "root" else 1001
    a, why = _lua(L, job, uid)
    if a is None:
        COUNTS["left"] += 1
        return
    COUNTS["decided"] += 1
    assert a == _python(job, uid, site), (job, why)


def test_jobs_vsbatch_writes_are_decided_by_the_lua(lua):
    """The plain forms (sbatch --gres/--gpus with vsbatch's estimate, CPU jobs, GPU jobs without an
    estimate where directives are off) never need Python; each answer is the server's."""
    L, d = lua
    site = SITES["testbed.toml"]
    site = dataclasses.replace(site, bridge=dataclasses.replace(site.bridge, allow_vest_directives=False))
    write_lua_conf(site, d / "vest-bridge.json")
    est = {t: MemoryEstimate(p, 0, need, need) for t, p, need in
           (("v100", "v100-16gb", 20 * GiB), ("a100", "a100-40gb", 20 * GiB), ("h100", "h100-80gb", 20 * GiB))}
    body = "#!/bin/bash\n#SBATCH --gres=gpu:v100:1\nsrun python train.py\n"
    jobs = [
        {"partition": "v100", "tres_per_node": "gres:gpu:v100:1", "script": attach(body, make_payload(est))},
        {"tres_per_node": "gres/gpu:2", "script": attach(body, make_payload(est, num_gpus=2))},
        {"tres_per_job": "gres:gpu:a100:1", "script": attach(body, make_payload(est))},
        {"partition": "v100", "tres_per_node": "gres:gpu:v100:1",
         "script": attach(body, make_payload({"v100": MemoryEstimate("v100-16gb", 0, 200 * GiB, 200 * GiB)}))},
        {"script": "#!/bin/bash\nsrun hostname\n"},
        {"partition": "v100", "tres_per_node": "gres:gpu:v100:1", "script": body},
    ]
    actions = []
    for job in jobs:
        job = {**job, "user_name": "alice", "min_nodes": 1, "num_tasks": NO_VAL}
        a, why = _lua(L, job, 1001)
        assert a is not None, (job, why)
        assert a == _python(job, 1001, site)
        actions.append((a["action"], a["reason"]))
    assert actions == [("modify", "rerouted"), ("modify", "placed"), ("allow", "fits"), ("refuse", "no-fit"),
                       ("allow", "no-gpu"), ("allow", "no-estimate")]


def test_what_the_lua_leaves_to_python(lua):
    """Directives to read, an estimate line not in vsbatch's canonical form, a request Python would
    call unreadable: the Lua gives no answer (the server or the per-call program decides)."""
    L, d = lua
    site = SITES["testbed.toml"]               # allow_vest_directives = true
    write_lua_conf(site, d / "vest-bridge.json")
    est = {"a100": MemoryEstimate("a100-40gb", 0, 20 * GiB, 20 * GiB)}
    body = "#!/bin/bash\nsrun true\n"
    good = attach(body, make_payload(est))
    head, line, rest = good.split("\n", 2)
    cases = {
        "directives": {"tres_per_node": "gres:gpu:1", "script": "#!/bin/bash\n#VEST model=x\n"},
        "estimate-hash": {"tres_per_node": "gres:gpu:1", "script": good.replace("srun true", "srun false")},
        "estimate-not-canonical": {"tres_per_node": "gres:gpu:1", "script": "\n".join([head, line + "AA", rest])},
        "request-gres": {"tres_per_node": "gres:gpu:a100:x", "script": good},
        "request-field-partition": {"partition": "a b", "tres_per_node": "gres:gpu:1", "script": good},
    }
    for why, job in cases.items():
        r = L.decide_local({**job, "user_name": "alice"}, 1001)
        assert r["answer"] is None and r["why"].startswith(why.split("-")[0]), (why, r)


def test_the_lua_decides_most_generated_jobs():
    """A check on the generated test above: the comparison was not vacuous."""
    if COUNTS["decided"] + COUNTS["left"] == 0:
        pytest.skip("run with test_the_luas_answer_is_the_servers")
    assert COUNTS["decided"] >= 100, COUNTS
