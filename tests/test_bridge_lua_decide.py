"""job_submit.lua's own decision (used when no server answers) against the Python decision
(bridge/decide.py), in the Lua 5.1 that slurmctld links (tests/lua_run.py): on generated site rules
and job descriptions, every answer the Lua gives is the server's answer (action, reason, fields set,
the user's message, errno, AdminComment record: all but the admin log line), and the jobs vsbatch
and sbatch write are decided by the Lua itself, not left to Python."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lua_run import REPO, LuaJob, liblua
from vest_slurm.bridge.decide import decide
from vest_slurm.bridge.luaconf import write_lua_conf
from vest_slurm.bridge.protocol import NO_VAL, parse_request
from vest_slurm.estimate.record import MemoryEstimate
from vest_slurm.site.config import load_site_config
from vest_slurm.slurm.attach import attach, make_payload

pytestmark = pytest.mark.skipif(liblua() is None, reason="liblua5.1 (slurmctld's Lua) is not installed")
GiB = 1 << 30
MiB = 1 << 20
SITES = {name: load_site_config(str(REPO / "site-config" / name)) for name in ("testbed.toml", "example-site.toml")}
USERS = ("alice", "bob", "root")


@pytest.fixture(scope="module")
def lua(tmp_path_factory):
    d = tmp_path_factory.mktemp("lua")
    write_lua_conf(SITES["testbed.toml"], d / "vest-bridge.json")
    L = LuaJob(d)
    yield L, d
    L.close()


@st.composite
def site_rules(draw):
    site = SITES[draw(st.sampled_from(sorted(SITES)))]
    pol, br = site.policy, site.bridge
    msgs = pol.messages
    if draw(st.booleans()):
        msgs = dataclasses.replace(msgs, reroute=draw(st.sampled_from([
            msgs.reroute, "Moved to {partition} ({gres}), {user}: {requested} too small. See {help_url}.",
            "Moved. {{literal braces}} {partition!r}", "  padded {gres}  ", "{partition:>10}"])),
            refuse=draw(st.sampled_from([msgs.refuse, "", "Ask {user} about {reason}. Help: {help_url}"])))
    pol = dataclasses.replace(
        pol, headroom_percent=draw(st.sampled_from([0.0, 5.0, 10.0, 12.5, 33.3])),
        headroom_bytes=draw(st.sampled_from([0, 256 * MiB, 1000 * MiB + 7])),
        selection=draw(st.sampled_from(["smallest-fit", "cost"])),
        on_user_choice_too_small=draw(st.sampled_from(["reroute", "warn", "refuse"])),
        exempt_users=draw(st.sampled_from([(), ("bob",)])),
        help_url=draw(st.sampled_from(["", "https://help.example/gpu"])), messages=msgs)
    br = dataclasses.replace(br, unknown_jobs=draw(st.sampled_from(["allow", "warn", "refuse"])),
                             allow_vest_directives=draw(st.booleans()))
    gpus = tuple(dataclasses.replace(g, cost=draw(st.sampled_from([None, 1.0, 2.5, g.cost])),
                                     memory_bytes=draw(st.sampled_from([None, g.memory_bytes, 20 * GiB])))
                 for g in site.gpus)
    parts = tuple(dataclasses.replace(p, max_gpus_per_job=draw(st.sampled_from([None, 2, 8])),
                                      nodes=draw(st.sampled_from([None, 1, 3])),
                                      cost=draw(st.sampled_from([None, p.cost, 0.5])))
                  for p in site.partitions)
    return dataclasses.replace(site, policy=pol, bridge=br, gpus=gpus, partitions=parts)


def _script(draw, site, partition, gres, total: int) -> str | None:
    kind = draw(st.sampled_from(["estimate", "estimate", "estimate", "plain", "none", "tampered", "foreign"]))
    body = "\n".join(["#!/bin/bash", f"#SBATCH --partition={partition}" if partition else "",
                      f"#SBATCH --gres={gres}" if gres else "", draw(st.sampled_from(["", "# é ünïcode", "#VEST model=x"])),
                      "srun true", ""])
    if kind == "none":
        return None
    if kind == "plain":
        return body
    names = [g.name for g in site.gpus] + ["mi300"]
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    est = {}
    for t in chosen:
        g = site.gpu(t)
        profile = g.profile if g is not None and draw(st.integers(0, 9)) else "other-profile"
        need = draw(st.one_of(st.integers(1, 100 * 1024), st.integers(8 * 1024, 40 * 1024))) * MiB \
            + draw(st.integers(0, MiB - 1))
        est[t] = MemoryEstimate(profile, 0, draw(st.sampled_from([need, need // 2])), need)
    num = total if draw(st.integers(0, 4)) else draw(st.sampled_from([1, 2, 4, 8]))
    text = attach(body, make_payload(est, num_gpus=num, batch_size=draw(st.sampled_from([None, 32]))))
    if kind == "tampered":
        text = text.replace("srun true", "srun false")
    if kind == "foreign":
        head, line, rest = text.split("\n", 2)
        text = "\n".join([head, line.replace("v1", "v2"), rest])
    return text


@st.composite
def job_desc(draw, site):
    parts = [p.name for p in site.partitions]
    types = [g.name for g in site.gpus] + ["k80"]
    partition = draw(st.one_of(st.none(), st.sampled_from(parts + ["debug", ""]),
                               st.lists(st.sampled_from(parts + ["cpu"]), min_size=2, max_size=3, unique=True).map(",".join)))
    n = draw(st.sampled_from([1, 1, 2, 4, 8, 16]))
    t = draw(st.one_of(st.none(), st.sampled_from(types)))
    pre = draw(st.sampled_from(["gres:", "gres/"]))
    typed = f"gpu:{t}:{n}" if t else f"gpu:{n}"
    form = draw(st.sampled_from(["gres", "gres", "gres+shard", "gpus", "gpus-per-task", "none", "odd"]))
    job: dict = {}
    if form == "gres":
        job["tres_per_node"] = pre + typed
    elif form == "gres+shard":
        job["tres_per_node"] = f"{pre}{typed},{pre}shard:2"
    elif form == "gpus":
        job["tres_per_job"] = pre + typed
    elif form == "gpus-per-task":
        job["tres_per_task"] = pre + typed
        job["num_tasks"] = draw(st.sampled_from([1, 2, NO_VAL]))
    elif form == "odd":
        job["tres_per_node"] = draw(st.sampled_from([f"{pre}gpu:a100:1,{pre}gpu:v100:1", f"{pre}gpu::1",
                                                     f"{pre}gpu:a100:x", f"{pre}gpu:a 100:1", f"{pre}none"]))
    job["min_nodes"] = draw(st.sampled_from([1, 1, 2, NO_VAL]))
    nodes = job["min_nodes"] if job["min_nodes"] != NO_VAL else 1
    tasks = job.get("num_tasks", NO_VAL)
    total = {"gres": n * nodes, "gres+shard": n * nodes, "gpus": n,
             "gpus-per-task": n * (tasks if tasks != NO_VAL else nodes)}.get(form, 1)
    if partition is not None:
        job["partition"] = partition
    job["account"] = draw(st.sampled_from(["physics", "physics", "physics", "admins", "bio"]))
    job["name"] = draw(st.sampled_from(["train", "x y 'z'"]))
    job["user_name"] = draw(st.sampled_from(USERS + ("alice",) * 6))
    script = _script(draw, site, partition, None, total)
    if script is not None:
        job["script"] = script
    return job


def _python(job: dict, uid: int, site) -> dict:
    req = {"v": 1, "uid": uid, **{k: v for k, v in job.items() if k != "user_name"}}
    d = decide(parse_request(json.dumps(req).encode("utf-8", "surrogateescape")), site,
               users=lambda _uid: job["user_name"])
    out = json.loads(d.wire())
    out.pop("log")
    return out


def _lua(L, job: dict, uid: int) -> tuple[dict | None, str | None]:
    r = L.decide_local(job, uid)
    a = r["answer"]
    if a is None:
        return None, r["why"]
    a.pop("log")
    if a.get("set") == []:              # cjson writes an empty table as []
        a["set"] = {}
    return a, None


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
