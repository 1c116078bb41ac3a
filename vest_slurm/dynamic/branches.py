"""Work a training loop does every K steps that the traced steps did not reach: said, never silent.

Scripts evaluate, sample or save from inside their training loop on a period: ``if step % 500 ==
0 and step > 0: evaluate()``, ``if (it + 1) % args.sample_every == 0: sample()``. Where the first
such step falls after the traced steps (and after the epoch's end, standins.DRAIN_BATCHES), what
that work keeps on the GPU (an evaluation batch, a sampling loop) is not in the trace, and the
estimate would be low with nothing said.

How they are found, in the user's own code only (the script, and modules imported from its
folder; not site-packages, where frameworks keep their loops and their own evaluation rules):
- the files are compiled with a marker call at the start of the body of every ``if`` that sits in
  a loop (``MARK``, a builtin: nothing else of the program changes; line numbers are kept);
- at each training step, the frames of those files on the stack name the lines the steps came
  from; a loop around such a line (in the same function) is a training loop;
- at the run's end, an ``if`` in a training loop that was never entered, whose test reads the
  loop's progress (its target, or a name or attribute the loop increments: ``step += 1``,
  ``self.step += 1``), and whose body calls something beyond logging and checkpoints
  (``HOST_ONLY``, ``HOST_MODULES``; a function of the same file is looked into), is said;
- not where an operand of its test's top-level ``and`` that does not read the progress (a switch
  of the job's configuration: ``args.resume and epoch == start``) was false each time the test
  ran (``OPERAND`` records it; the same value every step, so no later step enters the body), nor
  where the ``if`` around it was never entered.
TorchScript compiles a function from its source file, not from this code, so it sees no marker.

In: the roots of the user's code. Out: ``note()``, the sentence the estimate flags (or None).
"""

from __future__ import annotations

import ast
import builtins
import functools
import os
import sys
from dataclasses import dataclass

from ..estimate import frames

MARK = "__vest_reached__"
OPERAND = "__vest_operand__"

# Calls that keep nothing (or a scalar) on the GPU: printing and logging, values read to the host
# and the scalar reductions taken to log them, clocks, a module's mode switches, checkpoints (a
# state dict holds the tensors the GPU already has; torch.save copies them to the host). A branch
# whose body calls only these (`if step % 100 == 0: print(loss.mean().item())`) is not said.
HOST_ONLY = frozenset({
    "print", "format", "str", "repr", "int", "float", "bool", "len", "range", "round", "min", "max", "abs", "sum",
    "isinstance", "getattr", "hasattr", "setattr", "enumerate", "zip", "list", "dict", "tuple", "set", "sorted",
    "open", "write", "writelines", "flush", "close", "join", "append", "extend", "items", "keys", "values", "update_dict",
    "info", "debug", "warning", "warn", "error", "exception", "log", "log_dict", "add_scalar", "add_scalars",
    "add_text", "set_description", "set_postfix", "set_postfix_str", "perf_counter", "monotonic",
    "strftime", "now", "sleep", "item", "tolist", "cpu", "numpy", "detach", "exit", "quit",
    "mean", "argmax", "argmin", "std", "var", "norm", "numel", "eq", "ne", "size", "dim",
    "parameters", "named_parameters", "eval", "train", "zero_grad", "state_dict", "save", "save_state",
    "save_pretrained", "makedirs", "mkdir", "exists", "asdict", "save_image", "savefig", "imwrite", "seek",
    "strip", "lstrip", "rstrip", "split", "replace", "startswith", "endswith", "encode", "decode", "lower", "upper",
    "BytesIO", "urlparse"})
# Modules whose functions run on the host, called as ``module.function(...)``: ``math.exp(loss)``,
# ``time.ctime()``, ``np.mean(...)``, ``gc.collect()``. Python's standard library (it has no CUDA),
# but for the modules that run or copy the script's own objects (``copy.deepcopy(model)`` is a
# second model on the GPU; threads, pools, ``functools.partial(evaluate)()`` run its functions) and
# the module names scripts also give their own objects (``test.run()``, ``trace.step()``), whose
# calls may be the script's GPU work; and the host libraries scripts log, plot and store with.
_NOT_HOST_ONLY = frozenset({
    "copy", "threading", "multiprocessing", "concurrent", "asyncio", "functools", "operator", "runpy",
    "importlib", "builtins", "contextlib", "weakref", "inspect", "types", "queue", "sched", "signal", "atexit",
    "pdb", "bdb", "cProfile", "profile", "timeit", "unittest", "doctest",
    "test", "trace", "code", "array", "stat", "select", "site", "token", "parser", "symbol", "numbers", "keyword",
    "resource", "platform", "cmd", "wave", "chunk", "struct", "imp", "mailbox", "email", "html", "statistics",
    "calendar", "this", "turtle"})
