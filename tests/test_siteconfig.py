import pathlib

import pytest

from vest_slurm.errors import SiteConfigError
from vest_slurm.site.config import load_site_config, parse_site_config
from vest_slurm.units import MiB

ROOT = pathlib.Path(__file__).resolve().parents[1]
MINIMAL = """
[gpu.a100]
profile = "a100-40gb"
[partition.gpu]
gpu_types = ["a100"]
gpus_per_node = 4
"""


def test_shipped_configs_load():
    tb = load_site_config(str(ROOT / "site-config/testbed.toml"))
    assert [(g.name, g.profile) for g in tb.gpus] == [("v100", "v100-16gb"), ("a100", "a100-40gb"), ("h100", "h100-80gb")]
    assert [(p.name, p.gpu_types, p.gpus_per_node) for p in tb.partitions] == [
        ("v100", ("v100",), 4), ("a100", ("a100",), 4), ("h100", ("h100",), 4)]
    ex = load_site_config(str(ROOT / "site-config/example-site.toml"))
    assert ex.partition("gpu-a100").gpu_types == ("a100", "a100_80")


def test_example_documents_every_key():
    from vest_slurm.site import config as sc
    text = (ROOT / "site-config/example-site.toml").read_text()
    for key in sc.GPU_KEYS + sc.PARTITION_KEYS + sc.POLICY_KEYS + sc.BRIDGE_KEYS + tuple(sc.MESSAGE_FIELDS):
        assert f"#   {key}" in text or f"#   {key} " in text or f"# {key}" in text, key


def test_defaults_and_units():
    c = parse_site_config(MINIMAL + "[policy]\nheadroom_mib = 512\n[gpu.a100.x]\n".replace("[gpu.a100.x]\n", ""))
    assert c.policy.headroom_bytes == 512 * MiB
    assert c.policy.selection == "smallest-fit" and c.bridge.timeout_s == 2.0 and c.bridge.fail == "open"
    c = parse_site_config(MINIMAL.replace('"a100-40gb"', '"a100-40gb"\nmemory_mib = 39000'))
    assert c.gpu("a100").memory_bytes == 39000 * MiB


def test_every_problem_reported_at_once():
    bad = """
[gpu.a100]
profile = "a100-41gb"
memory = 3
[partition.p]
gpu_types = ["a100", "b200"]
gpus_per_node = 0
[policy]
headroom_percent = "5"
on_user_choice_too_small = "ignore"
exempt_users = "root"
[policy.messages]
refuse = "{user.__class__.__init__} {password}"
[bridge]
timeout_s = 30
fail = "sideways"
allow_vest_directives = "yes"
log_path = "bridge.log"
[extra]
"""
    with pytest.raises(SiteConfigError) as e:
        parse_site_config(bad, "site.toml")
    text = "\n".join(e.value.problems)
    for needle in ["unknown key (top level).extra; valid keys: gpu, partition, policy, bridge",
                   "unknown key gpu.a100.memory; valid keys: profile, memory_mib, cost",
                   "gpu.a100.profile = 'a100-41gb'", "'b200', which has no [gpu.b200] table",
                   "gpus_per_node = 0 must be at least 1", "headroom_percent must be a number",
                   "on_user_choice_too_small = 'ignore'", "exempt_users must be a list of strings",
                   "{user.__class__.__init__}", "{password}", "timeout_s = 30", "fail = 'sideways'",
                   "allow_vest_directives must be true or false", "log_path = 'bridge.log' must be an absolute path"]:
        assert needle in text
    assert len(e.value.problems) == 13
    assert "site.toml" in str(e.value)


@pytest.mark.parametrize("text,needle", [
    ("", "no [gpu.<gres type>] table"),
    ('[gpu.a]\nprofile="a10-24gb"\n', "no [partition.<name>] table"),
    (MINIMAL + "[policy]\nheadroom_percent = 101\n", "at most 100"),
    (MINIMAL + "[policy]\nheadroom_mib = -1\n", "at least 0"),
    (MINIMAL + "[policy]\nselection = \"cost\"\n", "has no cost"),
    (MINIMAL + "[bridge]\ntimeout_s = 0\n", "greater than 0"),
    (MINIMAL + "[policy]\nheadroom_mib = true\n", "whole number"),
    (MINIMAL.replace('gpus_per_node = 4', 'gpus_per_node = 4.5'), "whole number"),
    ("[gpu.a\n", "not valid TOML"),
])
def test_single_problems(text, needle):
    with pytest.raises(SiteConfigError) as e:
        parse_site_config(text)
    assert needle in str(e.value)


def test_cost_selection_accepts_partition_cost():
    c = parse_site_config(MINIMAL + "cost = 2\n[policy]\nselection = \"cost\"\n")
    assert c.partition("gpu").cost == 2


def test_message_render():
    c = parse_site_config(MINIMAL + "[policy]\nhelp_url='https://h'\n[policy.messages]\nrefuse = \"{{x}} {help_url} {reason}\"\n")
    assert c.policy.messages.render("refuse", help_url="https://h", reason="no-fit") == "{x} https://h no-fit"
    # without a help_url, the sentences that point to it are left out
    d = parse_site_config(MINIMAL).policy.messages
    assert d.render("refuse", help_url="", reason="no-fit") == ""
    assert d.render("unknown_job", help_url="") == "Submit GPU jobs with vsbatch so their memory can be checked."
    assert d.render("unknown_job", help_url="https://h").endswith("See https://h")


def test_load_path_order(tmp_path):
    a, b = tmp_path / "a b $(x).toml", tmp_path / "b.toml"
    a.write_text(MINIMAL)
    b.write_text(MINIMAL.replace("a100", "h100").replace("h100-40gb", "h100-80gb"))
    assert load_site_config(str(a), env={"VEST_SITE_CONFIG": str(b)}).gpu_names == ("a100",)
    assert load_site_config(None, env={"VEST_SITE_CONFIG": str(b)}).gpu_names == ("h100",)
    with pytest.raises(SiteConfigError) as e:
        load_site_config(None, env={})
    assert e.value.path == "/etc/vest/site.toml" or pathlib.Path("/etc/vest/site.toml").exists()
    with pytest.raises(SiteConfigError, match="not found"):
        load_site_config(str(tmp_path / "missing.toml"), env={})


def test_example_lists_every_device_profile():
    """The profile list in example-site.toml's comment is the estimator's, not a copy that drifts."""
    import re

    from vest_slurm.estimate.profiles import PROFILES

    text = (ROOT / "site-config/example-site.toml").read_text()
    start = text.index("One of:")
    block = text[start:re.compile(r"\n#   \S").search(text, start).start()]   # up to the next key
    listed = re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)+", block.replace("#", " "))
    assert listed == list(PROFILES)


def test_vest_site_validate(tmp_path):
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "vest_slurm.cli", "site", "validate", "--site-config",
                         str(ROOT / "site-config/testbed.toml")], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and "valid" in ok.stdout and "partition a100: a100, 4 GPUs per node" in ok.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('[gpu.x]\nprofile = "nope"\n[bridge]\nfoo = 1\n')
    r = subprocess.run([sys.executable, "-m", "vest_slurm.cli", "site", "validate", "--site-config", str(bad)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert "gpu.x.profile = 'nope'" in r.stderr and "unknown key bridge.foo" in r.stderr and "no [partition" in r.stderr
