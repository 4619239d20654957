#!/usr/bin/env bash
# Set up .venv if needed, then run the tests: scripts/test.sh [pytest args...]
#   scripts/test.sh tests/test_pack.py         one file (tests/test_pack.py::test_x: one test)
#   scripts/test.sh -n0                         serially, in this process (pdb, print debugging)
# By default the tests run in SHARDKIT_TEST_WORKERS (4) pytest-xdist processes: most of the
# suite waits on servers, subprocesses and timeouts, so more processes than cores pay.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_setup.sh

# gcsfs reads this at import; without it every emulator bucket costs a 60 s gRPC retry loop.
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
parallel=(-n "${SHARDKIT_TEST_WORKERS:-4}" --dist loadgroup)
python -c 'import xdist' 2>/dev/null || parallel=()  # an environment of your own without it: serially
for arg in "$@"; do
    case $arg in -n* | --numprocesses* | --dist* | -pno:xdist | no:xdist) parallel=() ;; esac
done
exec python -m pytest -q "${parallel[@]}" "$@"
