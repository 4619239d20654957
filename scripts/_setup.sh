# Sourced by test.sh and demo.sh (cwd = repo root): the one place that creates and fills .venv.
# Safe on a fresh machine with no stdin; a rerun skips pip while the stamp is newer than
# pyproject.toml and this file. SHARDKIT_VENV=DIR uses an environment of your own instead, as
# it is (the tests run the demo in theirs).

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

if [[ -n ${SHARDKIT_VENV:-} ]]; then
    venv=$SHARDKIT_VENV
    [[ -x $venv/bin/python ]] || { echo "setup: SHARDKIT_VENV=$venv has no bin/python" >&2; exit 1; }
else
    venv=.venv
    stamp=$venv/.shardkit-installed
    if [[ ! -x $venv/bin/python ]]; then
        echo "setup: creating $venv" >&2
        "${PYTHON:-python3}" -m venv "$venv"
    fi
    if [[ ! ($stamp -nt pyproject.toml && $stamp -nt scripts/_setup.sh) ]]; then
        echo "setup: installing into $venv (minutes on a fresh machine)" >&2
        pip=("$venv/bin/python" -m pip install -q)
        "${pip[@]}" --upgrade pip
        # Pinned and first, so the extras' torch>=2.1 is already met and pip never pulls a CUDA build.
        "${pip[@]}" torch==2.13.0
        # One resolve: naming s3fs beside moto keeps botocore within aiobotocore's pin.
        "${pip[@]}" -e '.[test,s3,gcs,azure,docs,obstore]' 'moto[server]' s3fs gcp-storage-emulator
        "$venv/bin/python" -m pip check || echo "setup: warning: pip check found conflicts" >&2
        touch "$stamp"
    fi
    # Azurite, Azure Storage's emulator (an npm package, 20-40 s), for the Azure tests: into .azurite/
    # (gitignored). Without npm the Azure tests are skipped, saying so; nothing else needs it.
    if [[ ! -x .azurite/node_modules/.bin/azurite-blob ]]; then
        if command -v npm >/dev/null; then
            echo "setup: installing Azurite into .azurite (npm)" >&2
            npm install --prefix .azurite --no-audit --no-fund --loglevel=error azurite@3.37.0 >&2 ||
                echo "setup: warning: npm could not install Azurite: the Azure tests will be skipped" >&2
        else
            echo "setup: npm not found: Azurite is not installed, so the Azure tests will be skipped" >&2
        fi
    fi
fi

# Tests and demos start console scripts (shardkit, moto_server) by name.
export VIRTUAL_ENV=$(cd "$venv" && pwd)
export PATH=$VIRTUAL_ENV/bin:$PATH
