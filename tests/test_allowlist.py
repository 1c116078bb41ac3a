"""The allow-list that reads #VEST lines on the controller's side (vest_slurm/estimate/allowlist.py).

The hostile lines name a module and a model file that leave a marker behind when imported; the
user's own path (parse_workload_args + build_model) does import them, which shows the marker works,
and the allow-list path never does, over a few thousand generated lines."""

from __future__ import annotations

import json
import os
import shlex
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vest_slurm.estimate.allowlist import ALLOWED_OPTIONS, DirectiveRefused, parse_untrusted
from vest_slurm.errors import VestError
from vest_slurm.slurm.jobscript import parse_job_script
from vest_slurm.estimate.models import build_model
from vest_slurm.estimate.presets import MLP_LAYERS
from vest_slurm.estimate.workload import OPTIMIZERS, parse_workload_args

HOSTILE_MODULE = "vest_hostile_marker_mod"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A directory on sys.path with a marker module, a marker model file and an hf-style model
    directory; each writes to ``marker`` when its code runs."""
    d = tmp_path_factory.mktemp("hostile")
    marker = d / "marker"
    body = (f"open({str(marker)!r}, 'a').write('imported ' + __name__ + '\\n')\n"
            "import torch\n"
            "def build(**kw):\n    return torch.nn.Linear(4, 4)\n"
            "class Opt(torch.optim.SGD):\n    pass\n")
    (d / f"{HOSTILE_MODULE}.py").write_text(body)
    (d / "factory.py").write_text(body)
    hf = d / "llama-3-8b"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {"AutoModel": "modeling.Evil"}}))
    (hf / "modeling.py").write_text(body)
    sys.path.insert(0, str(d))
    try:
        yield d, marker
    finally:
        sys.path.remove(str(d))
        sys.modules.pop(HOSTILE_MODULE, None)


def hostile_values(d):
    return [f"{d}/factory.py:build", "factory.py:build", f"{HOSTILE_MODULE}:build", f"{HOSTILE_MODULE}:Opt",
            f"hf:{d}/llama-3-8b", "hf:./llama-3-8b", f"hf:{d.name}/not-a-preset", "timm:hf-hub:org/x",
            "timm:local-dir:/tmp", "torchvision:../factory", "subprocess:getoutput", "os:system",
            json.dumps({"checkpoint_path": f"{d}/x.pth"}), json.dumps({"pretrained_cfg_overlay": {"file": "/x"}}),
            json.dumps({"cmd": f"touch {d}/marker"}), "trust_remote_code=true", f"cache_dir={d}", "norm=/etc/passwd"]


SAFE_VALUES = ["torchvision:resnet18", "timm:resnet18", "hf:tiny-llama", 'mlp:[["Linear",8,4]]', "8", "2",
               "3x32x32", "seq16", "8", "adam", "sgd", "amp-bf16", "fp32", "expandable_segments:True",
               '{"num_classes": 10}', "num_classes=10", "on", "off", "0.01"]


def allowed_form(spec) -> bool:
    family, _, name = spec.model.partition(":")
    return (family in ("torchvision", "timm", "hf", "mlp") and "/" not in name.removeprefix("meta-llama/")
            and ".py" not in name and spec.optimizer in OPTIMIZERS)


def test_marker_works_on_the_users_own_path(hostile):
    """The user's own estimate builds a factory (its code is theirs): the marker shows code ran."""
    d, marker = hostile
    build_model(parse_workload_args(["--model", f"{d}/factory.py:build", "--batch-size", "1", "--input", "4"]))
    assert marker.read_text().startswith("imported")
    marker.unlink()


@pytest.mark.parametrize("i", range(18))
def test_each_hostile_value_is_refused(hostile, i):
    d, marker = hostile
    value = hostile_values(d)[i]
    for argv in (["--model", value, "--batch-size", "1"],
                 ["--model", "torchvision:resnet18", "--batch-size", "1", "--optimizer", value],
                 ["--model", "torchvision:resnet18", "--batch-size", "1", "--model-args", value],
                 ["--model", "torchvision:resnet18", "--batch-size", "1", "--model-arg", value]):
        with pytest.raises(VestError):
            parse_untrusted(argv)
    assert not marker.exists() and HOSTILE_MODULE not in sys.modules


