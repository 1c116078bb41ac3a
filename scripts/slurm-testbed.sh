#!/usr/bin/env bash
# A real Slurm (Debian's 22.05 packages) on loopback: munged, slurmctld and one slurmd per fake GPU
# node (v100, a100, h100 in partitions of those names), all state in DIR.
#
#   scripts/slurm-testbed.sh start DIR [--bridge] [--accounting]   # prints the `export SLURM_CONF=...` line
#                                   (--accounting: slurmdbd + MariaDB on loopback, so sacct answers)
#   scripts/slurm-testbed.sh status DIR
#   scripts/slurm-testbed.sh stop DIR
#
# The same Python code (vest_slurm/slurm/testbed.py, vest_slurm/testbed.py) backs the test fixture; `start` leaves a detached
# supervisor process (pid in DIR/testbed.pid) that owns the daemons; `stop` ends it and them.
# Needs root and: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client
#   slurm-wlm-basic-plugins munge lua-cjson lua-socket slurmdbd mariadb-server
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${PYTHON:-python3}" -m vest_slurm.testbed "$@"
