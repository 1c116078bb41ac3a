"""`vsbatch [sbatch options] job.sh [script args]`: sbatch that estimates the job's GPU memory and
places it first. The command itself is ``site/vsbatch.py``; this is its entry point."""

from __future__ import annotations

import os
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    from .site.vsbatch import run

    code = run(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: freeing torch and the traces took 0.5 to 3.5 s here after the
    # job id was printed, and nothing of ours needs it (output flushed, the script copy removed).
    os._exit(code)


if __name__ == "__main__":
    main()
