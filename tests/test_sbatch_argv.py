import pytest

from vest_slurm.errors import SlurmError, VestError
from vest_slurm.slurm.jobscript import parse_job_script, parse_sbatch_argv
from vest_slurm.slurm.sbatch import REMOVE, build_sbatch_argv, format_command, parse_sbatch_output, parse_test_only

# Hostile paths and values, as submitit's tests use: each must arrive as exactly one argv element.
HOSTILE = ["with space", "it's", 'say "hi"', "$(rm -rf ~)", "`id`", "a\nb", "ünïcødé ✓", "semi;colon && x",
           "*glob?", "back\\slash", "tab\there", "-leading-dash", "a=b=c", "--partition=evil", ""]


@pytest.fixture(params=HOSTILE, ids=range(len(HOSTILE)))
def hostile(request):
    return request.param


def test_options_pass_through_in_order_with_overrides_in_place():
    opts = [("time", "1:00"), ("partition", "v100"), ("output", "o %j.txt"), ("array", "0-3"),
            ("export", "ALL,A=1"), ("dependency", "afterok:7"), ("partition", "x"), ("hold", None)]
    argv = build_sbatch_argv(opts, "job.sh", ["a", "b"], {"partition": "a100", "gres": "gpu:a100:1"})
    assert argv == ["sbatch", "--time=1:00", "--partition=a100", "--output=o %j.txt", "--array=0-3",
                    "--export=ALL,A=1", "--dependency=afterok:7", "--hold", "--gres=gpu:a100:1", "job.sh", "a", "b"]


def test_remove_and_sequence_overrides():
    argv = build_sbatch_argv([("gpus", "2"), ("time", "5")], "j.sh", (), [("gpus", REMOVE), ("gres", "gpu:h100:2")])
    assert argv == ["sbatch", "--time=5", "--gres=gpu:h100:2", "j.sh"]


def test_hostile_values_stay_one_element(hostile):
    argv = build_sbatch_argv([("job-name", hostile), ("comment", hostile)], "/tmp/" + hostile + "/job.sh", [hostile])
    assert argv[1] == "--job-name=" + hostile and argv[2] == "--comment=" + hostile
    assert argv[3] == "/tmp/" + hostile + "/job.sh" and argv[4] == hostile and len(argv) == 5


def test_hostile_values_round_trip_through_our_own_parser(hostile):
    argv = build_sbatch_argv([("job-name", hostile), ("partition", "a100")], "job.sh", [hostile])
    back = parse_sbatch_argv(argv[1:])
    assert back.options == (("job-name", hostile), ("partition", "a100"))
    assert back.script == "job.sh" and back.script_args == (hostile,)


def test_script_path_starting_with_dash():
    assert build_sbatch_argv([], "-x.sh")[-1] == "./-x.sh"
    assert build_sbatch_argv([("wrap", "echo hi")], None) == ["sbatch", "--wrap=echo hi"]


@pytest.mark.parametrize("opts,overrides", [
    ([("bogus", "1")], {}), ([], {"partitoin": "a"}), ([("job-name", "a\0b")], {}), ([("time", 5)], {}),
])
def test_rejected_inputs(opts, overrides):
    with pytest.raises(VestError):
        build_sbatch_argv(opts, "job.sh", (), overrides)


def test_script_options_and_cli_compose():
    js = parse_job_script("#!/bin/bash\n#SBATCH -p v100 --gres=gpu:v100:1\nsrun x\n")
    cli = parse_sbatch_argv(["-t", "10", "--dry-run", "job.sh"])
    argv = build_sbatch_argv(cli.options, cli.script, cli.script_args, js.gpu_request.overrides_for("a100"))
    assert argv == ["sbatch", "--time=10", "--gres=gpu:a100:1", "job.sh"]


def test_format_command_quotes_for_display():
    shown = format_command(["sbatch", "--job-name=$(id)", "a b.sh"])
    assert shown == "sbatch '--job-name=$(id)' 'a b.sh'"


@pytest.mark.parametrize("out,job,cluster", [
    ("Submitted batch job 123\n", 123, None),
    ("sbatch: info line\nSubmitted batch job 45 on cluster alpha\n", 45, "alpha"),
    ("678\n", 678, None),
    ("91;beta\n", 91, "beta"),
])
def test_parse_sbatch_output(out, job, cluster):
    r = parse_sbatch_output(out)
    assert (r.job_id, r.cluster) == (job, cluster)


@pytest.mark.parametrize("out", ["", "sbatch: error: Batch job submission failed\n", "Submitted batch job x\n"])
def test_parse_sbatch_output_errors(out):
    with pytest.raises(SlurmError):
        parse_sbatch_output(out)


def test_parse_test_only():
    r = parse_test_only("sbatch: Job 12 to start at 2025-01-31T12:00:00 using 1 processors on nodes gpu-a100 in partition a100\n")
    assert (r.job_id, r.processors, r.nodes, r.partition) == (12, 1, "gpu-a100", "a100")
    with pytest.raises(SlurmError):
        parse_test_only("sbatch: error: Requested node configuration is not available\n")
