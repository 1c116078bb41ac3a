"""`vsbatch [sbatch options] job.sh [script args]`: sbatch that estimates the job's GPU memory and
places it first. The command itself is ``site/vsbatch.py``; this is its entry point."""

from __future__ import annotations

from typing import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    from .estimate import oneshot
    from .site.vsbatch import run

    oneshot.begin()
    # without the interpreter's teardown: freeing torch and the traces took 0.5 to 3.5 s here after
    # the job id was printed (oneshot.leave runs the atexit handlers, as the normal exit does)
    oneshot.leave(run(argv))


if __name__ == "__main__":
    main()
