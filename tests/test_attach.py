import base64
import json
from datetime import datetime, timezone

import pytest

from vest_slurm.slurm.attach import (MAX_LINE_CHARS, PREFIX, AttachError, attach, decode, detach, encode,
                               make_payload, script_sha256)
from vest_slurm.estimate.record import MemoryEstimate
from vest_slurm.slurm.jobscript import parse_job_script

GiB = 1 << 30
SCRIPT = "#!/bin/bash\n#SBATCH -p a100 --comment='mine'\n#VEST --model torchvision:resnet50 --batch-size 8\npython t.py\n"


def payload():
    return make_payload({"a100": MemoryEstimate("a100-40gb", 40 * GiB, 20 * GiB, 22 * GiB),
                         "v100": MemoryEstimate("v100-16gb", 16 * GiB, 21 * GiB, 21 * GiB)},
                        num_gpus=2, batch_size=8, now=datetime(2025, 1, 31, 12, tzinfo=timezone.utc))


def b64(obj):
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")


def test_round_trip_is_exact_and_after_shebang():
    text = attach(SCRIPT, payload())
    lines = text.split("\n")
    assert lines[0] == "#!/bin/bash" and lines[1].startswith(PREFIX + " v1 ")
    original, p = detach(text)
    assert original == SCRIPT
    assert p.script_sha256 == script_sha256(SCRIPT)
    assert (p.num_gpus, p.batch_size, p.created) == (2, 8, "2025-01-31T12:00:00Z")
    assert p.gpu("a100").required_bytes == 20 * GiB and p.gpu("a100").profile == "a100-40gb"
    assert p.gpu("v100").peak_bytes == 21 * GiB


def test_attached_script_parses_the_same():
    a, b = parse_job_script(SCRIPT), parse_job_script(attach(SCRIPT, payload()))
    assert (a.options, a.vest_argv) == (b.options, b.vest_argv)
    assert ("comment", "mine") in b.options


def test_attach_replaces_an_existing_line_and_handles_no_newline():
    once = attach(SCRIPT, payload())
    twice = attach(once, payload())
    assert twice == once
    assert detach(attach("#!/bin/sh", payload()))[0] == "#!/bin/sh"
    with pytest.raises(AttachError):
        attach("echo no shebang\n", payload())


def test_no_line():
    assert detach(SCRIPT) == (SCRIPT, None)
    later = SCRIPT + PREFIX + " v1 garbage\n"  # only the line after the shebang counts
    assert detach(later) == (later, None)


def test_hash_mismatch_when_script_changed():
    text = attach(SCRIPT, payload()).replace("python t.py", "python other.py")
    with pytest.raises(AttachError) as e:
        detach(text)
    assert e.value.reason == "hash-mismatch"


def good_obj():
    line = attach(SCRIPT, payload()).split("\n")[1]
    return json.loads(base64.urlsafe_b64decode(line.split()[2] + "=="))


@pytest.mark.parametrize("mutate,reason", [
    (lambda o: o.update(version=2), "version"),
    (lambda o: o.update(version=True), "version"),
    (lambda o: o.update(extra=1), "malformed"),
    (lambda o: o.pop("created"), "malformed"),
    (lambda o: o.update(num_gpus=0), "malformed"),
    (lambda o: o.update(num_gpus="2"), "malformed"),
    (lambda o: o.update(batch_size=True), "malformed"),
    (lambda o: o.update(script_sha256="$(id)"), "malformed"),
    (lambda o: o.update(gpus={}), "malformed"),
    (lambda o: o["gpus"]["a100"].update(required_bytes=-1), "malformed"),
    (lambda o: o["gpus"]["a100"].update(required_bytes=1e9), "malformed"),
    (lambda o: o["gpus"]["a100"].update(required_bytes=1 << 60), "malformed"),
    (lambda o: o["gpus"].update({"a b": o["gpus"]["a100"]}), "malformed"),
    (lambda o: o.update(tool_version="x" * 1000), "malformed"),
])
def test_forged_or_malformed_payloads(mutate, reason):
    obj = good_obj()
    mutate(obj)
    with pytest.raises(AttachError) as e:
        decode(f"{PREFIX} v1 {b64(obj)}")
    assert e.value.reason == reason


@pytest.mark.parametrize("line,reason", [
    (f"{PREFIX} v2 abc", "version"),
    (f"{PREFIX}  v1 abc", "malformed"),
    (f"{PREFIX} v1 not+base64/", "malformed"),
    (f"{PREFIX} v1 " + base64.urlsafe_b64encode(b"\xff\xfe").decode().rstrip("="), "malformed"),
    (f"{PREFIX} v1 " + base64.urlsafe_b64encode(b"[1,2]").decode().rstrip("="), "malformed"),
    (f"{PREFIX} v1 " + "A" * MAX_LINE_CHARS, "too-long"),
    (f"{PREFIX} v1 {'A' * 5}", "malformed"),
])
def test_malformed_lines(line, reason):
    with pytest.raises(AttachError) as e:
        decode(line)
    assert e.value.reason == reason
    assert "vsbatch" in str(e.value)


def test_multi_megabyte_script_with_binary_bytes():
    body = "#!/bin/bash\n" + ("x" * 1000 + "\udcff\n") * 5000  # ~5 MB, undecodable byte kept
    text = attach(body, payload())
    original, p = detach(text)
    assert original == body and p is not None
    huge = "#!/bin/bash\n" + PREFIX + " v1 " + "A" * (4 << 20) + "\n"
    with pytest.raises(AttachError) as e:
        detach(huge)
    assert e.value.reason == "too-long"


def test_encode_is_compact_and_ascii():
    line = encode(payload())
    assert line.isascii() and len(line) < 1024 and "\n" not in line
