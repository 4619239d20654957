"""The training loop of train_local.py, reading from an object store.

    python examples/train_s3.py s3://bucket/photos-shards --endpoint-url http://127.0.0.1:9000 \\
        --cache-dir /tmp/shardkit-cache

Credentials come from the usual places (environment, ~/.aws); --endpoint-url is for an S3
server of your own (scripts/demo.sh --s3 starts one on loopback and runs this).
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch.utils.data import DataLoader
from train_local import model, to_training_pair, train_epoch

from shardkit import StreamingDataset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url", help="s3://bucket/prefix written by `shardkit pack`")
    ap.add_argument("--endpoint-url", help="S3 endpoint, e.g. a local server")
    ap.add_argument("--cache-dir", help="keep downloaded blocks here; epoch 2 reads from disk")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--label", default="cls", help="the field holding each sample's class number")
    args = ap.parse_args()

    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    ds = StreamingDataset(
        args.url,
        shuffle=True,
        seed=0,
        decode="tensor",
        transform=functools.partial(to_training_pair, label=args.label),
        storage_options=options,
        cache_dir=args.cache_dir,
    )
    loader = DataLoader(
        ds,
        batch_size=args.batch_size,
        num_workers=args.workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=args.workers > 0,
    )
    net = model(len(ds.classes) or 1000)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    print(f"{args.url}: {len(ds)} samples per epoch, {len(ds.classes)} classes")
    for epoch in range(args.epochs):
        ds.set_epoch(epoch)
        before = ds.stats()
        r = train_epoch(net, opt, loader)
        seen, took = r["seen"], r["took"]
        after = ds.stats()
        downloaded = (after["fetched_bytes"] - before["fetched_bytes"]) / 1e6
        hits = after["cache_hits"] - before["cache_hits"]
        print(
            f"epoch {epoch}: {seen / took:.0f} samples/s, downloaded {downloaded:.1f} MB, {hits:.0f} cache hits, "
            f"read-ahead depth {after['prefetch_depth']:.1f}, fetch latency {after['fetch_latency_s'] * 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main()
