"""The package's layout: stage packages without import circles, and the torch-free parts stay so."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "vest_slurm"
PACKAGES = ("estimate", "dynamic", "slurm", "site", "bridge", "gpu")


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def imports_of(name: str, path: Path) -> set[str]:
    """Every vest_slurm module this one imports, at the top or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in MODULES and t != name)
    return out


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_between_modules():
    assert cycles(GRAPH) == []


def test_no_import_circles_between_stage_packages():
    """Package level: an edge from a stage package to another when one of its modules imports one
    of the other's. The entry points at the top (cli, vsbatch, testbed) and ``__main__`` modules
    may import anything; nothing in a stage package imports them."""
    def stage(mod):
        parts = mod.split(".")
        return parts[1] if len(parts) > 2 and parts[1] in PACKAGES and parts[-1] != "__main__" else None

    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for mod, deps in GRAPH.items():
        s = stage(mod)
        for d in deps:
            t = stage(d)
            if s is not None and t is not None and s != t:
                graph[s].add(t)
            if s is not None and d in ("vest_slurm.cli", "vest_slurm.vsbatch", "vest_slurm.testbed"):
                pytest.fail(f"{mod} imports the entry point {d}")
    assert cycles(graph) == [], graph


def test_no_modules_left_at_the_old_flat_paths():
    flat = {p.stem for p in PKG.glob("*.py")}
    assert flat == {"__init__", "cli", "vsbatch", "testbed", "errors", "units"}


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_alone_and_says_what_it_takes(package):
    r = subprocess.run([sys.executable, "-c", f"import vest_slurm.{package} as m, sys; "
                        "print(len(m.__doc__ or ''), 'torch' in sys.modules)"],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    doc_chars, torch_loaded = r.stdout.split()
    assert int(doc_chars) > 200 and torch_loaded == "False"


def test_slurm_side_and_the_bridge_decision_import_no_torch():
    """vest_slurm.slurm and the bridge's decision path for an attached estimate, in a fresh process:
    the per-call program starts fast and small."""
    code = """
import json, sys
import vest_slurm.slurm.jobscript, vest_slurm.slurm.cluster, vest_slurm.slurm.sbatch, vest_slurm.slurm.attach
from vest_slurm.bridge.decide import decide_bytes
from vest_slurm.bridge.server import BridgeServer
from vest_slurm.site.config import load_site_config
from vest_slurm.slurm.attach import attach, make_payload
from vest_slurm.estimate.record import MemoryEstimate
site = load_site_config("site-config/testbed.toml")
est = {"a100": MemoryEstimate("a100-40gb", 0, 30 << 30, 30 << 30)}
script = attach("#!/bin/bash\\n#SBATCH --gres=gpu:v100:1\\ntrue\\n", make_payload(est))
d = decide_bytes(json.dumps({"v": 1, "uid": 1001, "partition": "v100", "tres_per_node": "gres:gpu:v100:1",
                             "script": script}).encode(), site, users=lambda uid: "alice")
print(d.action, d.reason, sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "transformers")))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["modify", "placed"] or r.stdout.split()[:2] == ["modify", "rerouted"], r.stdout
    assert r.stdout.strip().endswith("[]"), r.stdout


def test_every_test_and_script_imports_from_the_new_places():
    old = ("vest_slurm.tracing", "vest_slurm.workload", "vest_slurm.siteconfig", "vest_slurm.placement",
           "vest_slurm.jobscript", "vest_slurm.estimator", "vest_slurm.dynamic ", "vest_slurm.groundtruth")
    hits = [f"{p.relative_to(REPO)}: {o}" for p in [*REPO.glob("tests/*.py"), *REPO.glob("scripts/*"), *PKG.rglob("*.py")]
            if p.is_file() and p.name != "test_layout.py" for o in old if o in p.read_text(errors="replace")]
    assert hits == []


def test_the_user_guide_stays_short_and_points_to_the_other_guides():
    """README.md is the user guide, at most 15 KB (issue 22); the admin guide and the lab notes live
    beside what they describe, and the README points to both."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= 15_000, f"README.md is {len(readme.encode())} bytes: move detail to a guide"
    assert "site-config/README.md" in readme and "benchmarks/README.md" in readme
    assert (REPO / "site-config" / "README.md").is_file() and (REPO / "benchmarks" / "README.md").is_file()
