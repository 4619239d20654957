#!/usr/bin/env bash
# End to end on a small generated folder of real photos: pack, inspect, verify, stream.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
DEMO_DIR="${DEMO_DIR:-/tmp/shardkit-demo}"
PHOTOS="$DEMO_DIR/photos"
SHARDS="$DEMO_DIR/photos-shards"

echo "== 1. a folder of 600 photos in 6 classes (crops of scikit-image's bundled photos)"
"$PY" scripts/make_images.py "$PHOTOS" --images 600 --classes 6 --seed 0
echo
echo "== 2. shardkit pack $PHOTOS $SHARDS --max-size 16MB --workers 2"
rm -rf "$SHARDS"
shardkit pack "$PHOTOS" "$SHARDS" --max-size 16MB --workers 2
echo
echo "== 3. shardkit info"
shardkit info "$SHARDS"
echo
echo "== 4. shardkit verify"
shardkit verify "$SHARDS"
echo
echo "== 5. stream it: StreamingDataset + DataLoader(num_workers=2)"
"$PY" examples/stream_demo.py "$SHARDS"
