"""Stand-ins for libraries a script may import, put in place when it imports them (not before: an
import the script never makes costs every run its time).

``installed(hooks)`` puts a finder first on ``sys.meta_path`` for the run: when the script imports
a module named in ``hooks``, the module is loaded as usual and then handed to its hook. A module
already imported is handed over at once.

The hooks here:
- transformers' ``PreTrainedModel.from_pretrained``: which models it loaded (LOADED_PRETRAINED), for
  the note on the Hub kernels it would have swapped in (bootstrap.hub_kernels_note); its
  ``is_fake_tensor``, false for vest's fake CUDA tensors (_transformers_tracing).
- Lightning's subprocess launcher (Fabric.launch(), a Trainer of N devices run by ``python
  train.py``): rank 0 runs here, the other ranks' processes are not started (_lightning_launcher).
- pynvml: NVML as the job's node answers it (nvidia_smi.fake_nvml).
- deepspeed: ``initialize`` refused with the declarative workload its config describes; ray:
  ``init`` refused (its workers run the training in processes of their own).
- datasets' ``Dataset.map`` / ``Dataset.filter`` with ``num_proc`` (HF examples'
  ``--preprocessing_num_workers``; ``DatasetDict.map`` calls them per split): they would fork a pool
  of worker processes (and a manager process) to preprocess the data set; the run has one process
  (bootstrap.py refuses forks), so they run in it, as DataLoader's workers do (standins.py). The
  data is the same; no GPU memory depends on where it was computed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import inspect
import sys


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, hooks: dict):
        self.hooks = dict(hooks)

    def find_spec(self, name, path, target=None):
        if name not in self.hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        hook, real_exec = self.hooks.pop(name), loader.exec_module

        def exec_module(module):
            real_exec(module)
            hook(module)

        loader.exec_module = exec_module
        return spec


@contextlib.contextmanager
def installed(hooks: dict):
    """``hooks``: module name -> fn(module), each run once, when the module is first imported."""
    pending = {}
    for name, hook in hooks.items():
        if name in sys.modules:
            hook(sys.modules[name])
        else:
            pending[name] = hook
    finder = _Finder(pending)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)


def _in_this_process(fn):
    """``fn`` (Dataset.map / filter) with ``num_proc`` None, however it was passed."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            bound = sig.bind_partial(*args, **kwargs)
        except TypeError:
            return fn(*args, **kwargs)   # the library's own error
        if bound.arguments.get("num_proc"):
            bound.arguments["num_proc"] = None
        return fn(*bound.args, **bound.kwargs)

    return call


def _datasets(module) -> None:
    cls = getattr(module, "Dataset", None)
    for name in ("map", "filter"):
        fn = getattr(cls, name, None)
        if fn is not None and "num_proc" in inspect.signature(fn).parameters:
            setattr(cls, name, _in_this_process(fn))


# models transformers' from_pretrained loaded (since transformers 5 it kernelizes them unless
# USE_HUB_KERNELS says no; a model built from its constructor is not: bootstrap.hub_kernels_note)
LOADED_PRETRAINED: list = []


def _transformers_models(module) -> None:
    cls = getattr(module, "PreTrainedModel", None)
    real = getattr(cls, "from_pretrained", None)
    if real is None:
        return

    @functools.wraps(real.__func__ if hasattr(real, "__func__") else real)
    def from_pretrained(klass, *args, **kwargs):
        model = real.__func__(klass, *args, **kwargs) if hasattr(real, "__func__") else real(*args, **kwargs)
        LOADED_PRETRAINED.append(type(model))
        return model

    cls.from_pretrained = classmethod(from_pretrained)


class _OtherRank:
    """What the launcher keeps for a rank it would have started: running (poll() None) for its
    process observer, which ends the run only when a child fails."""

    pid, returncode = -1, None

    def __init__(self, *args, **kwargs):
        pass

    def poll(self):
        return None

    def wait(self, timeout=None):
        return 0

    def kill(self):
        pass

    terminate = kill

    def send_signal(self, sig):
        pass


class _NoChildren:
    Popen = _OtherRank


def _lightning_launcher(module) -> None:
    """Lightning's _SubprocessScriptLauncher (``Fabric.launch()``, ``Trainer(strategy="ddp",
    devices=N)`` in a script run as ``python train.py``): rank 0 runs in this process and the script
    is run again for ranks 1..N-1 with subprocess.Popen, which the run refuses (their GPU work would
    be missing). Those ranks run the same step on their own GPUs, as torch.multiprocessing.spawn's
    do (standins._spawn): they are not started; the launcher sets rank 0's environment (MASTER_ADDR,
    NODE_RANK, LOCAL_RANK, WORLD_SIZE) as it does, and the process group of N ranks is the fake one."""
    cls = getattr(module, "_SubprocessScriptLauncher", None)
    real = getattr(cls, "_call_children_scripts", None)
    if real is None or not hasattr(module, "subprocess"):
        return

    @functools.wraps(real)
    def _call_children_scripts(self):
        started, module.subprocess = module.subprocess, _NoChildren
        try:
            return real(self)
        finally:
            module.subprocess = started

    cls._call_children_scripts = _call_children_scripts


