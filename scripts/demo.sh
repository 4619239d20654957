#!/usr/bin/env bash
# End to end on a fresh machine: photos -> shards -> info/verify -> one streamed epoch.
# Work goes to $DEMO_DIR (default /tmp/shardkit-demo); its shards/ folder is rebuilt each run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_setup.sh

demo=${DEMO_DIR:-/tmp/shardkit-demo}
photos=$demo/photos
shards=$demo/shards

set -x
python scripts/make_images.py "$photos" --images 600 --classes 6 --seed 0
rm -rf "$shards"
shardkit pack "$photos" "$shards" --max-size 16MB --workers 2
shardkit info "$shards"
shardkit verify "$shards"
python examples/stream_demo.py "$shards"