def test_a_hub_name_is_a_builtin_preset_and_touches_no_file(hostile):
    """``org/name`` stands for a built-in preset's config, whatever lies on the disk under that name
    (here a directory with a config and modeling code): nothing is read from it."""
    d, marker = hostile
    spec = parse_untrusted(["--model", f"hf:{d.name}/llama-3-8b", "--batch-size", "1", "--input", "seq8"])
    assert spec.model == f"hf:{d.name}/llama-3-8b"
    cwd = os.getcwd()
    os.chdir(d.parent)
    try:
        built = build_model(spec)
    finally:
        os.chdir(cwd)
    assert type(built.module).__name__ == "LlamaForCausalLM" and not marker.exists()


def test_accepted_forms_and_their_round_trip():
    for line in ("--model torchvision:resnet50 --batch-size 64 --precision amp-bf16",
                 "--model=hf:meta-llama/Meta-Llama-3-8B --batch-size=1 --input seq2048",
                 """--model 'mlp:[["Linear",784,256],["ReLU"],["Linear",256,10]]' --batch-size 32""",
                 "--model timm:convnext_tiny --batch-size 8 --model-arg drop_path_rate=0.1 --alloc-conf expandable_segments:True"):
        spec = parse_untrusted(shlex.split(line))
        assert parse_untrusted(spec.to_argv()) == spec     # what the worker is sent checks again
        assert spec == parse_workload_args(shlex.split(line))   # and means what the user's own parse means


@pytest.mark.parametrize("argv, reason", [
    (["--mod", "torchvision:resnet18", "--batch-size", "1"], "unknown-option"),   # argparse would take it
    (["--model", "torchvision:resnet18", "--batch-size", "\u0661\u0662"], "bad-value"),   # int() would take it
    (["--model", "torchvision:resnet18", "--batch-size", "1_000"], "bad-value"),
    (["--model", "torchvision:resnet18", "--batch-size", "1", "--steps", "1000"], "bad-value"),
    (["--model", "torchvision:resnet18", "--batch-size", "100000000"], "bad-value"),
    (["--model", "torchvision:resnet18", "--batch-size", "1", "--input", "3x100000x100000"], "bad-value"),
    (["--model", "torchvision:resnet18", "--batch-size", "1", "--model-args", "[" * 5000], "too-long"),
    (["--model", "torchvision:resnet18", "--batch-size", "1", "--model-args", '{"a": [[[1]]]}'], "bad-model-arg"),
    (["--model", "torchvision:resnet18", "--batch-size", "1", "--model-arg", "x=NaN"], "bad-model-arg"),
    (["--model", "torchvision:resnet18", "--batch-size", "1", "--model-arg", "\u0455ize=1"], "bad-model-arg"),
    (["--model", "torchvision:r\u0435snet18", "--batch-size", "1"], "bad-value"),       # a Cyrillic e
    (["--model", "mlp:" + json.dumps([["Linear", 4, 4]] * 300)], "too-long"),
    (["--model", "mlp:" + json.dumps([["ReLU"]] * 257)], "bad-value"),
    (["--model", 'mlp:[["Linear","/etc/passwd",4]]', "--batch-size", "1"], "bad-value"),
    (["--model", "torchvision:resnet18"] * 2 + ["--batch-size", "1"], "repeated-option"),
    (["--batch-size", "1"] * 40, "too-long"),
    (["--model", "torchvision:resnet18", "--batch-size", "1", "--alloc-conf", "max_split_size_mb:$(id)"], "bad-value"),
])
def test_hostile_shapes(argv, reason):
    with pytest.raises(DirectiveRefused) as e:
        parse_untrusted(argv)
    assert e.value.reason == reason


def _words(d):
    options = st.sampled_from(list(ALLOWED_OPTIONS) + ["--mod", "--optim", "--model-file", "--config", "-m", "--"])
    values = st.one_of(st.sampled_from(hostile_values(d) + SAFE_VALUES), st.text(max_size=40))
    joined = st.tuples(options, values).map(lambda t: [f"{t[0]}={t[1]}"])
    pair = st.tuples(options, values).map(list)
    extra = st.lists(st.one_of(pair, joined, values.map(lambda v: [v])), max_size=4).map(lambda xs: sum(xs, []))
    base = st.sampled_from([[], ["--model", "torchvision:resnet18", "--batch-size", "2"],
                            ["--model", 'mlp:[["Linear",8,4]]', "--batch-size", "4", "--input", "8"],
                            ["--batch-size", "1"]])
    return st.tuples(base, extra, st.booleans()).map(lambda t: t[0] + t[1] if t[2] else t[1] + t[0])


