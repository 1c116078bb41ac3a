"""``python -m vest_slurm.bridge ...``: the ``vest bridge`` commands (what the systemd unit and the
test cluster run)."""

import sys

from ..cli import main

main(["bridge", *sys.argv[1:]])
