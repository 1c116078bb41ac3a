import pytest

from vest_slurm.errors import JobScriptError
from vest_slurm.slurm.jobscript import (effective_options, gpu_request, options_from_env, parse_gres,
                                  parse_job_script, parse_sbatch_argv, read_job_script)

HOSTILE = ["with space", "it's", 'say "hi"', "$(rm -rf ~)", "`id`", "ünïcødé ✓", "semi;colon && x",
           "*glob?", "back\\slash", "-leading-dash", "a=b=c"]


def script(*lines):
    return "\n".join(("#!/bin/bash",) + lines) + "\n"


@pytest.mark.parametrize("line,expected", [
    ("#SBATCH --partition=a100", [("partition", "a100")]),
    ("#SBATCH --partition a100", [("partition", "a100")]),
    ("#SBATCH -p a100", [("partition", "a100")]),
    ("#SBATCH -pa100", [("partition", "a100")]),
    ("#SBATCH -N2", [("nodes", "2")]),
    ("#SBATCH -J name", [("job-name", "name")]),
    ("#SBATCH --part=x", [("partition", "x")]),
    ("#SBATCH --cluster=c", [("clusters", "c")]),
    ("#SBATCH -HQ", [("hold", None), ("quiet", None)]),
    ("#SBATCH -koff --exclusive --exclusive=user", [("no-kill", "off"), ("exclusive", None), ("exclusive", "user")]),
    ("#SBATCH -N 2 -n 8 --gres=gpu:a100:2  # two nodes", [("nodes", "2"), ("ntasks", "8"), ("gres", "gpu:a100:2")]),
    ("#SBATCH --time=1:00 --array=0-9%2 --dependency=afterok:1", [("time", "1:00"), ("array", "0-9%2"), ("dependency", "afterok:1")]),
    ("#SBATCH -J -dashy", [("job-name", "-dashy")]),
    ("#SBATCH --comment='a # b'", [("comment", "a # b")]),
    ("#SBATCH --comment=a\\ b", [("comment", "a b")]),
    ("#SBATCH--time=5", [("time", "5")]),
    ("#SBATCH --comment=a#b -p x", [("comment", "a")]),  # _get_argument: an unquoted # ends the line
])
def test_option_forms(line, expected):
    assert list(parse_job_script(script(line)).options) == expected


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_round_trip_through_quotes(value):
    # sbatch's splitter: quotes group, a backslash escapes the next character (inside quotes too).
    quoted = "".join("\\" + c for c in value) if ("'" in value or "\\" in value) else "'" + value + "'"
    js = parse_job_script(script(f"#SBATCH --job-name={quoted}"))
    assert js.options == (("job-name", value),)


def test_header_stops_at_first_command_and_keeps_commands():
    js = parse_job_script(script("#SBATCH -p v100", "", "# comment", "  ", "module load x",
                                 "#SBATCH -p h100", "srun python train.py \\", "  --lr 1"))
    assert js.partitions == ("v100",)
    assert js.first_command_line == 6
    assert js.ignored_sbatch_lines == (7,)
    assert [(c.lineno, c.text) for c in js.commands] == [(6, "module load x"), (8, "srun python train.py   --lr 1")]


def test_indented_sbatch_is_a_comment():
    assert parse_job_script(script("  #SBATCH -p v100", "# SBATCH -p a100")).options == ()


def test_vest_directives_concatenated_with_comments():
    js = parse_job_script(script("#VEST --model torchvision:resnet50  # the model", "#SBATCH -p a100",
                                 "#VEST --batch-size 128 --model-args '{\"k\": \"a b#c\"}'",
                                 "#VEST-ESTIMATE v1 abc", "echo hi"))
    assert js.vest_argv == ("--model", "torchvision:resnet50", "--batch-size", "128", "--model-args", '{"k": "a b#c"}')
    assert [d.lineno for d in js.vest_directives] == [2, 4]


def test_vest_after_command_is_an_error_naming_lines():
    with pytest.raises(JobScriptError) as e:
        parse_job_script(script("#SBATCH -p a100", "python x.py", "#VEST --batch-size 2"))
    assert "line 4" in str(e.value) and "move it above line 3" in str(e.value)


@pytest.mark.parametrize("lines,needle", [
    (("#SBATCH --bogus=1",), "line 2: unknown sbatch option --bogus"),
    (("#SBATCH -Z",), "unknown sbatch option -Z"),
    (("#SBATCH --par=x",), "ambiguous"),
    (("#SBATCH partition=a100",), "invalid #SBATCH directive"),
    (("#SBATCH --comment='open",), "line 2: unmatched '"),
    (("", "#SBATCH --time",), "line 3: option --time needs a value"),
    (("#SBATCH --hold=yes",), "takes no value"),
    (("#SBATCH hetjob",), "heterogeneous"),
    (("#VESTfoo",), "put a space after #VEST"),
    (("#VEST --model 'x",), "line 2"),
])
def test_malformed_lines(lines, needle):
    with pytest.raises(JobScriptError) as e:
        parse_job_script(script(*lines), "job.sh")
    assert needle in str(e.value)
    assert e.value.fix


