#!/usr/bin/env bash
# Set up .venv if needed, then run the tests: scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_setup.sh

# gcsfs reads this at import; without it every emulator bucket costs a 60 s gRPC retry loop.
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
exec python -m pytest -q "$@"
