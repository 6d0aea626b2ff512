#!/usr/bin/env bash
# Installs Debian's Slurm (slurmctld, slurmd, client tools) and munge for tests/test_slurm*.py.
# Idempotent: does nothing when the binaries are already there. The tests start and stop their own
# four-node cluster on this machine (tests/helpers/slurm_cluster.py: one slurmd per fake node, each in a
# mount namespace of its own made with util-linux's unshare); nothing is started here.
set -euo pipefail
start=$SECONDS
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
   && command -v munged >/dev/null; then
  echo "slurm: already installed ($(dpkg-query -W -f='${Version}' slurmctld))"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
echo "slurm: installed $(dpkg-query -W -f='${Version}' slurmctld) in $((SECONDS - start)) s"
