#!/usr/bin/env bash
# Set up (once) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
exec "$PY" -m pytest -q "$@"
