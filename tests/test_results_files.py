"""Results files under benchmarks/ name paths relative to the checkout (issue 22 item 4): a results
file is read on other machines, and the machine that wrote it is nobody's business. The scan covers
every committed text file there, so a new benchmark that writes its own path fails here."""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

# A machine's own path: a home, the temp dir, a checkout under /work, /root or /home, a user's
# site-packages. Quoted or at a field start, so a word such as "I/O" never matches.
MACHINE_PATH = re.compile(r"""(?:^|[\s"',=(])(/(?:work|root|home|tmp|opt|usr|var|mnt|scratch)/[^\s"',)]*)""")


def test_the_pattern_finds_machine_paths_and_nothing_else():
    assert MACHINE_PATH.search('"script": "/work/main/scripts/examples/a.sbatch"')
    assert MACHINE_PATH.search("log,/tmp/vest-abc/child.log")
    assert MACHINE_PATH.search("at /root/.cache/vest")
    assert not MACHINE_PATH.search('"script": "scripts/examples/a.sbatch", "I/O": "1/2", "p99/max"')


def test_committed_results_files_hold_no_machine_paths():
    offenders = []
    for f in sorted((REPO / "benchmarks").rglob("*")):
        if not f.is_file() or f.suffix.lower() in {".png", ".pickle", ".pkl", ".gz"}:
            continue
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            m = MACHINE_PATH.search(line)
            if m:
                offenders.append(f"{f.relative_to(REPO)}:{n}: {m.group(1)}")
    assert not offenders, "machine paths in results files:\n" + "\n".join(offenders[:20])


def test_bench_vsbatch_writes_paths_relative_to_the_checkout(tmp_path):
    import bench_vsbatch

    assert bench_vsbatch.checkout_relative(REPO / "scripts" / "examples" / "resnet50-amp.sbatch") == \
        "scripts/examples/resnet50-amp.sbatch"
    outside = tmp_path / "job.sbatch"
    assert bench_vsbatch.checkout_relative(outside) == "job.sbatch"