HOST_LIBRARIES = frozenset({"math", "time", "os", "sys", "json", "logging", "logger", "datetime", "random", "np",
                            "numpy", "shutil", "pathlib", "wandb", "pickle", "csv", "re", "string", "itertools",
                            "fsspec", "tqdm", "warnings", "io", "boto3", "urllib", "subprocess", "glob", "tempfile",
                            "yaml", "plt", "vutils"})   # also called as functions: tqdm(...)
HOST_MODULES = frozenset(set(sys.stdlib_module_names) - _NOT_HOST_ONLY) | HOST_LIBRARIES
SAID = 3   # branches named in the note (the first in file order)


@dataclass(frozen=True)
class _If:
    file: str
    line: int
    test: str            # the condition as written (shortened)
    loops: tuple         # (first, last) lines of the loops around it in its function, innermost first
    progress: bool       # the test reads a loop's target or what the loop increments
    calls: tuple         # what its body calls beyond HOST_ONLY (Branches.work looks into the user's functions)
    within: int | None   # the marked if whose body holds this one (in the same loop)
    switches: tuple      # operands of a top-level `and` that do not read the progress (the job's configuration)
    after: tuple | None = None   # not an if: the rest of a loop's body after the statement on these lines
    arm: bool = False    # not an if: the else arm of one (never said itself; the ifs in it are within it)


