# Sourced by test.sh and demo.sh: make .venv and install shardkit into it, once.
# torch==2.13.0 goes first: pip takes the CPU wheel this kind of machine keeps on disk,
# where an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false  # gcsfs reads it at import (see REMOTE-TESTING.md)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

VENV=.venv
STAMP="$VENV/.shardkit-installed"
if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    python3 -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ "${BASH_SOURCE[0]}" -nt "$STAMP" ]; then
    echo "setup: installing torch==2.13.0 and shardkit[test] (first run takes a minute)" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q torch==2.13.0
    # moto and s3fs in one command so one resolve picks compatible botocore pins
    "$VENV/bin/python" -m pip install -q -e '.[test,s3,gcs,bench]' 'moto[server]' s3fs gcp-storage-emulator
    "$VENV/bin/python" -m pip check >&2 || echo "setup: warning: pip check reports a conflict (above)" >&2
    touch "$STAMP"
fi
PY="$PWD/$VENV/bin/python"
export PATH="$PWD/$VENV/bin:$PATH"
