import math
import pathlib

import pytest
import toml

from vest_slurm.estimate.record import MemoryEstimate
from vest_slurm.slurm.jobscript import gpu_request
from vest_slurm.site.placement import NoFit, Placement, needed_bytes, place
from vest_slurm.site.config import parse_site_config, site_config_from_dict
from vest_slurm.units import GiB, MiB

ROOT = pathlib.Path(__file__).resolve().parents[1]
CAPS = {"v100": 16 * GiB, "a100": 40 * GiB, "h100": 80 * GiB}
PROFILES = {"v100": "v100-16gb", "a100": "a100-40gb", "h100": "h100-80gb"}


def site(**policy):
    data = toml.loads((ROOT / "site-config/testbed.toml").read_text())
    data["policy"].update(policy)
    return site_config_from_dict(data)


def ests(peak, caps=CAPS):
    """Estimates whose peak (what the headroom rule is applied to) is ``peak`` on every type; the
    least the job could run in (required) is below it and must not matter."""
    return {t: MemoryEstimate(PROFILES[t], c, max(1, peak - GiB), peak) for t, c in caps.items()}


def req(*opts):
    return gpu_request(list(opts))


def test_headroom_rule_boundary():
    s = site()  # 5 % + 256 MiB
    cap = CAPS["a100"]
    exact = (cap - 256 * MiB) * 100 // 105  # the rule solved for required_bytes
    assert needed_bytes(exact, 5, 256 * MiB) == math.ceil(exact * 1.05) + 256 * MiB
    assert needed_bytes(exact, 5, 256 * MiB) <= cap < needed_bytes(exact + 1, 5, 256 * MiB)
    caps = {"a100": cap, "h100": CAPS["h100"]}
    assert place(ests(exact, caps), req(("gres", "gpu:1")), (), s).gpu_type == "a100"
    assert place(ests(exact + 1, caps), req(("gres", "gpu:1")), (), s).gpu_type == "h100"


def test_smallest_fit():
    s = site()
    assert place(ests(4 * GiB), req(("gres", "gpu:1")), (), s).partition == "v100"
    p = place(ests(20 * GiB), req(("gres", "gpu:1")), (), s)
    assert isinstance(p, Placement) and (p.partition, p.gres, p.changed) == ("a100", "gpu:a100:1", True)
    assert p.overrides == (("partition", "a100"), ("gres", "gpu:a100:1"))
    assert p.admin_line.startswith("vest: place ")


def test_gpu_types_where_the_job_runs_slow_come_last():
    """A bf16 job fits the V100 (16 GB), but bf16 runs emulated there: the A100 is chosen while it
    fits; the V100 only when nothing else does, or when the user asked for it, with a warning."""
    s, slow = site(), {"v100": "bf16 runs emulated on sm70"}
    p = place(ests(4 * GiB), req(("gres", "gpu:1")), (), s, slow=slow)
    assert p.gpu_type == "a100" and "at full speed" in p.reasons[0] and not p.warnings
    p = place(ests(4 * GiB, {"v100": CAPS["v100"], "a100": 3 * GiB}), req(("gres", "gpu:1")), (), s, slow=slow)
    assert p.gpu_type == "v100" and p.warnings == ("v100: bf16 runs emulated on sm70",)
    assert p.reasons[0] == "smallest GPU that fits: v100 in partition v100"
    p = place(ests(4 * GiB), req(("gres", "gpu:1")), ("v100",), s, slow=slow)
    assert (p.gpu_type, p.changed) == ("v100", False) and p.warnings == ("v100: bf16 runs emulated on sm70",)
    assert place(ests(4 * GiB), req(("gres", "gpu:1")), (), s).gpu_type == "v100"   # nothing slow: smallest


