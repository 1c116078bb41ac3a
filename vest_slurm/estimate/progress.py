"""Progress on stderr while long work runs: traces, a training script run, the batch search.

In: ``step(text)`` calls from the work (advice.Prober before each trace, the callers of the
dynamic analysis before the script runs). Out: one tqdm line on stderr, redrawn every half second
with the elapsed time and the last step, when stderr is a terminal; nothing at all when it is not
(a batch job's log, a pipe, a test) or when ``set_quiet(True)`` (``--quiet``; vsbatch: sbatch's
own ``--quiet``/``-Q``) or ``VEST_QUIET=1``. ``done()`` clears the line before the answer prints.
tqdm is imported only when a line is drawn.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

_state = {"quiet": False, "bar": None, "count": 0, "ticker": None}
_lock = threading.Lock()
REFRESH_S = 0.5   # how often the elapsed time is redrawn while one step runs


def set_quiet(quiet: bool) -> None:
    _state["quiet"] = bool(quiet)


def enabled() -> bool:
    if _state["quiet"] or os.environ.get("VEST_QUIET") == "1":
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):   # a replaced or closed stderr
        return False


def step(text: str) -> None:
    """A new step of long work begins (shown as ``[n] text``, with the time since the first)."""
    if not enabled():
        return
    with _lock:
        bar = _state["bar"]
        if bar is None:
            from tqdm import tqdm

            bar = _state["bar"] = tqdm(total=None, file=sys.stderr, leave=False, dynamic_ncols=True,
                                       bar_format="vest: {elapsed} {desc}")
            stop = threading.Event()
            t = threading.Thread(target=_tick, args=(bar, stop), daemon=True)
            _state["ticker"] = (t, stop)
            t.start()
        _state["count"] += 1
        bar.set_description_str(f"[{_state['count']}] {text}", refresh=True)


def _tick(bar, stop: threading.Event) -> None:
    while not stop.wait(REFRESH_S):
        with _lock:
            if _state["bar"] is bar:
                bar.refresh()


@contextlib.contextmanager
def held_for_fork():
    """Around os.fork(): no line is being drawn while the process is copied. The ticker thread
    draws under ``_lock``; a child copied in the middle of a draw would hold stderr's lock with no
    thread left to release it, and hang at its first write (a warning), its parent waiting on it.
    The child calls ``after_fork_in_child`` first."""
    with _lock:
        yield


def after_fork_in_child() -> None:
    """In a forked child: a lock of its own, no line (the ticker thread was not copied), quiet (the
    parent shows progress)."""
    global _lock
    _lock = threading.Lock()
    _state.update(bar=None, ticker=None, count=0, quiet=True)


def done() -> None:
    """Clear the line (before the answer is printed, and at exit)."""
    with _lock:
        bar, ticker = _state["bar"], _state["ticker"]
        _state["bar"] = _state["ticker"] = None
        _state["count"] = 0
    if ticker is not None:
        ticker[1].set()
    if bar is not None:
        bar.close()