def test_generated_lines_never_reach_an_import(hostile):
    """Thousands of #VEST lines mixing allowed and hostile options and values: through the job
    script parser and the allow-list, what is accepted names only allow-listed models and
    optimizers, and no hostile module or file is imported (an audit hook watches every import)."""
    d, marker = hostile
    imported = []

    def hook(event, args):
        if event == "import" and args and HOSTILE_MODULE in str(args[0]):
            imported.append(args[0])
        if event == "exec" and args and str(d) in getattr(args[0], "co_filename", ""):
            imported.append(args[0].co_filename)     # a module's code run: an import of a file

    sys.addaudithook(hook)    # cannot be removed: it only records names of this test's own files
    sys.modules.pop(HOSTILE_MODULE, None)
    accepted = []

    @settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_words(d))
    def check(words):
        text = "#!/bin/bash\n#VEST " + shlex.join(words) + "\ntrue\n"
        try:
            argv = parse_job_script(text, "<job>").vest_argv
            spec = parse_untrusted(argv)
        except VestError:
            return
        assert allowed_form(spec), spec
        if spec.model.startswith("mlp:"):
            assert all(layer[0] in MLP_LAYERS for layer in json.loads(spec.model[4:])), spec
        accepted.append(spec.model)

    check()
    assert imported == [] and not marker.exists()
    assert accepted, "the generator produced no accepted line: the test would prove nothing"
    # the hook does see an import of the hostile file, on the user's own path
    build_model(parse_workload_args(["--model", f"{d}/factory.py:build", "--batch-size", "1", "--input", "4"]))
    assert imported and imported[0].endswith("factory.py")
    marker.unlink()


def test_num_gpus_auto_has_a_bounded_meaning():
    """``--num-gpus auto`` passes the allow-list as that word only, meaning the job's Slurm GPU count
    (the caller's: decide.py passes the request's total); it is still one option (no repeats), and
    anything else in its place is refused. The user's own parser refuses it with what to do instead."""
    from vest_slurm.errors import WorkloadError
    from vest_slurm.estimate.workload import split_num_gpus_auto

    base = ["--model", "torchvision:resnet18", "--batch-size", "8", "--parallelism", "fsdp2"]
    spec = parse_untrusted(base + ["--num-gpus", "auto"])
    assert spec.num_gpus == 1 and "--num-gpus" not in spec.to_argv()
    assert parse_untrusted(base + ["--num-gpus=auto"]).num_gpus == 1
    for bad in (["--num-gpus", "auto", "--num-gpus", "4"], ["--num-gpus", "AUTO"], ["--num-gpus", "auto;x"],
                ["--num-gpus", str(1 << 20)]):
        with pytest.raises(DirectiveRefused):
            parse_untrusted(base + bad)
    with pytest.raises(WorkloadError, match="vsbatch, `vest check` and `vest estimate` of a declared"):
        parse_workload_args(base + ["--num-gpus", "auto"])
    assert split_num_gpus_auto(base + ["--num-gpus", "auto"]) == (tuple(base), True)
    assert split_num_gpus_auto(base + ["--num-gpus", "4"]) == (tuple(base + ["--num-gpus", "4"]), False)


def test_bridge_reads_auto_as_the_jobs_gpu_count():
    """decide.py traces ``#VEST --num-gpus auto`` at the job's own GPU count, and refuses a count past
    the allow-list's bound instead of asking the worker for it."""
    from pathlib import Path

    from vest_slurm.bridge.decide import _from_directives
    from vest_slurm.estimate.allowlist import MAX_NUM_GPUS
    from vest_slurm.site.config import load_site_config
    from vest_slurm.slurm.jobscript import gpu_request

    site = load_site_config(str(Path(__file__).resolve().parent.parent / "site-config" / "testbed.toml"))
    text = ("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --gres=gpu:h100:4\n"
            "#VEST --model torchvision:resnet18 --batch-size 8 --parallelism fsdp2 --num-gpus auto\nhostname\n")
    asked = []

    def worker(argv, num_gpus, profiles):   # the directive worker's interface: what decide asks it for
        asked.append((argv, num_gpus))
        return None   # "over budget": decide goes on without an estimate

    request = gpu_request(parse_job_script(text, "<job>").options)
    assert _from_directives(text, request, site, worker)[1] == "directives-over-budget"
    assert asked and asked[0][1] == 8 and "auto" not in asked[0][0]
    from dataclasses import replace

    asked.clear()
    too_many = replace(request, total_gpus=MAX_NUM_GPUS + 1)
    assert _from_directives(text, too_many, site, worker)[1] == "directives-refused-bad-value" and not asked