def test_cost_selection():
    text = (ROOT / "site-config/testbed.toml").read_text()
    text = text.replace('profile = "a100-40gb"', 'profile = "a100-40gb"\ncost = 1').replace(
        'profile = "h100-80gb"', 'profile = "h100-80gb"\ncost = 0.5').replace(
        'profile = "v100-16gb"', 'profile = "v100-16gb"\ncost = 2').replace('"smallest-fit"', '"cost"')
    s = parse_site_config(text)
    assert place(ests(4 * GiB), req(("gres", "gpu:1")), (), s).gpu_type == "h100"


def test_user_choice_that_fits_is_kept_unchanged():
    p = place(ests(20 * GiB), req(("gres", "gpu:h100:2")), ("h100",), site())
    assert (p.partition, p.gres, p.changed, p.overrides) == ("h100", "gpu:h100:2", False, ())


def test_user_partition_list_narrowed_to_fitting():
    p = place(ests(20 * GiB), req(("gres", "gpu:1")), ("v100", "a100"), site())
    assert (p.partition, p.changed) == ("a100", True)


@pytest.mark.parametrize("policy,expected", [("reroute", "a100"), ("warn", "v100"), ("refuse", None)])
def test_user_choice_too_small(policy, expected):
    r = place(ests(20 * GiB), req(("gres", "gpu:v100:1")), ("v100",), site(on_user_choice_too_small=policy), user="bob")
    if expected is None:
        assert isinstance(r, NoFit) and r.reason == "user-choice-too-small"
        assert "reason=user-choice-too-small" in r.admin_line
        assert r.closest.gpu_type == "v100"
    else:
        assert isinstance(r, Placement) and r.partition == expected
        assert r.warnings
        assert r.changed == (policy == "reroute")
        if policy == "reroute":
            assert r.overrides == (("partition", "a100"), ("gres", "gpu:a100:1"))


def test_reroute_keeps_users_option_family_and_other_gres():
    r = place(ests(20 * GiB), req(("gpus", "v100:2")), ("v100",), site())
    assert r.overrides == (("partition", "a100"), ("gpus", "a100:2"))
    r = place(ests(20 * GiB), req(("gres", "gpu:v100:1,shard:2")), (), site())
    assert r.overrides[1] == ("gres", "gpu:a100:1,shard:2")


def test_no_fit_states_everything_and_calls_advise():
    seen = []

    def advise(nf):
        seen.append(nf)
        return ["--batch-size 64 fits on h100", "--precision amp-bf16 fits on h100"]

    r = place(ests(100 * GiB), req(("gres", "gpu:1")), (), site(), user="eve", account="proj", advise=advise)
    assert isinstance(r, NoFit) and r.reason == "no-fit"
    need = needed_bytes(100 * GiB, 5, 256 * MiB)
    assert r.needed_bytes == need and r.largest_gpu == "h100" and r.largest_capacity_bytes == 80 * GiB
    assert r.shortfall_bytes == need - 80 * GiB and r.shortfall_mib == pytest.approx((need - 80 * GiB) / MiB)
    assert r.closest.gpu_type == "h100" and r.estimate.gpu == "h100-80gb"
    assert r.advice == ("--batch-size 64 fits on h100", "--precision amp-bf16 fits on h100")
    assert seen and seen[0].advice == ()
    assert r.admin_line.startswith("vest: refuse user=eve account=proj reason=no-fit ")
    assert "shortfall_mib=" in r.admin_line
    assert "h100" in r.message and "short" in r.message and "--batch-size 64" in r.message
    assert "example.invalid" in r.message  # the site's help URL


def test_refusal_rules_order_first_wins():
    s = site()
    r = place(ests(100 * GiB), req(("gres", "gpu:a100:9")), ("nope",), s)
    assert r.reason == "unknown-partition" and "nope" in r.message
    r = place(ests(100 * GiB), req(("gres", "gpu:b200:9")), (), s)
    assert r.reason == "unknown-gpu-type"
    r = place(ests(1 * GiB), req(("gres", "gpu:h100:1")), ("v100",), s)
    assert r.reason == "unknown-gpu-type" and "no h100 GPUs" in r.message
    r = place(ests(1 * GiB), req(("gres", "gpu:8")), (), s)
    assert r.reason == "too-many-gpus"
    r = place({}, req(("gres", "gpu:1")), (), s)
    assert r.reason == "no-estimate"


