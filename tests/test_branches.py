"""The markers the dynamic analysis compiles into the user's loops (vest_slurm/dynamic/branches.py):
the program is the same program (line numbers, annotations, __future__ imports), and which if
bodies of a training loop were entered, and why not, is known."""

from __future__ import annotations

import builtins
import sys
import traceback

from vest_slurm.dynamic.branches import MARK, OPERAND, Branches

SOURCE = '''from __future__ import division
import math, time
def train(n, every, resume):
    step = 0
    for _ in range(n):
        step += 1
        on_step()
        if step % every == 0:
            evaluate()
        if step % 7 == 0:
            print(step)
        if resume and step > 10:
            evaluate()
        if step % 5 == 0:
            log_progress()
        if step == 2:
            raise ValueError("at step 2")

def log_progress():
    print(math.exp(1.0), time.ctime())

def annotated(x: int) -> int:
    return x
'''


def _run(tmp_path, n, every, resume=False):
    path = tmp_path / "train.py"
    path.write_text(SOURCE)
    b = Branches([str(tmp_path)])
    code = b.compile(path.read_bytes(), str(path))
    calls = []
    ns = {"evaluate": lambda: calls.append("eval"), "on_step": b.at_step}
    setattr(builtins, MARK, b.reach)
    setattr(builtins, OPERAND, b.operand)
    try:
        exec(code, ns)
        try:
            ns["train"](n, every, resume)
        except ValueError as e:
            frame = traceback.extract_tb(e.__traceback__)[-1]
            assert (frame.lineno, frame.line) == (17, 'raise ValueError("at step 2")')   # the file's own lines
    finally:
        delattr(builtins, MARK)
        delattr(builtins, OPERAND)
    assert ns["annotated"].__annotations__["x"] is int   # not this test module's `annotations` future
    return b, calls


def test_a_period_the_steps_do_not_reach_is_said_logging_and_switches_off_are_not(tmp_path):
    b, calls = _run(tmp_path, 2, 1000)
    # not said: the print-only branch (line 10), the one whose function of the same file only
    # logs (line 14), the one behind a switch of the configuration that was off (line 12)
    assert not calls and [x.line for x in b.unreached()] == [8]
    note = b.note(2)
    assert "train.py:8 (`if step % every == 0:`, which calls evaluate)" in note and "2 step(s)" in note
    b, calls = _run(tmp_path, 2, 2)
    assert calls == ["eval"] and b.unreached() == []
    b, calls = _run(tmp_path, 2, 2, resume=True)   # the switch on: its step (> 10) is past the run
    assert [x.line for x in b.unreached()] == [12]


def test_only_the_users_files_are_marked(tmp_path):
    b = Branches([str(tmp_path)])
    assert b.owns(str(tmp_path / "train.py")) and not b.owns(str(tmp_path / "lib" / "site-packages" / "x.py"))
    assert not b.owns(sys.executable) and not b.owns(str(tmp_path / "data.txt"))
    assert b.compile(b"def broken(:\n", str(tmp_path / "bad.py")) is None   # the real compile raises it


NESTED = '''def train(data):
    for epoch in range(2):
        for x in data:
            on_step()
        if epoch % 2 == 0:
            evaluate()
'''


class _Stop(Exception):
    pass


def test_the_note_names_the_scripts_calls_not_the_markers(tmp_path):
    """The end of a loop's iteration after its inner loop of steps, not reached: what it calls was
    read with the markers already put into it (an if's operand, its body's marker), and the note
    told the user of `__vest_reached__` and `__vest_operand__`."""
    path = tmp_path / "nested.py"
    path.write_text(NESTED)
    b = Branches([str(tmp_path)])
    code = b.compile(path.read_bytes(), str(path))

    def on_step():
        b.at_step()
        if len(b.step_lines) >= 1 and on_step.n >= 2:
            raise _Stop
        on_step.n += 1
    on_step.n = 0
    ns = {"evaluate": lambda: None, "on_step": on_step}
    setattr(builtins, MARK, b.reach)
    setattr(builtins, OPERAND, b.operand)
    try:
        exec(code, ns)
        try:
            ns["train"](range(10))
        except _Stop:
            pass
    finally:
        delattr(builtins, MARK)
        delattr(builtins, OPERAND)
    note = b.note(2)
    assert note and "nested.py:5" in note and "__vest" not in note, note


STDLIB = '''import copy, gc, hashlib, shutil
def train(n, model, test, ema):
    step = 0
    for _ in range(n):
        step += 1
        on_step()
        if step % 5000 == 0:
            gc.collect()
        if step % 1000 == 0:
            shutil.copy("a", "b"); hashlib.sha256(b"x").hexdigest()
        if step % 2000 == 0:
            ema = copy.deepcopy(model)
        if step % 3000 == 0:
            test(model)
        if step % 4000 == 0:
            tqdm(range(3))
'''


def test_calls_of_the_standard_library_are_host_work_but_copies_and_the_scripts_own_names(tmp_path):
    """nanochat's `if step % 5000 == 0: gc.collect()` was said as GPU work the trace missed: a
    function of Python's standard library keeps nothing on the GPU. Not the modules that copy or
    run the script's objects (copy.deepcopy of the model is a second model on the GPU), nor a
    function of the script that has a module's name (`test(model)`)."""
    path = tmp_path / "train.py"
    path.write_text(STDLIB)
    b = Branches([str(tmp_path)])
    code = b.compile(path.read_bytes(), str(path))
    ns = {"on_step": b.at_step, "tqdm": lambda x: x}
    setattr(builtins, MARK, b.reach)
    setattr(builtins, OPERAND, b.operand)
    try:
        exec(code, ns)
        ns["train"](3, None, lambda m: None, None)
    finally:
        delattr(builtins, MARK)
        delattr(builtins, OPERAND)
    assert [x.line for x in b.unreached()] == [11, 13]
    note = b.note(3)
    assert "calls deepcopy" in note and "calls test" in note and "collect" not in note, note