def _dotted(node) -> str | None:
    """``a`` / ``self.step`` / ``trainer.state.step``: a name or an attribute chain on one."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _walk_own(nodes):
    """The nodes under ``nodes``, not entering nested functions, lambdas or classes."""
    todo = list(nodes)
    while todo:
        n = todo.pop()
        yield n
        todo.extend(c for c in ast.iter_child_nodes(n)
                    if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)))


def _progress_names(loop) -> set[str]:
    """What advances with ``loop``: its target's names, and the names or attributes its body
    increments (``x += ...``, ``x = x + ...``)."""
    out = set()
    if isinstance(loop, (ast.For, ast.AsyncFor)):
        out |= {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    for n in _walk_own(loop.body):
        if isinstance(n, ast.AugAssign) and (d := _dotted(n.target)):
            out.add(d)
        elif isinstance(n, ast.Assign) and len(n.targets) == 1 and (d := _dotted(n.targets[0])) \
                and isinstance(n.value, ast.BinOp) and _dotted(n.value.left) == d:
            out.add(d)
    return out


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _on_host(call: ast.Call) -> bool:
    root = call.func
    while isinstance(root, (ast.Attribute, ast.Call)):   # boto3.client("s3").upload_fileobj(...)
        root = root.value if isinstance(root, ast.Attribute) else root.func
    if _callee(call) == "step" and isinstance(call.func, ast.Attribute) and "sched" in (_dotted(call.func.value) or "").lower():
        return True   # a learning-rate scheduler's step: arithmetic on the optimizer's lr
    if not isinstance(root, ast.Name):
        return _callee(call) in HOST_ONLY
    return (_callee(call) in HOST_ONLY or root.id in HOST_LIBRARIES
            or (isinstance(call.func, ast.Attribute) and root.id in HOST_MODULES))


def _calls(nodes) -> tuple:
    """The names ``nodes`` call beyond the host (HOST_ONLY, HOST_MODULES), in order (not the markers
    put in already, into an inner loop or if: no call of the script's)."""
    return tuple(dict.fromkeys(name for n in _walk_own(nodes)
                               if isinstance(n, ast.Call) and not _on_host(n) and (name := _callee(n))
                               and name not in (MARK, OPERAND)))


def _mark(ident: int, at) -> ast.Expr:
    """The statement ``MARK(ident)``, at ``at``'s place."""
    return ast.copy_location(ast.Expr(ast.Call(ast.Name(MARK, ast.Load()), [ast.Constant(ident)], [])), at)


def _is_mark(node) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and \
        isinstance(node.value.func, ast.Name) and node.value.func.id == MARK


class _Marker(ast.NodeTransformer):
    def __init__(self, owner: "Branches", filename: str, source: str):
        self.owner, self.filename, self.source = owner, filename, source
        self.loops: list = []   # the loops around the node visited, in its function
        self.within: list = []  # the marked ifs whose body holds it, in its innermost loop

    def _loop_lines(self) -> tuple:
        """(first, last) lines of the loops around the node visited, innermost first."""
        return tuple((lp.lineno, lp.end_lineno) for lp, _ in reversed(self.loops))

    def _scope(self, node, loop=None):
        outer = self.loops, self.within
        self.loops, self.within = ([*self.loops, (node, _progress_names(node))] if loop else []), []
        self.generic_visit(node)
        self.loops, self.within = outer
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = _scope

    def _loop(self, node):
        node = self._scope(node, loop=True)
        outer = self.loops, self.within
        self.loops, self.within = [*self.loops, (node, _progress_names(node))], []
        try:
            node.body = self._mark_after(node.body)
        finally:
            self.loops, self.within = outer
        return node

    def _mark_after(self, body: list) -> list:
        """A marker before each statement of a loop's body that follows an inner loop or a call of
        more than the host's (``for batch in ...: step()`` then ``evaluate()``; ``train_one_epoch()``
        then ``validate()``): where the training steps ran inside that statement, what comes after
        it is the iteration's end (an epoch's evaluation), reached or not."""
        out = []
        for i, stmt in enumerate(body):
            prev = body[i - 1] if i else None
            if prev is not None and not _is_mark(stmt) and (
                    isinstance(prev, (ast.For, ast.AsyncFor, ast.While)) or
                    (isinstance(prev, (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.With)) and _calls([prev]))):
                rest = [n for n in body[i:] if not _is_mark(n)]
                ident = self.owner.add(_If(self.filename, stmt.lineno, f"after line {prev.lineno}",
                                           self._loop_lines(),
                                           True, _calls(rest), self.within[-1] if self.within else None, (),
                                           after=(prev.lineno, prev.end_lineno)))
                out.append(_mark(ident, stmt))
            out.append(stmt)
        return out

    visit_For = visit_AsyncFor = visit_While = _loop

    def visit_If(self, node):
        if not self.loops or not node.body:
            return self.generic_visit(node)
        reads = {d for n in ast.walk(node.test) if (d := _dotted(n))}
        progress = set().union(*(names for _, names in self.loops))
        calls = _calls(node.body)
        test = " ".join((ast.get_source_segment(self.source, node.test) or "").split())
        switches = ()
        if isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.And):
            switches = tuple(k for k, v in enumerate(node.test.values)
                             if not {d for n in ast.walk(v) if (d := _dotted(n))} & progress)
        ident = self.owner.add(_If(self.filename, node.lineno, test[:80] + ("..." if len(test) > 80 else ""),
                                   self._loop_lines(),
                                   bool(reads & progress), calls, self.within[-1] if self.within else None, switches))
        for k in switches:   # what each switch was when the test ran (Branches.operand)
            v = node.test.values[k]
            node.test.values[k] = ast.copy_location(
                ast.Call(ast.Name(OPERAND, ast.Load()), [ast.Constant(ident), ast.Constant(k), v], []), v)
        self.within.append(ident)   # an if in the body is entered only where this one is
        node.body = [self.visit(n) for n in node.body]
        self.within.pop()
        if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
            node.orelse = [self.visit(node.orelse[0])]   # an elif: entered where this one is not
        elif node.orelse:
            # an else arm: the ifs in it are entered only where it is (`if use_amp: ... else:
            # loss.backward(); if (it + 1) % k == 0: step()`, with AMP on, is not a missed period)
            arm = self.owner.add(_If(self.filename, node.orelse[0].lineno, f"else of line {node.lineno}",
                                     self._loop_lines(),
                                     False, (), self.within[-1] if self.within else None, (), arm=True))
            self.within.append(arm)
            node.orelse = [self.visit(n) for n in node.orelse]
            self.within.pop()
            node.orelse.insert(0, _mark(arm, node.orelse[0]))
        node.body.insert(0, _mark(ident, node.body[0]))
        return node