def test_exempt_user_gets_warnings_not_refusals():
    s = site(on_user_choice_too_small="refuse")
    r = place(ests(20 * GiB), req(("gres", "gpu:v100:1")), ("v100",), s, user="root")
    assert isinstance(r, Placement) and r.partition == "v100" and not r.changed and r.warnings
    r = place(ests(200 * GiB), req(("gres", "gpu:1")), (), s, user="root")
    assert isinstance(r, Placement) and r.gpu_type == "h100"


def test_site_memory_override_is_the_capacity():
    text = (ROOT / "site-config/testbed.toml").read_text().replace('profile = "a100-40gb"',
                                                                   'profile = "a100-40gb"\nmemory_mib = 10000')
    r = place(ests(20 * GiB), req(("gres", "gpu:1")), (), parse_site_config(text))
    assert r.gpu_type == "h100"


def test_no_gpu_request_asks_for_one():
    r = place(ests(4 * GiB), req(), (), site())
    assert r.changed and r.gres == "gpu:v100:1" and ("gres", "gpu:v100:1") in r.overrides


@pytest.mark.parametrize("user", ['a b', 'x" reason=ok', "$(id)", "ü\nlog"])
def test_admin_line_cannot_be_forged(user):
    r = place(ests(100 * GiB), req(("gres", "gpu:1")), (), site(), user=user)
    assert "\n" not in r.admin_line
    assert r.admin_line.count(" reason=") == 1


def test_the_jobs_nodes_are_checked_against_the_partitions_nodes():
    """--nodes with the GPUs per node (--gres per node, --gpus-per-node): a partition with fewer nodes
    than the job asks for does not take it; the refusal names each partition's shape."""
    data = toml.loads((ROOT / "site-config/testbed.toml").read_text())
    for name, n in (("v100", 1), ("a100", 1), ("h100", 2)):
        data["partition"][name]["nodes"] = n
    data["policy"]["exempt_users"] = []
    s = site_config_from_dict(data)
    assert [p.nodes for p in s.partitions] == [1, 1, 2]
    two = req(("nodes", "2"), ("gpus-per-node", "4"))
    assert (two.gpus_per_node, two.total_gpus, two.nodes) == (4, 8, 2)
    p = place(ests(4 * GiB), two, (), s)   # fits a V100's memory, but only the h100 partition has 2 nodes
    assert isinstance(p, Placement) and p.partition == "h100" and p.gres == "gpu:h100:4", p
    p = place(ests(4 * GiB), req(("nodes", "2"), ("gres", "gpu:2")), (), s)
    assert isinstance(p, Placement) and p.partition == "h100" and p.gres == "gpu:h100:2"
    assert isinstance(place(ests(4 * GiB), req(("nodes", "1"), ("gres", "gpu:4")), (), s), Placement)
    r = place(ests(4 * GiB), req(("nodes", "3"), ("gres", "gpu:4")), (), s)
    assert isinstance(r, NoFit) and r.reason == "too-many-gpus", r
    assert "4 GPU(s) per node, 12 in all on 3 nodes" in r.message and "h100: 4 per node, 2 nodes" in r.message
    unknown = site()   # no node counts known: not refused on nodes (vsbatch fills them in from Slurm)
    assert isinstance(place(ests(4 * GiB), req(("nodes", "3"), ("gres", "gpu:4")), (), unknown), Placement)


def test_partition_nodes_key_is_checked():
    data = toml.loads((ROOT / "site-config/testbed.toml").read_text())
    data["partition"]["h100"]["nodes"] = 0
    with pytest.raises(Exception, match="nodes"):
        site_config_from_dict(data)
