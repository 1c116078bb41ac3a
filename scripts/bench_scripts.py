#!/usr/bin/env python3
"""The corpus yardstick: run public training scripts unmodified through `vest estimate -- CMD`.

    python scripts/bench_scripts.py --mirror DIR [--only SUBSTR] [--out benchmarks/scripts-results.csv]

In: scripts/corpus.toml (repository, commit, files, command, synthetic-data recipe, oracle of each
script) and DIR, a folder of bare mirrors DIR/OWNER+NAME/repo (the layout the `fetch` tool leaves).
Out: a table on stdout and a CSV (paths relative to the checkout) with, per script: the outcome
(estimated / refused / failed), the failure kind and message, wall seconds and peak RSS of the whole
`vest estimate` process tree, and the oracle's verdict.

Each script's files are taken from its pinned commit (`git ls-tree` + `git cat-file`, so a mirror
whose large files are absent still gives the code) into a scratch folder; the recipe then writes the
synthetic data set the script reads (MNIST idx files, an image folder, token files, ...), so nothing
is downloaded. The oracle is the declarative estimate of the same workload (`vest estimate --model
...`) where the corpus gives one; else the same script run for real on the CPU with its device
tensors counted (vest_slurm/dynamic/live_oracle.py), at the entry's `live_oracle` command (a
reduced size) or its own, against vest's estimate of that same command. An estimate agrees when its
live-tensor peak is within 10% of the oracle's. The packages the scripts import are the `bench`
extra of pyproject.toml.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pickle
import random
import re
import shlex
import shutil
import struct
import subprocess
import sys
import time
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "scripts", "corpus.toml")
AGREE = 0.10          # the bound: within 10% of the oracle's live-tensor peak
RESOLUTION_MIB = 0.1  # vest's JSON gives MiB to one decimal: closer than this is agreement at any size
# The benchmark times the work itself: no trace cache and no stored cuDNN answers (tracecache.py).
os.environ["VEST_CACHE_DIR"] = "off"


# ---- the scripts' files ----------------------------------------------------------------------------

def extract(mirror: str, repo: str, commit: str, tree: list[str], dest: str) -> int:
    """Write the files under ``tree`` at ``commit`` into ``dest``; returns how many were written.
    Blobs the mirror does not hold (large data files) are skipped: recipes build the data."""
    git = os.path.join(mirror, repo.replace("/", "+"), "repo")
    if not os.path.isdir(git):
        raise SystemExit(f"no mirror of {repo} at {git}: bring it with the fetch tool first")
    names = subprocess.run(["git", "-C", git, "ls-tree", "-r", "--name-only", commit, "--", *tree],
                           capture_output=True, text=True, check=True).stdout.split("\n")
    n = 0
    for name in filter(None, names):
        blob = subprocess.run(["git", "-C", git, "cat-file", "blob", f"{commit}:{name}"], capture_output=True)
        if blob.returncode:
            continue
        path = os.path.join(dest, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(blob.stdout)
        n += 1
    return n


# ---- synthetic data recipes (what each script reads, written locally) ----------------------------

def _mnist_idx(workdir, root, train=512, test=256):
    """torchvision.datasets.MNIST finds raw/ idx files and does not download (its _check_exists).
    ``root`` may list several folders (Lightning's demo MNIST first checks torchvision's at ./data)."""
    for r in [root] if isinstance(root, str) else root:
        _mnist_raw(os.path.join(workdir, r, "MNIST", "raw"), train, test)


def _mnist_raw(raw, train, test):
    import numpy as np

    os.makedirs(raw, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", train), ("t10k", test)):
        with open(os.path.join(raw, f"{prefix}-images-idx3-ubyte"), "wb") as f:
            f.write(struct.pack(">IIII", 2051, n, 28, 28) + rng.integers(0, 256, n * 784, dtype=np.uint8).tobytes())
        with open(os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), "wb") as f:
            f.write(struct.pack(">II", 2049, n) + rng.integers(0, 10, n, dtype=np.uint8).tobytes())


def _words(n, vocab, seed=0):
    rng = random.Random(seed)
    return [f"w{rng.randrange(vocab)}" for _ in range(n)]


def _wikitext(workdir, dir, words=20000, vocab=2000, **name):
    """WikiText-2's train/valid/test.txt of synthetic words; ``as``: the training text under that
    one name instead (Lightning's demo WikiText2 reads data/wikitext-2.txt)."""
    d = os.path.join(workdir, dir)
    os.makedirs(d, exist_ok=True)
    for i, split in enumerate(("train", "valid", "test")):
        if name.get("as") and split != "train":
            continue
        w = _words(words if split == "train" else words // 10, vocab, i)
        with open(os.path.join(d, name.get("as") or f"{split}.txt"), "w") as f:
            f.writelines(" ".join(w[j:j + 20]) + "\n" for j in range(0, len(w), 20))


def _text(workdir, path, chars=200000):
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,;:!?'\n"
    with open(os.path.join(workdir, path), "w") as f:
        f.write("".join(rng.choice(alphabet) for _ in range(chars)))


def _names(workdir, path, count=2000):
    """makemore's names.txt: one lowercase word a line (3-10 letters)."""
    rng = random.Random(0)
    with open(os.path.join(workdir, path), "w") as f:
        for _ in range(count):
            f.write("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 10))) + "\n")


def _tokens_u16(workdir, dir, tokens, vocab, meta=False):
    """nanoGPT's prepared data: train.bin / val.bin of uint16 token ids, meta.pkl with vocab_size."""
    import numpy as np

    d = os.path.join(workdir, dir)
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, tokens, dtype=np.uint16).tofile(os.path.join(d, "train.bin"))
    rng.integers(0, vocab, tokens // 10, dtype=np.uint16).tofile(os.path.join(d, "val.bin"))
    if meta:
        with open(os.path.join(d, "meta.pkl"), "wb") as f:
            pickle.dump({"vocab_size": vocab, "itos": {i: chr(32 + i) for i in range(vocab)},
                         "stoi": {chr(32 + i): i for i in range(vocab)}}, f)


def _llmc_bin(workdir, path, tokens, vocab):
    """llm.c's token shard: 256 int32 header (magic 20240520, version 1, token count), uint16 tokens."""
    import numpy as np

    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, tokens)
    with open(os.path.join(workdir, path), "wb") as f:
        f.write(header.tobytes())
        f.write(np.random.default_rng(0).integers(0, vocab, tokens, dtype=np.uint16).tobytes())


def _images(d, n, size, seed):
    from PIL import Image
    import numpy as np

    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(os.path.join(d, f"{i:05d}.jpg"))


def _imagefolder(workdir, dir, splits, classes, per_class, size):
    for s, split in enumerate(splits):
        for c in range(classes):
            _images(os.path.join(workdir, dir, split, f"class{c:03d}"), per_class, size, s * 1000 + c)


def _torch_hub(workdir, dir, weights):
    """torchvision weights in a torch.hub cache (``dir``: the user's TORCH_HOME), as after the one
    download: each of ``weights`` (``VGG16_Weights.IMAGENET1K_V1``) as the state dict of its model
    with random values, under the file name of its URL. torch.hub's load_state_dict_from_url reads
    a file that is there and checks its hash only when it downloads."""
    import torch
    import torchvision

    out = os.path.join(workdir, dir, "hub", "checkpoints")
    os.makedirs(out, exist_ok=True)
    for name in weights:
        enum, member = name.split(".")
        w = getattr(torchvision.models, enum)[member]
        model = torchvision.models.get_model(enum.removesuffix("_Weights").lower(), weights=None)
        torch.save(model.state_dict(), os.path.join(out, os.path.basename(w.url)))


def _bsds300(workdir, dir, train, test, size):
    _images(os.path.join(workdir, dir, "train"), train, size, 1)
    _images(os.path.join(workdir, dir, "test"), test, size, 2)


def _cora(workdir, dir, nodes, features, classes, edges):
    """The Cora files: `id f1 .. fN label` per paper, `cited citing` per citation."""
    d = os.path.join(workdir, dir)
    os.makedirs(d, exist_ok=True)
    rng = random.Random(0)
    with open(os.path.join(d, "cora.content"), "w") as f:
        for i in range(nodes):
            feats = " ".join("1" if rng.random() < 0.02 else "0" for _ in range(features))
            f.write(f"{1000 + i} {feats} label{rng.randrange(classes)}\n")
    with open(os.path.join(d, "cora.cites"), "w") as f:
        for _ in range(edges):
            f.write(f"{1000 + rng.randrange(nodes)} {1000 + rng.randrange(nodes)}\n")


def _hf_local(workdir, dir, model_type, config, weights=False, text=None, jsonl=None, words=40000, vocab=2000):
    """A Hugging Face model folder built here, never downloaded: ``dir`` holds the config of
    ``model_type`` with ``config``'s fields (a published model's sizes), a byte-level BPE tokenizer
    trained on synthetic words (``tokenizers``; the model's vocab_size stays the config's, the ids
    the tokenizer makes are a subset of it) and, with ``weights``, randomly initialised weights
    (safetensors), so that ``from_pretrained(dir)`` finds everything locally. ``text``: folder of
    train.txt / valid.txt; ``jsonl``: folder with train.jsonl of {"text": ...} (a local dataset
    that ``load_dataset(folder)`` reads)."""
    import tokenizers
    import transformers

    d = os.path.join(workdir, dir)
    os.makedirs(d, exist_ok=True)
    corpus = [" ".join(_words(50, vocab, i)) for i in range(words // 50)]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
        vocab_size=vocab + 300, special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(d)
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    if weights:
        import torch

        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    else:
        cfg.save_pretrained(d)
    if text:
        os.makedirs(os.path.join(workdir, text), exist_ok=True)
        for split, lines in (("train", corpus), ("valid", corpus[: len(corpus) // 10])):
            with open(os.path.join(workdir, text, f"{split}.txt"), "w") as f:
                f.writelines(line + "\n" for line in lines)
    if jsonl:
        os.makedirs(os.path.join(workdir, jsonl), exist_ok=True)
        with open(os.path.join(workdir, jsonl, "train.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": line}) + "\n" for line in corpus)


def _hub_cache_timm(workdir, hub, model, hf_hub_id):
    """A Hugging Face hub cache (huggingface_hub's layout: models--ORG--NAME/refs/main names a
    snapshot folder) holding randomly initialised weights of the timm ``model`` under its
    ``hf_hub_id``, as a user's cache holds the downloaded ones: timm's ``pretrained=True`` then
    loads offline. The entry's ``env`` points HF_HUB_CACHE here."""
    import timm
    import torch
    from safetensors.torch import save_file

    repo = os.path.join(workdir, hub, "models--" + hf_hub_id.replace("/", "--"))
    rev = "0" * 40
    snap = os.path.join(repo, "snapshots", rev)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(rev)
    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in timm.create_model(model, pretrained=False).state_dict().items()}
    save_file(state, os.path.join(snap, "model.safetensors"))


def _pets(workdir, dir, classes, per_class, size, hub, model, hf_hub_id):
    """The Oxford-IIIT Pets layout accelerate's cv_example reads: one folder of LABEL_N.jpg, and the
    timm backbone's weights in a hub cache (_hub_cache_timm)."""
    from PIL import Image
    import numpy as np

    d = os.path.join(workdir, dir)
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    for c in range(classes):
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(
                os.path.join(d, f"breed{c:02d}_{i}.jpg"))
    _hub_cache_timm(workdir, hub, model, hf_hub_id)


def _torch_save(workdir, files, location=None):
    """Files of tensors written with torch.save, as a preprocessing step or an earlier job leaves
    them: ``files`` maps a path to {name: [shape, dtype, high]} (integers drawn below ``high``;
    floats standard normal), a nested {name: ...} of the same, or any other value, saved as it is.
    ``location`` ("cuda:0"): the storages are recorded as a GPU job saves its GPU tensors, so that
    torch.load puts them back on the GPU (the tensors here are host tensors; only the tag differs)."""
    import torch
    import torch.serialization as ser

    g = torch.Generator().manual_seed(0)

    def build(content):
        obj = {}
        for name, v in content.items():
            if isinstance(v, list) and len(v) == 3 and isinstance(v[0], list):
                shape, dtype, high = v
                dt = getattr(torch, dtype)
                obj[name] = (torch.randint(0, high, shape, dtype=dt, generator=g) if not dt.is_floating_point
                             else torch.randn(shape, generator=g).to(dt))
            elif isinstance(v, dict):
                obj[name] = build(v)
            else:
                obj[name] = v
        return obj

    tag = ser.location_tag
    try:
        if location:
            ser.location_tag = lambda storage: location
        for path, content in files.items():
            full = os.path.join(workdir, path)
            os.makedirs(os.path.dirname(full) or ".", exist_ok=True)
            torch.save(build(content), full)
    finally:
        ser.location_tag = tag


RECIPES = {
    "none": lambda workdir: None,
    "mnist-idx": _mnist_idx, "wikitext": _wikitext, "text": _text, "names": _names, "tokens-u16": _tokens_u16,
    "llmc-bin": _llmc_bin, "imagefolder": _imagefolder, "bsds300": _bsds300, "cora": _cora,
    "hf-local": _hf_local, "pets": _pets, "torch-save": _torch_save, "torch-hub": _torch_hub,
    "imagefolder+torch-hub": lambda workdir, hub, **folder: (_imagefolder(workdir, **folder), _torch_hub(workdir, **hub)),
}


# ---- running vest --------------------------------------------------------------------------------

# The process tree's peak: the largest VmHWM (a process's own resident high-water mark) of any
# descendant, polled. getrusage(RUSAGE_CHILDREN) would miss the script: it runs under bubblewrap in
# its own PID namespace, and bwrap's waited children are not the script.
_MEASURE = r"""
import json, os, subprocess, sys, time

def tree(root):
    kids = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(pid))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out

def hwm_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0

t = time.perf_counter()
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
peak = 0
import threading
out = {}
reader = threading.Thread(target=lambda: out.update(zip(("stdout", "stderr"), p.communicate())))
reader.start()
while reader.is_alive():
    peak = max([peak, *(hwm_kib(q) for q in tree(p.pid))])
    reader.join(0.2)
dt = time.perf_counter() - t
print(json.dumps({"rc": p.returncode, "seconds": dt, "maxrss_kib": peak, "stdout": out.get("stdout", ""),
                  "stderr": out.get("stderr", "")[-4000:]}))
"""


def user_env(cwd: str, env: dict | None) -> dict:
    """The user's environment with the variables the entry names (paths relative to ``cwd``)."""
    return {**os.environ, **{k: os.path.join(cwd, v) for k, v in (env or {}).items()}}


def measure(argv: list[str], cwd: str, env: dict | None = None) -> dict:
    """Run one `vest estimate` as a user would (cold, its own process tree); its seconds and peak RSS.
    ``env``: the user's environment variables the entry names (paths relative to ``cwd``)."""
    full = user_env(cwd, env)
    out = subprocess.run([sys.executable, "-c", _MEASURE, *argv], cwd=cwd, capture_output=True, text=True, env=full)
    doc = json.loads(out.stdout)
    doc["json"] = _last_json(doc["stdout"])
    return doc


def _last_json(text: str):
    i = text.find("{")
    if i < 0:
        return None
    try:
        return json.loads(text[i:])
    except ValueError:
        return None


def _steps_live(breakdown: dict) -> float:
    """The live-tensor peak of the training steps alone (where the run went on to the epoch's end),
    what an oracle of the training describes; else the run's."""
    return breakdown.get("live_tensor_peak_steps", breakdown["live_tensor_peak"])


def _kind(message: str, doc) -> str:
    """The failure's kind: from the JSON when vest gives one, else from the message's words."""
    if isinstance(doc, dict) and doc.get("kind"):
        return doc["kind"]
    m = message.lower()
    if "time limit" in m or "memory limit" in m:
        return "limit"
    if "data-dependent" in m:
        return "data-dependent"
    if "tried to use the network" in m or "tried to start a process" in m or "tried to write" in m:
        return "refused-io"
    if "failed by itself" in m or "exited with status" in m:
        return "script-error"
    if "without an optimizer step" in m:
        return "no-step"
    return "vest-unsupported"


_REFUSALS = ("data-dependent", "refused-io", "limit", "no-gpu")   # vest declined for a stated reason


def run_one(entry: dict, mirror: str, work: str, gpu: str, oracles: bool = True) -> dict:
    slug = entry["name"].replace("/", "__")
    base = os.path.join(work, slug)
    shutil.rmtree(base, ignore_errors=True)
    extract(mirror, entry["repo"], entry["commit"], entry["tree"], base)
    workdir = os.path.join(base, entry.get("workdir", "."))
    os.makedirs(workdir, exist_ok=True)
    RECIPES[entry.get("recipe", "none")](workdir, **entry.get("recipe_args", {}))
    vest = [sys.executable, "-m", "vest_slurm.cli", "estimate", "--gpu", gpu, "--json"]
    dyn = measure(vest + ["--", *shlex.split(entry["command"])], workdir, entry.get("env"))
    row = {"script": entry["name"], "family": entry["family"], "repo": entry["repo"],
           "commit": entry["commit"][:12], "command": entry["command"],
           "seconds": round(dyn["seconds"], 1), "peak_rss_mib": round(dyn["maxrss_kib"] / 1024)}
    est = (dyn["json"] or {}).get("estimates") if dyn["rc"] == 0 else None
    if est:
        e = est[0]
        row.update(outcome="estimated", kind="", peak_mib=e["peak_mib"],
                   live_mib=e["breakdown"]["live_tensor_peak"],
                   steps_live_mib=_steps_live(e["breakdown"]),
                   flags="; ".join(str(f) for f in (dyn["json"].get("flags") or dyn["json"].get("warnings") or [])),
                   message="")
    else:
        msg = (dyn["json"] or {}).get("error") or _error_text(dyn["stderr"])
        kind = _kind(msg, dyn["json"])
        row.update(outcome="refused" if kind in _REFUSALS else "failed", kind=kind, peak_mib="", live_mib="",
                   flags="", message=msg)
    row["expected"] = entry.get("expect", "estimated")
    row.update(oracle="", oracle_kind="", oracle_s="", oracle_est_live_mib="", oracle_live_mib="", oracle_diff_pct="", declarative_s="", time_ratio="")
    if not oracles:
        row["oracle"] = "not run (--no-oracle)"
    elif entry.get("oracle") and row["outcome"] == "estimated":
        dec = measure(vest + shlex.split(entry["oracle"]), workdir)
        dest = (dec["json"] or {}).get("estimates") if dec["rc"] == 0 else None
        if dest:
            lo = dest[0]["breakdown"]["live_tensor_peak"]
            if (dec["json"].get("workload") or {}).get("parallelism") == "ddp" and \
                    (dec["json"].get("workload") or {}).get("num_gpus", 1) > 1:
                # The declarative estimate adds DDP's buckets (one per gradient, in its dtype) to
                # the replay after its single-GPU trace (estimator.py, "ddp_buckets"), not to its
                # live tensors; the script's run traces DDP's Reducer, whose buckets are tensors.
                lo = round(lo + dest[0]["breakdown"]["gradients"], 1)
            gap = row["steps_live_mib"] - lo
            diff = 100 * gap / lo if lo else 0.0
            agree = abs(gap) <= RESOLUTION_MIB or abs(gap) <= AGREE * lo
            row.update(oracle_kind="declarative", oracle_est_live_mib=row["steps_live_mib"], oracle_live_mib=lo,
                       oracle_diff_pct=round(diff, 1), declarative_s=round(dec["seconds"], 1),
                       time_ratio=round(dyn["seconds"] / dec["seconds"], 2), oracle="agree" if agree else "DISAGREE")
        else:
            row["oracle"] = "oracle-failed: " + _error_text(dec["stderr"])[:120]
    elif row["outcome"] == "estimated":
        _live_oracle(entry, row, vest, workdir)
    elif not entry.get("oracle"):
        row["oracle"] = "none: " + entry.get("oracle_why", "")
    return row


def _live_oracle(entry: dict, row: dict, vest: list[str], workdir: str) -> None:
    """The second oracle, for a script with no declarative form: the same script run for real on
    the CPU (vest_slurm/dynamic/live_oracle.py) at the entry's ``live_oracle`` command (a reduced
    size: a smaller batch; the script's own command when it has none), its device tensors counted;
    compared with vest's live-tensor peak of that same command, within 10%."""
    from vest_slurm.dynamic.live_oracle import run_command
    from vest_slurm.dynamic.runner import DEFAULT_STEPS

    command = entry.get("live_oracle") or entry["command"]
    est_live = row["steps_live_mib"]   # the oracle's run stops at its steps (no epoch's end)
    if command != entry["command"]:   # vest at the reduced size too
        red = measure(vest + ["--", *shlex.split(command)], workdir, entry.get("env"))
        est = (red["json"] or {}).get("estimates") if red["rc"] == 0 else None
        if not est:
            row["oracle"] = "live-oracle: vest failed at the reduced size: " + _error_text(red["stderr"])[:120]
            return
        est_live = _steps_live(est[0]["breakdown"])
    res = run_command(command, workdir, DEFAULT_STEPS, user_env=user_env(workdir, entry.get("env")))   # what vest was given
    row["oracle_kind"] = "live-cpu"
    row["oracle_s"] = round(res.get("seconds", 0.0), 1)
    if res["status"] != "ok":
        row["oracle"] = f"live-oracle-{res['status']}: {res.get('message', '')[:160]}"
        return
    lo = round(res["live_peak_bytes"] / 2**20, 1)
    gap = est_live - lo
    agree = abs(gap) <= RESOLUTION_MIB or abs(gap) <= AGREE * lo
    row.update(oracle_live_mib=lo, oracle_est_live_mib=est_live, oracle_diff_pct=round(100 * gap / lo, 1) if lo else 0.0,
               oracle="agree" if agree else "DISAGREE")


def _error_text(stderr: str) -> str:
    """The `vest: error: ...` line and its `fix:` line, or the last lines when there is none."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    err = next((i for i, ln in enumerate(lines) if ln.startswith("vest: error")), None)
    if err is None:
        return " | ".join(lines[-3:])
    fix = next((ln for ln in lines[err + 1:] if ln.startswith("fix:")), "")
    return (lines[err][len("vest: error: "):] + (" | " + fix if fix else ""))[:600]


FIELDS = ["script", "family", "outcome", "expected", "kind", "seconds", "declarative_s", "time_ratio", "peak_rss_mib",
          "peak_mib", "live_mib", "oracle_kind", "oracle_est_live_mib", "oracle_live_mib", "oracle_diff_pct", "oracle",
          "oracle_s", "flags", "message",
          "repo", "commit", "command"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mirror", required=True, help="folder of bare mirrors OWNER+NAME/repo")
    p.add_argument("--corpus", default=CORPUS)
    p.add_argument("--only", action="append", default=[], help="run the scripts whose name contains this (repeatable)")
    # not under /tmp or /var/tmp: the estimate's child runs under bubblewrap with fresh tmpfs there
    # (vest_slurm/dynamic/bwrap.py), so a job directory in them does not exist for the script
    p.add_argument("--work", default=os.path.join(os.path.expanduser("~"), ".cache", "vest-slurm", "corpus"),
                   help="scratch folder for the scripts and their data (default: ~/.cache/vest-slurm/corpus)")
    p.add_argument("--gpu", default="a100-80gb")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "scripts-results.csv"))
    p.add_argument("--no-oracle", action="store_true",
                   help="estimate only, no oracle (a quick pass: outcomes and live peaks against an earlier results file)")
    p.add_argument("--merge", action="store_true",
                   help="with --only: replace those scripts' rows in --out and keep the others (in corpus order)")
    args = p.parse_args()
    with open(args.corpus, "rb") as f:
        corpus = tomllib.load(f)["script"]
    names = [e["name"] for e in corpus]
    if len(set(names)) != len(names):
        raise SystemExit("corpus: duplicate script names")
    chosen = [e for e in corpus if not args.only or any(s in e["name"] for s in args.only)]
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = ROOT + (os.pathsep + env_path if env_path else "")
    rows = []
    t0 = time.perf_counter()
    for e in chosen:
        try:
            row = run_one(e, os.path.abspath(args.mirror), work, args.gpu, oracles=not args.no_oracle)
        except Exception as exc:   # the runner's own failure on one script: recorded, the corpus goes on
            row = {f: "" for f in FIELDS} | {"script": e["name"], "family": e["family"], "outcome": "failed",
                                             "kind": "runner-error", "seconds": 0.0, "peak_rss_mib": 0,
                                             "message": f"bench_scripts: {type(exc).__name__}: {exc}"}
        # a results file holds no machine paths: the scratch folder is named <work>
        row["message"] = str(row.get("message", "")).replace(work + os.sep, "<work>/")
        row["message"] = re.sub(r"\S*/vest-dynamic-\w+\.log", "<kept log>", row["message"])   # a machine path
        row["message"] = row["message"].replace(os.path.expanduser("~") + os.sep, "~/")   # a cache under the home
        rows.append(row)
        print(f"{row['script']:45s} {row['outcome']:9s} {row['kind']:16s} {row['seconds']:6.1f}s "
              f"{row['peak_rss_mib']:5d} MiB  {row['oracle'][:40]}  {row['message'][:100]}", flush=True)
    if args.merge and os.path.exists(args.out):
        with open(args.out, newline="") as f:
            kept = {r["script"]: r for r in csv.DictReader(f)}
        kept.update({r["script"]: r for r in rows})
        rows = [kept[n] for n in names if n in kept]
        for r in rows:   # numbers read back from the CSV are text
            r["peak_rss_mib"] = int(float(r["peak_rss_mib"] or 0))
            r["seconds"] = float(r["seconds"] or 0)
    _report(rows, time.perf_counter() - t0)
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {os.path.relpath(args.out, ROOT)}")
    return 0


def _report(rows: list[dict], seconds: float) -> None:
    from tabulate import tabulate

    cols = ["script", "outcome", "kind", "seconds", "time_ratio", "peak_rss_mib", "live_mib", "oracle_diff_pct", "oracle"]
    print(tabulate([[str(r[c])[:48] for c in cols] for r in rows], headers=cols))
    n = len(rows)
    est = sum(r["outcome"] == "estimated" for r in rows)
    ref = sum(r["outcome"] == "refused" for r in rows)
    bad = sum(r["oracle"] == "DISAGREE" for r in rows)
    checked = sum(r["oracle"] in ("agree", "DISAGREE") for r in rows)
    runnable = [r for r in rows if r["expected"] == "estimated"]   # offline, on a GPU (the rest: expect_why)
    est_runnable = sum(r["outcome"] == "estimated" for r in runnable)
    print(f"\n{n} scripts: {est} estimated ({100 * est / max(n, 1):.0f}%), {ref} refused, {n - est - ref} failed; "
          f"of the {len(runnable)} a GPU job could run offline, {est_runnable} estimated "
          f"({100 * est_runnable / max(len(runnable), 1):.0f}%); "
          f"oracle: {checked} checked, {bad} disagree (> {100 * AGREE:.0f}%); "
          f"peak RSS max {max((r['peak_rss_mib'] for r in rows), default=0)} MiB; {seconds:.0f} s in all")


if __name__ == "__main__":
    sys.exit(main())
