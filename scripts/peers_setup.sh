#!/usr/bin/env bash
# Creates and fills .venv-peers, the virtualenv that bench/peers.py runs in: shardkit
# beside the peers it is compared with (webdataset, mosaicml-streaming, litdata, and AWS
# s3torchconnector for the remote benchmark), all on the
# CPU build of torch 2.13.0. Kept apart from .venv because mosaicml-streaming pins
# google-cloud-storage<3.3, which drags gcsfs/s3fs/fsspec back to older releases.
#
# How the peers go in (see shared/PEERS.md): torch first and alone; mosaicml-streaming and
# litdata with --no-deps, since both declare torchvision and a plain install swaps torch for a
# CUDA build plus a torchvision that does not import beside torch 2.13.0+cpu; their runtime
# dependencies are installed by name, under a torch==2.13.0 constraint (and numpy<2.2, which
# mosaicml-streaming declares).
#
# A peer that fails to install does not stop the script: it is written to .venv-peers/failed.txt
# ("name: reason", one a line) and the benchmark reports it. Rerunning does nothing while the stamp
# is newer than this file and pyproject.toml; `rm .venv-peers/.peers-installed` to try again.
#
#     bash scripts/peers_setup.sh

set -uo pipefail
cd "$(dirname "$0")/.."

venv=.venv-peers
stamp=$venv/.peers-installed
failed=$venv/failed.txt
log=$venv/setup.log
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

if [[ -f $stamp && $stamp -nt scripts/peers_setup.sh && $stamp -nt pyproject.toml ]]; then
    exit 0
fi

if [[ ! -x $venv/bin/python ]]; then
    echo "peers-setup: creating $venv" >&2
    "${PYTHON:-python3}" -m venv "$venv" || exit 1
fi
py=$venv/bin/python
constraints=$venv/constraints.txt
# numpy: mosaicml-streaming 0.13.0 declares numpy<2.2, so the whole venv (every contestant) runs on it.
printf '%s\n' "torch==2.13.0" "numpy<2.2" >"$constraints"
: >"$failed"
: >"$log"
pip=("$py" -m pip install -q -c "$constraints")

# Everything below must work, or there is nothing to benchmark.
echo "peers-setup: installing torch and shardkit into $venv (minutes on a fresh machine)" >&2
"$py" -m pip install -q --upgrade pip >>"$log" 2>&1
"${pip[@]}" torch==2.13.0 >>"$log" 2>&1 || { echo "peers-setup: torch failed, see $log" >&2; exit 1; }
# shardkit without the s3/gcs extras (their fsspec pins are what conflicts with mosaicml-streaming);
# [bench] brings matplotlib, webdataset and scikit-image (for scripts/make_images.py).
"${pip[@]}" -e '.[bench]' pillow numpy >>"$log" 2>&1 || { echo "peers-setup: shardkit failed, see $log" >&2; exit 1; }

# One peer: its dependencies (named), then the package itself with --no-deps, then an import
# check (a Python statement). On any failure: one line in failed.txt, and on to the next peer.
peer() {
    local name=$1 spec=$2 check=$3
    shift 3
    local out
    echo "peers-setup: $name" >&2
    if ! out=$("${pip[@]}" "$@" 2>&1) || ! out=$("${pip[@]}" --no-deps "$spec" 2>&1); then
        echo "$out" >>"$log"
        echo "$name: install: $(grep -m1 -iE 'error|no matching' <<<"$out" || tail -n1 <<<"$out")" >>"$failed"
        return
    fi
    echo "$out" >>"$log"
    if ! out=$("$py" -c "$check" 2>&1); then  # in the repository's root: bench/ imports
        echo "$out" >>"$log"
        echo "$name: import: $(tail -n1 <<<"$out")" >>"$failed"
    fi
}

peer webdataset webdataset "import webdataset" webdataset
# mosaicml-streaming imports torchvision at package import: bench/mosaic.py registers stand-ins.
peer mosaicml-streaming mosaicml-streaming==0.13.0 "from bench.mosaic import import_streaming; import_streaming()" \
    boto3 Brotli 'google-cloud-storage>=2.9,<3.3' matplotlib 'paramiko<4' 'python-snappy<1' \
    'transformers<5' 'xxhash<4' 'zstd<2' 'oci<3' 'azure-storage-blob<13' 'azure-storage-file-datalake<13' \
    azure-identity 'catalogue>=2,<3' numpy
peer litdata litdata==0.2.76 "import litdata" \
    lightning-utilities filelock requests tifffile obstore boto3 numpy
# AWS's connector (bench/remote.py --peers): its CRT client comes as s3torchconnectorclient, a wheel.
peer s3torchconnector s3torchconnector==1.5.0 "import s3torchconnector" s3torchconnectorclient==1.5.0

# torchvision is declared by both peers and left out on purpose; anything else is worth a look.
check=$("$py" -m pip check 2>&1)
echo "$check" >>"$log"
if grep -v -i -e torchvision -e '^No broken requirements' <<<"$check" | grep -q .; then
    echo "peers-setup: pip check found conflicts besides the missing torchvision:" >&2
    grep -v -i torchvision <<<"$check" >&2
fi
if [[ -s $failed ]]; then
    echo "peers-setup: some peers failed (the benchmark reports them):" >&2
    cat "$failed" >&2
fi
touch "$stamp"
