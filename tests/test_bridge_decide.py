"""The bridge's decision and protocol without Slurm: pure functions over the request bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from vest_slurm.slurm.attach import attach, make_payload
from vest_slurm.bridge.decide import decide, decide_bytes, request_options
from vest_slurm.bridge.luaconf import facts
from vest_slurm.bridge.protocol import MAX_REQUEST_BYTES, JobRequest, kv, parse_request
from vest_slurm.estimate.record import MemoryEstimate
from vest_slurm.site.config import load_site_config

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30
SITE = load_site_config(str(REPO / "site-config" / "testbed.toml"))
NAMES = {1001: "alice", 1002: "bob"}.get


def site(**bridge):
    return replace(SITE, bridge=replace(SITE.bridge, **bridge))


def policy_site(**policy):
    return replace(SITE, policy=replace(SITE.policy, **policy))


def script(need_gib=20.0, num_gpus=1, body="true\n", profiles=None):
    prof = profiles or {"v100": "v100-16gb", "a100": "a100-40gb", "h100": "h100-80gb"}
    est = {t: MemoryEstimate(p, 0, int(need_gib * GiB), int(need_gib * GiB)) for t, p in prof.items()}
    return attach("#!/bin/bash\n#SBATCH --gres=gpu:v100:1\n" + body, make_payload(est, num_gpus=num_gpus))


def req(**kw):
    base = dict(uid=1001, partition="v100", tres_per_node="gres:gpu:v100:1", script=script())
    base.update(kw)
    return JobRequest(**base)


def test_reroute_sets_partition_and_gres_in_the_controllers_spelling():
    d = decide(req(), SITE, users=NAMES)
    assert d.action == "modify" and d.reason == "rerouted"
    assert dict(d.set) == {"partition": "a100", "tres_per_node": "gres:gpu:a100:1"}
    assert "moved to partition a100" in d.msg
    d2 = decide(req(tres_per_node="gres/gpu:v100:1"), SITE, users=NAMES)
    assert dict(d2.set)["tres_per_node"] == "gres/gpu:a100:1"


def test_refuse_when_policy_refuses():
    d = decide(req(), policy_site(on_user_choice_too_small="refuse"), users=NAMES)
    assert d.action == "refuse" and d.errno == 2072 and "refused" in d.msg


def test_fits_is_allowed_unchanged():
    d = decide(req(script=script(4)), SITE, users=NAMES)
    assert (d.action, d.reason, d.set) == ("allow", "fits", ())


def test_no_partition_is_placed_on_smallest_fit():
    d = decide(req(partition=None, tres_per_node="gres:gpu:1"), SITE, users=NAMES)
    assert d.action == "modify" and dict(d.set)["partition"] == "a100"


@pytest.mark.parametrize("policy,action", [("allow", "allow"), ("warn", "allow"), ("refuse", "refuse")])
def test_unknown_jobs(policy, action):
    d = decide(req(script="#!/bin/bash\ntrue\n"), site(unknown_jobs=policy), users=NAMES)
    assert d.action == action and d.reason == "no-estimate"
    assert bool(d.msg) == (policy != "allow")


def test_cpu_job_passes_even_when_unknown_refused():
    d = decide(req(partition=None, tres_per_node=None, script="#!/bin/bash\ntrue\n"),
               site(unknown_jobs="refuse"), users=NAMES)
    assert (d.action, d.reason) == ("allow", "no-gpu")


def test_root_and_exempt_pass():
    s = policy_site(exempt_users=("bob",), exempt_accounts=("bench",), on_user_choice_too_small="refuse")
    assert decide(req(uid=0, script=script(500)), s, users=NAMES).reason == "exempt"
    assert decide(req(uid=1002, script=script(500)), s, users=NAMES).reason == "exempt"
    assert decide(req(account="bench", script=script(500)), s, users=NAMES).reason == "exempt"
    assert decide(req(script=script(500)), s, users=NAMES).action == "refuse"


@pytest.mark.parametrize("text,reason", [
    (script().replace("true\n", "false\n"), "estimate-hash-mismatch"),
    (script().replace("#VEST-ESTIMATE v1", "#VEST-ESTIMATE v7"), "estimate-version"),
    ("#!/bin/bash\n#VEST-ESTIMATE v1 ###\ntrue\n", "estimate-malformed"),
    ("#!/bin/bash\n#VEST-ESTIMATE v1 " + "A" * 20000 + "\ntrue\n", "estimate-too-long"),
    (script(num_gpus=2), "estimate-gpu-count"),
    (script(profiles={"v100": "v100-32gb"}), "estimate-no-site-gpu"),
])
def test_untrusted_estimates_follow_unknown_job_policy(text, reason):
    d = decide(req(script=text), site(unknown_jobs="refuse"), users=NAMES)
    assert (d.action, d.reason) == ("refuse", reason)


def test_capacity_comes_from_the_site_not_the_estimate():
    # the forged estimate claims a capacity of 0 (see script()): placement still uses 16 GiB for v100
    assert decide(req(script=script(4)), SITE, users=NAMES).reason == "fits"


def test_hostile_fields_are_encoded_in_the_log_and_never_set():
    evil = "x'\"; $(rm -rf /) `id` |&<>\n\\ %s\x00\udcff"
    d = decide(req(name=evil, comment=evil * 1000, work_dir=evil, account=evil), SITE, users=NAMES)
    assert d.action == "modify"
    assert "\n" not in d.log and "'" not in d.log and '"' not in d.log and " $(" not in d.log
    assert all(k in ("partition", "tres_per_node") for k, _ in d.set)


def test_unreadable_gpu_request_is_an_unknown_job():
    d = decide(req(tres_per_node="gres:gpu:v100:1,gres:gpu:a100:1"), site(unknown_jobs="refuse"), users=NAMES)
    assert d.reason == "gpu-request-unreadable" and d.action == "refuse"


def test_tres_forms():
    wire = json.dumps({"v": 1, "uid": 1001, "partition": "v100", "tres_per_job": "gres:gpu:a100:2",
                       "tres_per_task": "gres/gpu:1", "min_nodes": 2, "num_tasks": 4294967294,
                       "ntasks_per_node": 1.8446744073709552e19}).encode()
    opts = dict(request_options(parse_request(wire)))
    assert opts == {"partition": "v100", "gpus": "a100:2", "gpus-per-task": "1", "nodes": "2"}


@pytest.mark.parametrize("data,reason", [
    (b"garbage", "request-malformed"), (b"[1,2]", "request-malformed"), (b'{"v":2,"uid":1}', "request-version"),
    (b'{"v":1}', "request-malformed"), (b'{"v":1,"uid":1,"name":5}', "request-malformed"),
    (b'{"v":1,"uid":-1}', "request-malformed"), (b"[" * 100000, "request-malformed"),
    (b"x" * (MAX_REQUEST_BYTES + 1), "request-too-large"),
])
def test_bad_requests_are_errors_never_exceptions(data, reason):
    d = decide_bytes(data, SITE)
    assert (d.action, d.reason) == ("error", reason)


def test_broken_site_is_an_error():
    assert decide_bytes(b'{"v":1,"uid":5}', None, "bad toml").action == "error"


def test_binary_and_multi_mb_script_over_the_wire():
    """A 5 MB script with undecodable bytes is decided, not refused as malformed. How long decisions
    take is measured by scripts/bench_bridge.py (sbatch through the bridge) and
    scripts/bench_decide_startup.py (the per-call program), on ordinary scripts."""
    text = script(body="# \udcff\udcfe\x01 binary\n" + ("# " + "y" * 998 + "\n") * 5000)   # 5 MB
    wire = json.dumps({"v": 1, "uid": 1001, "partition": "v100", "tres_per_node": "gres:gpu:v100:1",
                       "script": text}, ensure_ascii=False).encode("utf-8", "surrogateescape")
    assert len(wire) > 5_000_000
    d = decide_bytes(wire, SITE, users=NAMES)
    assert d.action == "modify", d.log


def test_directives_only_when_allowed_and_in_budget():
    text = "#!/bin/bash\n#VEST --model torchvision:resnet50 --batch-size 64\ntrue\n"
    calls = []

    def est(argv, n, profiles):
        calls.append(argv)
        return {"a100-40gb": (20 * GiB, 20 * GiB)}

    d = decide(req(script=text), site(allow_vest_directives=True), users=NAMES, directives=est)
    assert d.action == "modify" and "source=directives" in d.log and dict(d.set)["partition"] == "a100"
    # the worker is sent the allow-listed spec's own options, not the script's words
    assert calls == [("--model", "torchvision:resnet50", "--batch-size", "64", "--input", "default")]
    over = decide(req(script=text), site(allow_vest_directives=True, unknown_jobs="refuse"), users=NAMES,
                  directives=lambda *a: None)
    assert over.reason == "directives-over-budget" and over.action == "refuse"
    off = decide(req(script=text), site(allow_vest_directives=False), users=NAMES, directives=est)
    assert off.reason == "no-estimate"
    here = decide(req(script=text), site(allow_vest_directives=True), users=NAMES)
    assert here.reason == "directives-not-here"


@pytest.mark.parametrize("line, reason", [
    ("--model /home/me/evil.py:build --batch-size 1", "directives-refused-model-code"),
    ("--model subprocess:getoutput --model-args '{\"cmd\": \"id\"}' --batch-size 1", "directives-refused-model-code"),
    ("--model torchvision:resnet18 --batch-size 1 --optimizer evil:Opt", "directives-refused-bad-value"),
    ("--model hf:/home/me/llama-3-8b --batch-size 1", "directives-refused-model-path"),
    ("--model timm:resnet50 --batch-size 1 --model-arg checkpoint_path=x.pth", "directives-refused-model-arg-loads"),
])
def test_directives_outside_the_allow_list_never_reach_the_estimator(line, reason):
    text = f"#!/bin/bash\n#SBATCH --gres=gpu:v100:1\n#VEST {line}\ntrue\n"
    calls = []
    d = decide(req(script=text), site(allow_vest_directives=True, unknown_jobs="refuse"), users=NAMES,
               directives=lambda *a: calls.append(a))
    assert d.action == "refuse" and d.reason == reason and calls == []
    assert "unknown_jobs=refuse" in d.log and "detail=" in d.log
    assert "no usable memory estimate" in d.msg and "never" in d.msg   # the user is told why
    # the per-call program (no estimator) logs the same refusal
    assert decide(req(script=text), site(allow_vest_directives=True), users=NAMES).reason == reason


def test_kv_cannot_forge_fields():
    assert kv("a b=c") == "a%20b%3Dc" and kv(None) == "-" and kv("gpu:a100:1") == "gpu:a100:1"


def test_lua_facts_resolve_exempt_users_to_uids():
    f = facts(policy_site(exempt_users=("root", "no-such-user-xyz")))
    assert f["exempt_uids"] == [0] and f["fail"] == "open" and f["timeout_s"] == 2.0


def test_per_call_program_answers_one_line_whatever_the_input():
    cfg = str(REPO / "site-config" / "testbed.toml")
    line = json.dumps({"v": 1, "uid": 1001, "partition": "v100", "tres_per_node": "gres:gpu:v100:1",
                       "script": script()}).encode()
    for data, action in ((line, "modify"), (b"\xff\x00 not json", "error")):
        p = subprocess.run([sys.executable, "-m", "vest_slurm.bridge.decide", "--site-config", cfg],
                           input=data, capture_output=True, timeout=60)
        assert p.returncode == 0
        out = p.stdout.decode().splitlines()
        assert len(out) == 1 and json.loads(out[0])["action"] in (action, "modify" if action == "modify" else "error")
    p = subprocess.run([sys.executable, "-m", "vest_slurm.bridge.decide", "--site-config", "/nonexistent.toml"],
                       input=line, capture_output=True, timeout=60)
    assert json.loads(p.stdout)["reason"] == "site-config"


def test_vest_bridge_test_shows_the_decision(tmp_path):
    job = tmp_path / "job.sh"
    job.write_text(script())
    cfg = str(REPO / "site-config" / "testbed.toml")
    p = subprocess.run([sys.executable, "-m", "vest_slurm.cli", "bridge", "test", str(job), "--user", "nobody",
                        "--partition", "v100", "--site-config", cfg], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "decision: modify (rerouted)" in p.stdout and "set partition = a100" in p.stdout
    p = subprocess.run([sys.executable, "-m", "vest_slurm.cli", "bridge", "test", str(job), "--user", "root",
                        "--site-config", cfg, "--json"], capture_output=True, text=True, timeout=60)
    assert json.loads(p.stdout)["reason"] == "exempt"


def test_budget_across_calls_reaches_the_lua_and_is_bounded_by_message_timeout():
    from vest_slurm.errors import SiteConfigError
    from vest_slurm.site.config import Bridge, site_config_from_dict
    import toml
    f = facts(site(fallback_ms_per_s=150, fallback_burst_ms=700))
    assert (f["fallback_ms_per_s"], f["fallback_burst_ms"]) == (150, 700)
    assert isinstance(f["written"], float)               # a stamp per write: the Lua's breaker resets on it
    b = Bridge()
    assert b.call_limit_s == 0.6                          # the bucket caps one call below the timeout
    assert b.worst_wait_s == pytest.approx((0.6 + 2.0) / 0.7)
    data = toml.loads((REPO / "site-config" / "testbed.toml").read_text())
    for bad, words in (({"fallback_ms_per_s": 800}, "at most 500"), ({"fallback_burst_ms": 50}, "at least 100"),
                       ({"fallback_ms_per_s": 500, "fallback_burst_ms": 8000, "timeout_s": 8}, "MessageTimeout"),
                       ({"fallback_tokens": 1}, "unknown key bridge.fallback_tokens")):
        d = toml.loads(toml.dumps(data))
        d["bridge"].update(bad)
        with pytest.raises(SiteConfigError) as e:
            site_config_from_dict(d)
        assert words in str(e.value), (bad, str(e.value))