@pytest.mark.parametrize("text,needle", [
    ("", "empty"), ("echo hi\n", "#!"), ("#!/bin/bash\r\necho\r\n", "DOS"), ("#!/bin/bash\n\0", "NUL"),
])
def test_scripts_sbatch_refuses(text, needle):
    with pytest.raises(JobScriptError, match=needle):
        parse_job_script(text)


def test_read_job_script_errors(tmp_path):
    with pytest.raises(JobScriptError, match="not found"):
        read_job_script(tmp_path / "nope.sh")
    with pytest.raises(JobScriptError, match="directory"):
        read_job_script(tmp_path)
    p = tmp_path / "job with space $(x).sh"
    p.write_bytes(b"#!/bin/bash\n#SBATCH -J \xff\xfe\necho\n")
    js = read_job_script(p)
    assert js.text.encode("utf-8", "surrogateescape") == p.read_bytes()


@pytest.mark.parametrize("opts,expected", [
    ([("gres", "gpu:a100:2")], ("gres", "a100", 2, 2)),
    ([("gres", "gpu:2"), ("nodes", "3")], ("gres", None, 2, 6)),
    ([("gres", "gpu:a100")], ("gres", "a100", 1, 1)),
    ([("gres", "shard:1,gpu:h100:4,mps:100")], ("gres", "h100", 4, 4)),
    ([("gpus", "a100:4"), ("nodes", "2")], ("gpus", "a100", 2, 4)),
    ([("gpus", "3")], ("gpus", None, 3, 3)),
    ([("gpus-per-node", "v100:2"), ("nodes", "2-4")], ("gpus-per-node", "v100", 2, 4)),
    ([("gpus-per-task", "1"), ("ntasks-per-node", "4"), ("nodes", "2")], ("gpus-per-task", None, 4, 8)),
    ([("gpus-per-task", "2"), ("ntasks", "3")], ("gpus-per-task", None, 6, 6)),
    ([("gres", "none")], (None, None, 0, 0)),
    ([], (None, None, 0, 0)),
])
def test_gpu_request(opts, expected):
    r = gpu_request(opts)
    assert (r.source, r.gpu_type, r.gpus_per_node, r.total_gpus) == expected


def test_gpu_request_keeps_other_gres_in_overrides():
    r = gpu_request([("gres", "shard:1,gpu:2")])
    assert r.overrides_for("a100") == (("gres", "gpu:a100:2,shard:1"),)
    assert gpu_request([("gpus", "4")]).overrides_for("h100") == (("gpus", "h100:4"),)


@pytest.mark.parametrize("opts", [
    [("gres", "gpu:a100:1,gpu:v100:1")], [("gpus", "a100:1,v100:1")], [("gres", "gpu:a100:1"), ("gpus", "v100:1")],
    [("gres", "gpu:x:y:z")], [("gpus", "lots")], [("nodes", "zero")],
])
def test_gpu_request_errors(opts):
    with pytest.raises(JobScriptError):
        gpu_request(opts)


def test_parse_gres_bridge_forms():
    assert [(e.name, e.type, e.count) for e in parse_gres("gres:gpu:v100:1")] == [("gpu", "v100", 1)]
    assert [(e.name, e.type, e.count) for e in parse_gres("gres/gpu:2")] == [("gpu", None, 2)]


def test_sbatch_argv_options_after_script_belong_to_script():
    a = parse_sbatch_argv(["-p", "a100", "--dry-run", "--site-config=/x y", "-N2", "job.sh", "-p", "v100", "--json"])
    assert a.options == (("partition", "a100"), ("nodes", "2"))
    assert a.own == (("dry-run", None), ("site-config", "/x y"))
    assert a.script == "job.sh" and a.script_args == ("-p", "v100", "--json")


def test_sbatch_argv_double_dash_and_wrap():
    a = parse_sbatch_argv(["--", "-weird.sh", "x"])
    assert a.script == "-weird.sh" and a.script_args == ("x",)
    assert parse_sbatch_argv(["--wrap", "echo hi"]).script is None
    with pytest.raises(JobScriptError, match="--wrap"):
        parse_sbatch_argv(["--wrap=echo", "job.sh"])
    with pytest.raises(JobScriptError, match="needs a value"):
        parse_sbatch_argv(["-p"])


def test_precedence_script_env_cli():
    js = parse_job_script(script("#SBATCH -p v100 --time=5 --gres=gpu:v100:1"))
    env = options_from_env({"SBATCH_PARTITION": "a100", "HOME": "/x"})
    cli = parse_sbatch_argv(["--partition=h100", "job.sh"]).options
    eff = effective_options(js.options, env, cli)
    assert dict(eff) == {"partition": "h100", "time": "5", "gres": "gpu:v100:1"}
    assert dict(effective_options(js.options, env))["partition"] == "a100"