@functools.lru_cache(maxsize=1)
def _installed() -> tuple[str, ...]:
    """Where this Python's own library lives (a script in a home folder that holds a pyenv or
    a conda installation must not have the standard library compiled again)."""
    import sysconfig

    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, *sysconfig.get_paths().values()}
    return tuple(os.path.realpath(p) for p in paths if p and os.path.realpath(p) != os.sep)


_PACKAGED = (*frames.PACKAGE_DIRS, os.sep + "vest_slurm" + os.sep)


def _packaged(path: str) -> bool:
    """An installed package's file, or vest's own."""
    return any(p in path for p in _PACKAGED)


class Branches:
    """The ``if`` bodies in the loops of the user's code, and which of them the run entered."""

    def __init__(self, roots):
        self.roots = [os.path.realpath(r) for r in roots if r]
        self.ifs: list[_If] = []
        self.reached: set[int] = set()
        self.step_lines: set[tuple[str, int]] = set()   # (file, line) of the user frames at the training steps
        self.files: set[str] = set()
        self.defs: dict[str, tuple] = {}   # a function, method or class of the user's files -> what it calls
        self.switched: set[tuple[int, int]] = set()   # (if, operand): seen false when its test ran
        self.switched_on: set[tuple[int, int]] = set()   # seen true (or not a plain value)

    def add(self, branch: _If) -> int:
        self.ifs.append(branch)
        return len(self.ifs) - 1

    def owns(self, filename) -> bool:
        """The user's own code: under a root, not an installed package's or vest's."""
        try:
            name = os.fsdecode(filename)
        except (TypeError, ValueError):
            return False
        # The name alone first: most files imported are an installed package's, and resolving each
        # one's links (realpath, an lstat per path component) cost 0.5 s of lightning/imagenet's run.
        if not name.endswith(".py") or _packaged(name):
            return False
        path = os.path.realpath(name)
        if not path.endswith(".py") or _packaged(path):
            return False
        return any(path.startswith(r + os.sep) for r in self.roots) and \
            not any(path.startswith(r + os.sep) for r in _installed())

    def compile(self, source, filename: str):
        """The code of ``source`` with the markers, or None where it does not parse (the real
        compile then raises the script's own SyntaxError)."""
        text = source.decode("utf-8", "replace") if isinstance(source, bytes) else source
        try:
            tree = ast.parse(source, filename)
        except (SyntaxError, ValueError):
            return None
        for n in ast.walk(tree):   # the user's functions, methods and classes: what they call
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.defs[n.name] = self.defs.get(n.name, ()) + _calls(n.body)
            elif isinstance(n, ast.ClassDef):   # made through __init__ (a dataclass: its fields)
                inits = [m for m in n.body if isinstance(m, ast.FunctionDef) and m.name in ("__init__", "__post_init__")]
                self.defs[n.name] = self.defs.get(n.name, ()) + tuple(c for m in inits for c in _calls(m.body))
        tree = ast.fix_missing_locations(_Marker(self, filename, text).visit(tree))
        self.files.add(filename)
        return compile(tree, filename, "exec", dont_inherit=True)

    def reach(self, ident: int) -> None:
        self.reached.add(ident)

    def operand(self, ident: int, k: int, value):
        """A switch of an if's test, as evaluated: returned as it is; a plain value (bool, number,
        string, None) is recorded true or false, anything else (a tensor: no truth asked here)
        as not known to be off."""
        plain = value is None or type(value) in (bool, int, float, str)
        (self.switched_on if not plain or value else self.switched).add((ident, k))
        return value

    def at_step(self) -> None:
        """Where the training step under way came from, in the user's files."""
        f = sys._getframe(1)
        while f is not None:
            if f.f_code.co_filename in self.files:
                self.step_lines.add((f.f_code.co_filename, f.f_lineno))
            f = f.f_back

    def work(self, calls: tuple, seen: frozenset = frozenset()) -> tuple:
        """Which of ``calls`` may keep something on the GPU: a name of the user's files counts
        where what it calls does (nanoGPT's ``estimate_mfu``: arithmetic on the parameter count;
        a trainer's ``_save_snapshot``: a state dict saved), looked into 3 deep; any other, yes."""
        return tuple(c for c in calls if c not in self.defs or c in seen or len(seen) >= 3
                     or self.work(self.defs[c], seen | {c}))

    def unreached(self) -> list[_If]:
        """The branches to say: in a training loop, on its progress, with work beyond logging,
        never entered though the if around it (if any) was: an if inside one never entered (a
        switch of the job's configuration, off) is not its own question."""
        out = []
        for i, b in enumerate(self.ifs):
            if i in self.reached or not b.progress or not self.work(b.calls) or (b.within is not None and b.within not in self.reached):
                continue
            if any((i, k) in self.switched and (i, k) not in self.switched_on for k in b.switches):
                continue   # a switch of the job's configuration that was off each time: not a matter of steps
            # an iteration's end: said where the training steps ran inside the statement before it
            around = [b.after] if b.after else b.loops
            if any(file == b.file and any(a <= line <= z for a, z in around) for file, line in self.step_lines):
                out.append(b)
        return sorted(out, key=lambda b: (b.file, b.line))

    def note(self, steps: int) -> str | None:
        found = self.unreached()
        ifs, ends = [b for b in found if not b.after], [b for b in found if b.after]
        said = []
        if ifs:
            where = "; ".join(f"{os.path.basename(b.file)}:{b.line} (`if {b.test}:`, which calls "
                              f"{', '.join(self.work(b.calls)[:3])})" for b in ifs[:SAID])
            more = f" and {len(ifs) - SAID} more" if len(ifs) > SAID else ""
            said.append(f"the training loop's branch{'es' if len(ifs) > 1 else ''} at {where}{more} "
                        f"{'were' if len(ifs) > 1 else 'was'} not reached in the {steps} step(s) traced (nor at an epoch's "
                        f"end): what {'they do' if len(ifs) > 1 else 'it does'} on the GPU (an evaluation, sampling, a "
                        "checkpoint) is not in the estimate; to trace it, run the command with the period shortened so "
                        "that the first steps reach it")
        if ends:
            where = "; ".join(f"{os.path.basename(b.file)}:{b.line} (after the steps' loop or call at line {b.after[0]}; "
                              f"it calls {', '.join(self.work(b.calls)[:3])})" for b in ends[:SAID])
            said.append(f"the end of the training loop's iteration at {where} was not reached in the {steps} step(s) "
                        "traced: its batches do not come from a DataLoader whose epoch vest can end early, so what the "
                        "script does there on the GPU (an evaluation, sampling) is not in the estimate; to trace it, run "
                        "the command on a data set of a few batches")
        return "; and ".join(said) or None


