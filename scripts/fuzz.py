#!/usr/bin/env python3
"""Long fuzzing runs of the bridge's inputs: the targets and strategies of tests/fuzz_targets.py
(job scripts, attached estimates, the request lines job_submit.lua sends), N cases per target.

Two phases per target: --corpus cases drawn by hypothesis from the strategies (about 10 ms each to
generate), then mutations of that corpus up to N (the corpus-and-mutation scheme of AFL and
libFuzzer: byte flips, inserts, deletes, duplicated chunks, splices of two inputs, tokens of the
formats — #SBATCH, #VEST, #VEST-ESTIMATE v1, JSON punctuation, option names — spliced in; text
targets get the mutated bytes decoded with surrogateescape, as the bridge decodes them).

Every input must get a decision or a clear error (see fuzz_targets.py for what each target checks).
Prints, per target, the cases run, the failures (with the first failing input), the outcomes seen
and the time taken; writes the table to --out (paths relative to the checkout).

    python scripts/fuzz.py [-n 100000] [--corpus 2000] [--target protocol ...] [--seed 0]
        [--out benchmarks/fuzz-results.json]

Exit 0 when no target failed, 1 otherwise. Hypothesis draws without shrinking or its example
database, and the mutations come from random.Random(--seed): a run is reproducible from --seed.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from fuzz_targets import SBATCH_OPTIONS, TARGETS, VALUES, VEST_WORDS  # noqa: E402

TOKENS = tuple(t.encode("utf-8", "surrogateescape") for t in (
    "#!/bin/bash\n", "#SBATCH ", "#VEST ", "#VEST-ESTIMATE v1 ", "\n", "\r\n", "\0", "=", " ", "'", '"', "\\",
    '{"v":1,', '"uid":1001,', '"script":"', '"partition":"', '"tres_per_node":"gres:gpu:', "null", "true", "1e999",
    "-0", "[", "]", "{", "}", ",", ":", "\\u0000", "\\ud800", *SBATCH_OPTIONS, *VALUES, *VEST_WORDS))
MAX_MUTATED = 1 << 20        # keep a mutated case under 1 MiB (the targets bound their own inputs too)


class Mutator:
    def __init__(self, corpus: list[bytes], rng: random.Random):
        self.corpus, self.rng = corpus, rng

    def __call__(self) -> bytes:
        r = self.rng
        data = bytearray(r.choice(self.corpus))
        for _ in range(r.randint(1, 6)):
            op = r.randrange(7)
            i = r.randint(0, len(data))
            if op == 0 and data:                      # flip a bit
                j = r.randrange(len(data))
                data[j] ^= 1 << r.randrange(8)
            elif op == 1:                             # insert random bytes
                data[i:i] = bytes(r.randrange(256) for _ in range(r.randint(1, 8)))
            elif op == 2 and data:                    # delete a run
                del data[i:i + r.randint(1, 64)]
            elif op == 3 and data:                    # duplicate a chunk
                j = r.randrange(len(data))
                data[i:i] = data[j:j + r.randint(1, 256)] * r.randint(1, 4)
            elif op == 4:                             # splice in another input's part
                other = r.choice(self.corpus)
                j = r.randint(0, len(other))
                data[i:] = other[j:]
            elif op == 5:                             # a token of the formats
                data[i:i] = r.choice(TOKENS)
            elif op == 6 and data:                    # an interesting byte
                data[r.randrange(len(data))] = r.choice((0, 10, 13, 34, 39, 92, 0x7f, 0xc0, 0xff))
        return bytes(data[:MAX_MUTATED])


def run_target(name: str, n: int, corpus_n: int, base_seed: int) -> dict:
    strategy, check = TARGETS[name]
    as_text = name not in ("protocol", "lua")      # these draw bytes
    outcomes: collections.Counter = collections.Counter()
    failures: list[dict] = []
    corpus: list[bytes] = []
    t0 = time.perf_counter()

    def one(x) -> None:
        try:
            outcomes[check(x).split(":")[0]] += 1
        except Exception as e:               # a crash or a broken property: recorded, the run goes on
            if len(failures) < 20:
                failures.append({"error": f"{type(e).__name__}: {e}"[:500], "input": repr(x)[:2000],
                                 "where": traceback.format_exc(limit=-3)[-1500:]})
            outcomes["FAILED"] += 1

    @seed(base_seed)
    @settings(max_examples=min(corpus_n, n), deadline=None, database=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def drawn(x):
        corpus.append(x.encode("utf-8", "surrogateescape") if as_text else x)
        one(x)

    drawn()
    generated = len(corpus)
    t_gen = time.perf_counter() - t0
    mutate = Mutator(corpus, random.Random(base_seed))
    for k in range(n - generated):
        data = mutate()
        one(data.decode("utf-8", "surrogateescape") if as_text else data)
        if (k + 1) % 20000 == 0:
            print(f"  {name}: {generated + k + 1}/{n} cases, {outcomes['FAILED']} failed, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return {"target": name, "cases": generated + max(0, n - generated), "drawn": generated,
            "mutated": max(0, n - generated), "failed": outcomes["FAILED"],
            "seconds": time.perf_counter() - t0, "seconds_drawing": t_gen,
            "outcomes": dict(outcomes.most_common()), "failures": failures}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=100_000, help="cases per target (default 100000)")
    ap.add_argument("--corpus", type=int, default=2000, help="cases drawn by hypothesis before mutating (default 2000)")
    ap.add_argument("--target", action="append", choices=sorted(TARGETS), default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON results file")
    a = ap.parse_args()
    rows = [run_target(t, a.n, a.corpus, a.seed) for t in (a.target or list(TARGETS))]
    print(f"{'target':<10} {'cases':>8} {'drawn':>6} {'mutated':>8} {'failed':>7} {'seconds':>8}  outcomes")
    for r in rows:
        outs = ", ".join(f"{k} {v}" for k, v in r["outcomes"].items())
        print(f"{r['target']:<10} {r['cases']:8d} {r['drawn']:6d} {r['mutated']:8d} {r['failed']:7d} "
              f"{r['seconds']:8.0f}  {outs}")
        for f in r["failures"][:3]:
            print(f"  FAILED: {f['error']}\n    input: {f['input'][:300]}")
    if a.out:
        Path(a.out).write_text(json.dumps({"seed": a.seed, "cases_per_target": a.n, "corpus": a.corpus,
                                           "targets": rows}, indent=1) + "\n")
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
