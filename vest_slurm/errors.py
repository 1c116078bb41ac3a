"""The tool's own exceptions and exit codes.

Only the entry points (``vest``, ``vsbatch``, the bridge) turn these into a message and an exit
code; everything below them raises. Each error says what happened and what to do about it.
"""

from __future__ import annotations

import weakref

EXIT_OK = 0
EXIT_BAD_INPUT = 2      # the user's script, options or the site config are wrong
EXIT_NO_FIT = 3         # the job fits no GPU of the site (vsbatch refuses, nothing queued)
EXIT_SLURM = 4          # Slurm could not be asked (controller down, timeout, missing tools)
EXIT_ESTIMATE = 5       # the workload could not be traced (user code failed, data-dependent shapes)


class VestError(Exception):
    """An error the user can act on. ``what`` says what happened, ``fix`` what to do."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, what: str, fix: str | None = None, kind: str | None = None, where: str | None = None):
        super().__init__(what)
        self.what = what
        self.fix = fix
        # who must act, for --json (dynamic analysis: vest-unsupported, script-error, limit,
        # data-dependent, no-gpu: the script trains on the host) and the script's file:line it
        # happened at; None where not known
        self.kind = kind
        self.where = where

    def to_dict(self) -> dict:
        return {"error": self.what, "kind": self.kind, "where": self.where, "fix": self.fix}

    def __str__(self) -> str:
        return self.what if not self.fix else f"{self.what}\n  fix: {self.fix}"


class WorkloadError(VestError):
    """The workload description is wrong (unknown model, malformed shape, bad option)."""


class EstimateError(VestError):
    """Tracing the workload failed (user code raised, shapes depend on data, limits hit)."""

    exit_code = EXIT_ESTIMATE


class SiteConfigError(VestError):
    """The site configuration is invalid; ``problems`` lists every problem found."""

    def __init__(self, path: str, problems: list[str], fix: str | None = None):
        self.path = path
        self.problems = list(problems)
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"invalid site config {path}:\n{body}",
            fix or "correct the file (see site-config/example-site.toml for every key) and run `vest site validate`",
        )


class JobScriptError(VestError):
    """The job script cannot be read or has malformed #SBATCH / #VEST lines."""


class SlurmError(VestError):
    """Slurm could not be asked: controller down, too slow, or client tools missing."""

    exit_code = EXIT_SLURM


# The stops vest raises inside a training script's run (a value the data decides, an API it cannot
# answer): listed while dynamic analysis runs one (bootstrap.run), so that a stop the script caught
# in its own ``except`` and went on past is said (bootstrap.swallowed_stops), not estimated as if the
# script had taken that path on a GPU. At most MAX_STOPS, the first ones. Each entry: [the stop, or a
# weak reference to it once settled; its record (where raised, where caught), or None].
STOPS: list | None = None
MAX_STOPS = 16
SETTLE = None        # the run's: a stop -> its record, from its traceback as it is now (or None)
UNSETTLED = False    # a stop was noted since the last settle_stops()


def _stop_of(entry):
    ref = entry[0]
    return ref() if isinstance(ref, weakref.ref) else ref


def note_stop(e: BaseException) -> None:
    global UNSETTLED
    if STOPS is not None and len(STOPS) < MAX_STOPS and not any(_stop_of(s) is e for s in STOPS):
        STOPS.append([e, None])
        UNSETTLED = True


def settle_stops() -> None:
    """Take each stop noted since the last call (raised, and caught by now: fake CUDA calls this
    before its next op) into its record, and hold it weakly from then on. Its traceback holds the
    frames it unwound, and those frames their locals: held to the run's end, they kept what the
    failed code made (an AMP self-test's copy of the model, its outputs) in the estimate, where the
    GPU run frees it when the script lets the exception go. A stop that cannot be held weakly (a
    built-in exception type) is kept as before."""
    global UNSETTLED
    UNSETTLED = False
    for entry in STOPS or ():
        stop = entry[0]
        if isinstance(stop, weakref.ref) or stop.__traceback__ is None or SETTLE is None:
            continue   # (one made and not raised yet stays held: read at the run's end, as before)
        entry[1] = SETTLE(stop)
        try:
            entry[0] = weakref.ref(stop)
        except TypeError:
            pass


def stops() -> list[tuple]:
    """(the stop, or None where the script has let it go; its record) for each noted stop."""
    return [(_stop_of(entry), entry[1]) for entry in STOPS or ()]


class Relaunch(BaseException):
    """Raised inside a training script's run where it starts a training launcher itself (torchrun's
    ``run()`` called in its own process, as ``tune run --nproc_per_node N`` does, or a torchrun,
    accelerate or deepspeed command as a child process): what the job trains is that launch, and
    the estimate runs it instead. ``argv``: the launch's command, ``cwd`` where it runs, ``env`` the
    variables the script set for it. A BaseException: a script's ``except Exception`` lets it go."""

    def __init__(self, argv: list[str], cwd: str, env: tuple = ()):
        global RELAUNCHED
        super().__init__(" ".join(argv))
        self.argv, self.cwd, self.env = list(argv), cwd, tuple(env)
        RELAUNCHED = RELAUNCHED or self   # (held: a script's bare `except:` may swallow it)


RELAUNCHED: Relaunch | None = None   # the run's first launch the script started


class FailsOnAGpu(RuntimeError):
    """Raised by a stand-in where the real API fails the same way on a GPU (its own check, with its
    own words): the script must act, not vest."""


class NotSupportedHere(RuntimeError):
    """Raised inside a training script's run with fake CUDA at a torch API the run cannot answer
    faithfully: vest must act, not the script (dynamic analysis classifies it vest-unsupported)."""

    def __init__(self, api: str, why: str):
        super().__init__(f"vest cannot yet run {api} in its dynamic analysis (fake CUDA): {why}. "
                         "Describe the workload with a #VEST line (e.g. #VEST --model ... --batch-size ...) instead")
        self.api = api
        note_stop(self)
