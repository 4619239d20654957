#!/usr/bin/env bash
# End to end on a fresh machine: photos -> shards -> info/verify -> one streamed epoch.
#   ./scripts/demo.sh [--s3]
# Work goes to $DEMO_DIR (default /tmp/shardkit-demo); its shards/ folder is rebuilt each run.
# DEMO_IMAGES sets the number of photos (default 600); the tests run it on a few.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_setup.sh

demo=${DEMO_DIR:-/tmp/shardkit-demo}
photos=$demo/photos
shards=$demo/shards

set -x
python scripts/make_images.py "$photos" --images "${DEMO_IMAGES:-600}" --classes 6 --seed 0
rm -rf "$shards"
shardkit pack "$photos" "$shards" --max-size 16MB --workers 2
shardkit info "$shards"
shardkit verify "$shards"
python examples/stream_demo.py "$shards"

# --s3: the same photos packed straight into a bucket of a local S3 server (moto, on
# loopback), then trained on from there with examples/train_s3.py (epoch 2 from the cache).
if [[ ${1:-} == --s3 ]]; then
    port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    moto_server -H 127.0.0.1 -p "$port" >"$demo/moto.log" 2>&1 &
    moto_pid=$!
    trap 'kill $moto_pid' EXIT
    endpoint=http://127.0.0.1:$port
    { set +x; } 2>/dev/null  # the polling below, untraced
    echo "+ waiting for moto_server on $endpoint" >&2
    until curl -s "$endpoint/moto-api/" >/dev/null; do
        kill -0 $moto_pid || { cat "$demo/moto.log"; exit 1; }  # it did not start
        sleep 0.2
    done
    set -x
    curl -sf -X PUT "$endpoint/demo" >/dev/null  # the bucket: pack never creates one (a typo would)
    export AWS_ACCESS_KEY_ID=demo AWS_SECRET_ACCESS_KEY=demo  # any credentials work with moto
    shardkit pack "$photos" s3://demo/photos --max-size 16MB --workers 2 -o endpoint_url="$endpoint"
    shardkit info s3://demo/photos -o endpoint_url="$endpoint"
    rm -rf "$demo/cache"
    python examples/train_s3.py s3://demo/photos --endpoint-url "$endpoint" --cache-dir "$demo/cache" --epochs 2
fi
