"""The contestants of `bench_remote.py --peers`: one epoch each, in a fresh process, from
the same S3 server through the same proxy, as each library documents it:

- shardkit: StreamingDataset(s3://..., storage_options=...), defaults, or prefetch=0;
- webdataset: its documented http(s) URLs (presigned GETs), which it reads through `curl`;
- MosaicML Streaming: StreamingDataset(remote="s3://...", local=a fresh folder), S3_ENDPOINT_URL;
- litdata: StreamingDataset("s3://...", storage_options={endpoint_url...}), a fresh cache; patched
  to let its obstore client use a plain-http endpoint (it refuses one: "BadScheme").

Every one: DataLoader(num_workers=2, batch_size=64) (litdata's own StreamingDataLoader), raw
bytes, shuffled, timed from building the dataset (after the imports) to the last batch; each
checks that it saw every sample exactly once. Prints one JSON line.

    python scripts/remote_peers.py prepare PHOTOS OUT      # in .venv-peers: MDS and litdata copies
    python scripts/remote_peers.py run NAME ENDPOINT BUCKET
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BATCH, WORKERS = 64, 2
CHUNK = 24 << 20  # the shards' size, for the peers' own formats too
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def _items(photos: str) -> list[tuple[str, str, int]]:
    """(key, path, label) of every image, in class order."""
    classes = sorted(p.name for p in Path(photos).iterdir() if p.is_dir())
    return [(f"{c}/{f.name}", str(f), label) for label, c in enumerate(classes)
            for f in sorted((Path(photos) / c).iterdir())]


def _lit_item(item: tuple[str, str, int]) -> dict:
    key, path, label = item
    return {"key": key, "jpg": Path(path).read_bytes(), "cls": label}


def prepare(photos: str, out: str) -> None:
    """MosaicML's MDS and litdata's chunks of the images, CHUNK-sized, uncompressed."""
    import bench_peers
    import litdata

    bench_peers._torchvision_stand_in()
    from streaming import MDSWriter

    items = _items(photos)
    with MDSWriter(out=os.path.join(out, "mds"), columns={"key": "str", "jpg": "bytes", "cls": "int"},
                   compression=None, size_limit=CHUNK) as w:
        for item in items:
            w.write(_lit_item(item))
    litdata.optimize(fn=_lit_item, inputs=items, output_dir=os.path.join(out, "lit"), chunk_bytes=CHUNK,
                     num_workers=WORKERS)


def _keys(batch: object) -> list[str]:
    return list(batch["__key__"] if "__key__" in batch else batch["key"])  # type: ignore[index, operator]


def _shardkit(endpoint: str, bucket: str, prefetch: int | None):  # type: ignore[no-untyped-def]
    from torch.utils.data import DataLoader

    from shardkit import StreamingDataset

    opts = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": endpoint}}
    extra = {} if prefetch is None else {"prefetch": prefetch}
    ds = StreamingDataset(f"s3://{bucket}/shardkit", storage_options=opts, shuffle=True, **extra)
    return DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)


def _webdataset(endpoint: str, bucket: str):  # type: ignore[no-untyped-def]
    import boto3
    import webdataset as wds
    from torch.utils.data import DataLoader

    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench")
    names = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="shardkit/")["Contents"]
                   if o["Key"].endswith(".tar"))
    urls = [s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": n}, ExpiresIn=3600) for n in names]
    ds = wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False).shuffle(1000)
    return DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)


def _mosaic(endpoint: str, bucket: str):  # type: ignore[no-untyped-def]
    import bench_peers
    from torch.utils.data import DataLoader

    os.environ["S3_ENDPOINT_URL"] = endpoint
    streaming = bench_peers._import_streaming()
    ds = streaming.StreamingDataset(remote=f"s3://{bucket}/mds", local=tempfile.mkdtemp(prefix="mds-"), shuffle=True,
                                    batch_size=BATCH)
    return DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)


def _litdata(endpoint: str, bucket: str):  # type: ignore[no-untyped-def]
    import litdata
    from litdata.streaming import downloader

    # Patched: litdata fetches chunks through obstore, whose client refuses a plain-http endpoint
    # ("builder error: BadScheme"); its own client options, plus allow_http, let it talk to moto.
    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}

    opts = {"endpoint_url": endpoint, "aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
    ds = litdata.StreamingDataset(f"s3://{bucket}/lit", cache_dir=tempfile.mkdtemp(prefix="lit-"), shuffle=True,
                                  storage_options=opts)
    return litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=_lit_collate)


def _lit_collate(items: list[dict]) -> dict:
    """litdata hands out views into its memory-mapped chunks, which default_collate takes for
    sequences: copied to bytes (as a training step would use them) and listed."""
    return {"key": [i["key"] for i in items], "jpg": [bytes(i["jpg"]) for i in items], "cls": [i["cls"] for i in items]}


LOADERS = {
    "shardkit": lambda e, b: _shardkit(e, b, None),
    "shardkit, read-ahead off": lambda e, b: _shardkit(e, b, 0),
    "webdataset (curl)": _webdataset,
    "MosaicML Streaming": _mosaic,
    "litdata (patched: allow_http)": _litdata,
}
PEERS_VENV = {"MosaicML Streaming", "litdata (patched: allow_http)"}  # run in .venv-peers; the rest in the project's venv


def run(name: str, endpoint: str, bucket: str) -> dict:
    import gc

    import torch  # noqa: F401 - imported before the clock starts, as a training script has it

    os.environ.update(CREDENTIALS)
    tempfile.tempdir = tempfile.mkdtemp(prefix="run-")  # a fresh default cache (shardkit's offsets files) each run
    gc.collect()
    start = time.perf_counter()
    loader = LOADERS[name](endpoint, bucket)
    first, keys = None, []
    for batch in loader:
        if first is None:
            first = time.perf_counter() - start
        keys += _keys(batch)
    took = time.perf_counter() - start
    return {"first_s": first, "seconds": took, "samples": len(keys), "distinct": len(set(keys))}


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(run(sys.argv[2], sys.argv[3], sys.argv[4])))