def noops() -> None:
    """The markers as no-ops, for a process the script starts (a spawned worker: spawned.py) that
    may run code compiled here, sent by value (cloudpickle sends __main__'s functions so)."""
    setattr(builtins, MARK, lambda ident: None)
    setattr(builtins, OPERAND, lambda ident, k, value: value)


class installed:
    """Context: the user's files compiled with markers (the script through runpy, the modules it
    imports from its folder through the source loader), ``MARK`` a builtin."""

    def __init__(self, branches: Branches):
        self.branches = branches

    def __enter__(self):
        import runpy
        from importlib.machinery import SourceFileLoader

        b = self.branches
        setattr(builtins, MARK, b.reach)
        setattr(builtins, OPERAND, b.operand)
        self.undo = []
        real_get_code = SourceFileLoader.get_code

        def get_code(loader, fullname):
            path = loader.get_filename(fullname)
            if b.owns(path):
                code = b.compile(loader.get_data(path), path)
                if code is not None:
                    return code
            return real_get_code(loader, fullname)

        SourceFileLoader.get_code = get_code
        self.undo.append(lambda: setattr(SourceFileLoader, "get_code", real_get_code))
        real_from_file = getattr(runpy, "_get_code_from_file", None)
        if real_from_file is not None:   # run_path's reader of a script file (its signature varies by version)
            def from_file(*args):
                out = real_from_file(*args)
                code = out[0] if isinstance(out, tuple) else out
                path = code.co_filename
                if b.owns(path):
                    with open(path, "rb") as f:
                        marked = b.compile(f.read(), path)
                    if marked is not None:
                        return (marked, *out[1:]) if isinstance(out, tuple) else marked
                return out

            runpy._get_code_from_file = from_file
            self.undo.append(lambda: setattr(runpy, "_get_code_from_file", real_from_file))
        return b

    def __exit__(self, *exc):
        for undo in reversed(self.undo):
            undo()
        return False
