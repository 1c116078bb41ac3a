"""scripts/bench_scripts.py and scripts/corpus.toml: the corpus is well formed, its oracles parse as
declarative workloads, and each synthetic-data recipe writes what the script's loader reads."""

from __future__ import annotations

import importlib.util
import os
import pickle
import re
import shlex
import subprocess
import tomllib

import numpy as np

from vest_slurm.dynamic.launch import parse_train_command
from vest_slurm.estimate.workload import parse_workload_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_scripts.py")


def load_script():
    spec = importlib.util.spec_from_file_location("bench_scripts_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def corpus():
    with open(os.path.join(ROOT, "scripts", "corpus.toml"), "rb") as f:
        return tomllib.load(f)["script"]


def test_corpus_is_pinned_and_complete():
    mod = load_script()
    entries = corpus()
    assert len(entries) >= 25
    assert len({e["name"] for e in entries}) == len(entries)
    assert len({(e["repo"], e["tree"][0]) for e in entries}) >= 25 - 3   # distinct scripts, few variants
    for e in entries:
        assert re.fullmatch(r"[0-9a-f]{40}", e["commit"]), e["name"]
        assert e["family"] in ("reference", "llm", "image", "framework", "distributed"), e["name"]
        assert e.get("recipe", "none") in mod.RECIPES, e["name"]
        cmd = parse_train_command(e["command"])
        assert cmd.script or cmd.module, e["name"]
        if e["oracle"]:
            parse_workload_args(shlex.split(e["oracle"]))   # raises on a bad oracle
        else:
            assert e.get("oracle_why"), f"{e['name']}: an entry without an oracle says why"
        if e.get("live_oracle"):   # the second oracle's reduced size: the same script, one process
            small = parse_train_command(e["live_oracle"])
            assert (small.script, small.module, small.nproc) == (cmd.script, cmd.module, 1), e["name"]
        if e.get("expect", "estimated") != "estimated":
            assert e.get("expect_why"), e["name"]


def test_recipes_write_what_the_loaders_read(tmp_path):
    mod = load_script()
    from torchvision import datasets

    mod.RECIPES["mnist-idx"](str(tmp_path), "data", train=64, test=32)
    ds = datasets.MNIST(str(tmp_path / "data"), train=True, download=False)
    assert len(ds) == 64 and ds[0][0].size == (28, 28)
    mod.RECIPES["imagefolder"](str(tmp_path), "imgs", ["train"], 3, 2, 40)
    assert len(datasets.ImageFolder(str(tmp_path / "imgs" / "train"))) == 6
    mod.RECIPES["tokens-u16"](str(tmp_path), "tok", 1000, 65, meta=True)
    data = np.memmap(tmp_path / "tok" / "train.bin", dtype=np.uint16, mode="r")
    assert len(data) == 1000 and data.max() < 65
    assert pickle.loads((tmp_path / "tok" / "meta.pkl").read_bytes())["vocab_size"] == 65
    mod.RECIPES["llmc-bin"](str(tmp_path), "t.bin", 500, 50257)
    raw = (tmp_path / "t.bin").read_bytes()
    header = np.frombuffer(raw[:1024], dtype=np.int32)
    assert list(header[:3]) == [20240520, 1, 500] and len(raw) == 1024 + 2 * 500
    mod.RECIPES["cora"](str(tmp_path), "cora", 20, 5, 3, 30)
    rows = (tmp_path / "cora" / "cora.content").read_text().splitlines()
    assert len(rows) == 20 and len(rows[0].split()) == 1 + 5 + 1
    mod.RECIPES["wikitext"](str(tmp_path), "wt", 400, 50)
    assert sorted(p.name for p in (tmp_path / "wt").iterdir()) == ["test.txt", "train.txt", "valid.txt"]


def test_extract_takes_the_pinned_commit_of_a_bare_mirror(tmp_path):
    mod = load_script()
    src = tmp_path / "src"
    src.mkdir()
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q", str(src)], check=True)
    (src / "ex").mkdir()
    (src / "ex" / "train.py").write_text("print('v1')\n")
    subprocess.run([*git, "-C", str(src), "add", "-A"], check=True)
    subprocess.run([*git, "-C", str(src), "commit", "-qm", "v1"], check=True)
    v1 = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (src / "ex" / "train.py").write_text("print('v2')\n")
    subprocess.run([*git, "-C", str(src), "commit", "-qam", "v2"], check=True)
    mirror = tmp_path / "mirror"
    subprocess.run(["git", "clone", "-q", "--bare", str(src), str(mirror / "someone+proj" / "repo")], check=True)
    n = mod.extract(str(mirror), "someone/proj", v1, ["ex"], str(tmp_path / "out"))
    assert n == 1 and (tmp_path / "out" / "ex" / "train.py").read_text() == "print('v1')\n"


def test_error_text_keeps_the_message_and_the_fix():
    mod = load_script()
    err = "noise\nvest: error: python x.py failed by itself at x.py:3: ValueError: bad\n  x.py:3: f()\n  fix: do this\n"
    assert mod._error_text(err) == "python x.py failed by itself at x.py:3: ValueError: bad | fix: do this"
    assert mod._kind("time limit: the estimate ran past 120 s", None) == "limit"
    assert mod._kind("anything", {"kind": "vest-unsupported"}) == "vest-unsupported"