def _transformers_tracing(module) -> None:
    """transformers' ``is_tracing(tensor)`` says True for any FakeTensor (it takes one for torch.export
    or compile tracing), and then keeps what a GPU run skips: the 4-D attention mask SDPA would not
    need (masking_utils' ``_ignore_causal_mask_sdpa``: an all-ones mask is dropped for ``is_causal``)
    and the key/value copies per head that native GQA would not make (``use_gqa_in_sdpa`` needs no
    mask), each kept for backward: Llama-style fine-tunes came out 10-23% high, growing with the
    sequence. vest's fake CUDA tensors stand for a GPU's tensors in an eager run: not tracing."""
    real = getattr(module, "is_fake_tensor", None)
    if real is None:
        return

    @functools.wraps(real)
    def is_fake_tensor(x) -> bool:
        from ..estimate import _fakecuda as fc

        if isinstance(getattr(x, "fake_mode", None), fc.FakeCudaMode):
            return False
        return real(x)

    module.is_fake_tensor = is_fake_tensor


# the environment the run started with: what a script set before it launched is the launch's
START_ENV: dict = {}


def _torchrun_in_process(module) -> None:
    """torch.distributed.run's ``run(args)`` called by the script itself (``tune run
    --nproc_per_node N recipe``, a launcher of a project's own, accelerate's launch code run in
    Python): it would start N processes of the training script; the estimate runs that launch
    instead (errors.Relaunch: the runner estimates the command ``python -m torch.distributed.run``
    with the same options, as if the job ran it)."""
    real = getattr(module, "run", None)
    if real is None:
        return

    @functools.wraps(real)
    def run(args):
        import os

        from ..errors import Relaunch

        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={args.nnodes}",
                f"--nproc_per_node={args.nproc_per_node}"]
        argv += ["-m"] * bool(getattr(args, "module", False)) + ["--no-python"] * bool(getattr(args, "no_python", False))
        raise Relaunch(argv + [args.training_script, *args.training_script_args], os.getcwd(), set_since_start(os.environ))

    module.run = run


def set_since_start(env) -> tuple:
    """The (name, value) pairs of ``env`` not as the run started (what the script set)."""
    return tuple((k, v) for k, v in env.items() if START_ENV.get(k) != v)


def _nvml(module) -> None:
    from .nvidia_smi import fake_nvml

    fake_nvml(module)


def _deepspeed(module) -> None:
    """``deepspeed.initialize`` in a script whose command named no DeepSpeed (its config a dict in
    the code: DeepSpeedExamples, most tutorials): it built DeepSpeed's ops with nvcc (minutes), then
    failed on fake CUDA, skipped every step on fake overflow checks, or ran ZeRO untraced as such
    and was labelled data parallel. Refused at the call, as a command that names DeepSpeed is
    (deepspeed_plan.py), with the declarative workload its config describes."""
    from ..errors import NotSupportedHere
    from .deepspeed_plan import plan_of_initialize

    def initialize(*args, **kwargs):
        config = kwargs.get("config", kwargs.get("config_params"))
        found = plan_of_initialize(config, kwargs.get("args", args[0] if args else None))
        raise NotSupportedHere("deepspeed.initialize", f"{found.what} (from {found.source}) is not traced by the "
                               f"dynamic estimate; describe the workload declaratively: {found.vest_line}")

    module.initialize = initialize


def _ray(module) -> None:
    """``ray.init`` (called by the script, or by Ray Train's and Tune's trainers on their own): Ray
    starts its server and worker processes, and the training runs in a worker, outside the one
    process vest traces (under bubblewrap they started and failed a different way on each run:
    a server timeout, a write to ~/ray_results, a worker with no driver). Refused at the call."""
    from ..errors import NotSupportedHere

    def init(*_args, **_kwargs):
        raise NotSupportedHere("ray.init", "Ray runs the training in worker processes it starts, which the dynamic "
                               "estimate (one traced process) does not follow; estimate the training function's own "
                               "script (a plain or torchrun launch of the same loop), or describe the workload with a "
                               "#VEST line")

    module.init = init


HOOKS = {"deepspeed": _deepspeed, "ray": _ray, "datasets.arrow_dataset": _datasets, "transformers.modeling_utils": _transformers_models,
         "torch.distributed.run": _torchrun_in_process, "pynvml": _nvml,
         "transformers.utils.import_utils": _transformers_tracing,
         **{f"{pkg}.strategies.launchers.subprocess_script": _lightning_launcher
            for pkg in ("lightning.fabric", "lightning_fabric", "lightning.pytorch", "pytorch_lightning")}}
