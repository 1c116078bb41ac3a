#!/usr/bin/env bash
# Install vest-slurm and what it needs on a fresh Debian 12 machine (run as root, or with sudo).
#   - bubblewrap (the dynamic analysis runs the training script under it: vest_slurm/dynamic/bwrap.py);
#   - Debian's Slurm 22.05 (controller, node daemon, client, Lua job_submit plugin), munge, and the
#     Lua libraries the bridge uses, slurmdbd and MariaDB (the accounting testbed: sacct, vest audit);
#     the daemons are not started (the test fixture starts its own).
#   - torch 2.14.1 + torchvision 0.29.1 with pip (pip finds them on this machine's disk), then
#     vest-slurm itself, editable, with its test extras.
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

APT_PACKAGES=(slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge lua-cjson lua-socket slurmdbd mariadb-server bubblewrap)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "install.sh: installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # Debian's packages enable their systemd units; nothing starts them here, and the tests
  # run their own daemons on loopback.
fi

PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch, torchvision' 2>/dev/null; then
  echo "install.sh: installing torch 2.14.1 and torchvision 0.29.1 (about a minute)"
  "$PY" -m pip install -q torch==2.14.1 torchvision==0.29.1
fi
echo "install.sh: installing vest-slurm (editable) with its test extras"
"$PY" -m pip install -q -e '.[test]'
echo "install.sh: done: $(command -v vest) $("$PY" -c 'import vest_slurm; print(vest_slurm.__version__)')"
