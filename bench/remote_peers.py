"""The contestants of `bench/remote.py --peers`: one epoch each, in a fresh process, from
the same S3 server through the same proxy, as each library documents it:

- shardkit: StreamingDataset(s3://..., storage_options=...), defaults, or prefetch=0, or each S3
  client by name (storage_options["client"]: presigned, obstore, crt, s3fs), or its batches built
  in the worker (`shardkit-batched`: batch_size=64 on the dataset, DataLoader(batch_size=None));
- webdataset: its documented http(s) URLs (presigned GETs), which it reads through `curl`;
- MosaicML Streaming: StreamingDataset(remote="s3://...", local=a fresh folder), S3_ENDPOINT_URL;
- litdata: StreamingDataset("s3://...", storage_options={endpoint_url...}), a fresh cache; patched
  to let its obstore client use a plain-http endpoint (it refuses one: "BadScheme");
- AWS s3torchconnector (its CRT client): S3IterableDataset.from_objects(the shards' URIs,
  endpoint=..., s3client_config=S3ClientConfig(force_path_style=True), enable_sharding=True),
  each object streamed through tarfile.open(fileobj=reader, mode="r|") and its members grouped
  by key into samples, as AWS pairs it with webdataset's tars;
- ceiling: no loader; every shard fetched at once, one `curl` process a shard (a presigned URL,
  bytes to /dev/null; a transfer cut short goes on with a Range from where it stopped).

Every loader: DataLoader(num_workers=2, batch_size=64) (litdata's own StreamingDataLoader), raw
image bytes and the label as an int, batched into a tensor as a training step takes it (the
tars' `cls` member, bytes, is turned into an int for webdataset and s3torchconnector, as
shardkit's sample dict, MDS and litdata give it), shuffled (s3torchconnector: the order of its objects only; it has no sample shuffle),
timed from building the dataset (after the imports: torch and the library) to the last batch; each checks that it saw
every sample exactly once. The ceiling is timed from its first curl to its last and checks that
every byte of every shard came. Prints one JSON line, with `cpu_s` (the CPU seconds of this
process's tree while the clock ran: itself, its DataLoader workers, its curls), `setup_cpu_s`
(before: interpreter and imports) and, for shardkit, its stats() after the epoch.

    python -m bench.remote_peers prepare PHOTOS OUT      # in .venv-peers: MDS and litdata copies
    python -m bench.remote_peers run KEY ENDPOINT BUCKET  # KEY: one of CONTESTANTS
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

BATCH, WORKERS = 64, 2
CHUNK = 24 << 20  # the shards' size, for the peers' own formats too
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def _items(photos: str) -> list[tuple[str, str, int]]:
    """(key, path, label) of every image, in class order."""
    classes = sorted(p.name for p in Path(photos).iterdir() if p.is_dir())
    return [
        (f"{c}/{f.name}", str(f), label)
        for label, c in enumerate(classes)
        for f in sorted((Path(photos) / c).iterdir())
    ]


def _lit_item(item: tuple[str, str, int]) -> dict:
    key, path, label = item
    return {"key": key, "jpg": Path(path).read_bytes(), "cls": label}


def prepare(photos: str, out: str) -> None:
    """MosaicML's MDS and litdata's chunks of the images, CHUNK-sized, uncompressed."""
    import litdata

    from bench.mosaic import torchvision_stand_in

    torchvision_stand_in()
    from streaming import MDSWriter

    items = _items(photos)
    with MDSWriter(
        out=os.path.join(out, "mds"),
        columns={"key": "str", "jpg": "bytes", "cls": "int"},
        compression=None,
        size_limit=CHUNK,
    ) as w:
        for item in items:
            w.write(_lit_item(item))
    litdata.optimize(
        fn=_lit_item, inputs=items, output_dir=os.path.join(out, "lit"), chunk_bytes=CHUNK, num_workers=WORKERS
    )


def _keys(batch: object) -> list[str]:
    return list(batch["__key__"] if "__key__" in batch else batch["key"])  # type: ignore[index, operator]


def _shardkit(  # type: ignore[no-untyped-def]
    endpoint: str, bucket: str, prefetch: int | None, client: str | None = None, batched: bool = False
):
    from torch.utils.data import DataLoader

    from shardkit import StreamingDataset

    opts = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": endpoint}}
    if client is not None:  # the S3 client of its shards' reads (storage/stores/choice.py)
        opts["client"] = client
    extra = {} if prefetch is None else {"prefetch": prefetch}
    if batched:  # batches built in the worker, in shared memory (reading/batching.py)
        ds = StreamingDataset(f"s3://{bucket}/shardkit", storage_options=opts, shuffle=True, batch_size=BATCH, **extra)
        return DataLoader(ds, batch_size=None, num_workers=WORKERS)
    ds = StreamingDataset(f"s3://{bucket}/shardkit", storage_options=opts, shuffle=True, **extra)
    return DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)


def _shard_names(endpoint: str, bucket: str) -> tuple[object, list[tuple[str, int]]]:
    """A boto3 client on `endpoint`, and the (key, size) of shardkit's tar shards by name."""
    import boto3

    s3 = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1"
    )
    found = s3.list_objects_v2(Bucket=bucket, Prefix="shardkit/")["Contents"]
    return s3, sorted((o["Key"], o["Size"]) for o in found if o["Key"].endswith(".tar"))


def _presigned(s3, bucket: str, names: list[tuple[str, int]]) -> list[str]:  # type: ignore[no-untyped-def]
    return [
        s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": n}, ExpiresIn=3600) for n, _ in names
    ]


def _webdataset(endpoint: str, bucket: str):  # type: ignore[no-untyped-def]
    import webdataset as wds
    from torch.utils.data import DataLoader

    s3, names = _shard_names(endpoint, bucket)
    urls = _presigned(s3, bucket, names)
    ds = wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False).shuffle(1000).map(_int_label)
    return DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)


def _mosaic(endpoint: str, bucket: str):  # type: ignore[no-untyped-def]
    from torch.utils.data import DataLoader

    from bench.mosaic import import_streaming

    os.environ["S3_ENDPOINT_URL"] = endpoint
    streaming = import_streaming()
    ds = streaming.StreamingDataset(
        remote=f"s3://{bucket}/mds", local=tempfile.mkdtemp(prefix="mds-"), shuffle=True, batch_size=BATCH
    )
    return DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)


def _litdata(endpoint: str, bucket: str):  # type: ignore[no-untyped-def]
    import litdata
    from litdata.streaming import downloader

    # Patched: litdata fetches chunks through obstore, whose client refuses a plain-http endpoint
    # ("builder error: BadScheme"); its own client options, plus allow_http, let it talk to moto.
    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}

    opts = {"endpoint_url": endpoint, "aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
    ds = litdata.StreamingDataset(
        f"s3://{bucket}/lit", cache_dir=tempfile.mkdtemp(prefix="lit-"), shuffle=True, storage_options=opts
    )
    return litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=_lit_collate)


def _lit_collate(items: list[dict]) -> dict:
    """litdata hands out views into its memory-mapped chunks, which default_collate takes for
    sequences: copied to bytes (as a training step would use them) and listed; the labels as
    a tensor, as default_collate makes them for the others."""
    import torch

    return {
        "key": [i["key"] for i in items],
        "jpg": [bytes(i["jpg"]) for i in items],
        "cls": torch.tensor([i["cls"] for i in items]),
    }


def _int_label(sample: dict) -> dict:
    """The tar's `cls` member (its bytes) as an int, what a training step takes."""
    sample["cls"] = int(sample["cls"])
    return sample


def _tar_samples(reader) -> Iterator[dict]:  # type: ignore[no-untyped-def]
    """The samples of one tar streamed from `reader`: its members grouped by key (the name up to
    the first dot of its last part, as webdataset groups them), one dict a sample."""
    import tarfile

    sample: dict = {}
    with tarfile.open(fileobj=reader, mode="r|") as tar:
        for member in tar:
            if not member.isfile():
                continue
            folder, _, base = member.name.rpartition("/")
            stem, _, ext = base.partition(".")
            key = f"{folder}/{stem}" if folder else stem
            if sample and sample["__key__"] != key:
                yield sample
                sample = {}
            sample["__key__"] = key
            sample[ext] = tar.extractfile(member).read()  # type: ignore[union-attr]
    if sample:
        yield sample


def _s3torch(endpoint: str, bucket: str):  # type: ignore[no-untyped-def]
    import random

    from s3torchconnector import S3ClientConfig, S3IterableDataset
    from torch.utils.data import DataLoader, IterableDataset

    _, names = _shard_names(endpoint, bucket)
    uris = [f"s3://{bucket}/{n}" for n, _ in names]
    random.shuffle(uris)  # its shuffling: the order of the objects
    objects = S3IterableDataset.from_objects(
        uris,
        region="us-east-1",
        endpoint=endpoint,
        enable_sharding=True,
        s3client_config=S3ClientConfig(force_path_style=True),
    )

    class TarSamples(IterableDataset):  # inherited by the forked workers, not pickled
        def __iter__(self) -> Iterator[dict]:
            for reader in objects:  # this worker's objects (enable_sharding)
                yield from map(_int_label, _tar_samples(reader))

    return DataLoader(TarSamples(), batch_size=BATCH, num_workers=WORKERS)


def _ceiling(endpoint: str, bucket: str) -> dict:
    """Every shard fetched at once, one `curl` a shard, bytes to /dev/null; a transfer cut short
    goes on from where it stopped (a Range), at most 20 tries a shard."""
    from concurrent.futures import ThreadPoolExecutor

    s3, names = _shard_names(endpoint, bucket)
    urls = _presigned(s3, bucket, names)

    def fetch(url: str, size: int) -> tuple[int, int]:
        got = tries = 0
        while got < size and tries < 20:
            tries += 1
            ranged = ["-H", f"Range: bytes={got}-"] if got else []
            out = subprocess.run(
                ["curl", "-s", *ranged, "-o", "/dev/null", "-w", "%{http_code} %{size_download}", url],
                capture_output=True,
                text=True,
            ).stdout.split()
            if len(out) == 2 and out[0] == ("206" if got else "200"):
                got += int(out[1])
        return got, tries

    start = time.perf_counter()
    with ThreadPoolExecutor(len(urls)) as pool:  # the threads only wait: each transfer is a curl process
        done = list(pool.map(fetch, urls, [size for _, size in names]))
    took = time.perf_counter() - start
    return {
        "first_s": None,
        "seconds": took,
        "complete": all(got == size for (got, _), (_, size) in zip(done, names)),
        "shards": len(names),
        "shard_bytes": sum(got for got, _ in done),
        "curl_tries": sum(t for _, t in done),
    }


LOADERS = {  # key: (its label in the tables, what builds its loader)
    "shardkit": ("shardkit", lambda e, b: _shardkit(e, b, None)),
    "shardkit-batched": ("shardkit, batches in the worker", lambda e, b: _shardkit(e, b, None, batched=True)),
    "shardkit-off": ("shardkit, read-ahead off", lambda e, b: _shardkit(e, b, 0)),
    "shardkit-presigned": ("shardkit, client presigned", lambda e, b: _shardkit(e, b, None, "presigned")),
    "shardkit-obstore": ("shardkit, client obstore", lambda e, b: _shardkit(e, b, None, "obstore")),
    "shardkit-s3fs": ("shardkit, client s3fs", lambda e, b: _shardkit(e, b, None, "s3fs")),
    "webdataset": ("webdataset (curl)", _webdataset),
    "mosaic": ("MosaicML Streaming", _mosaic),
    "litdata": ("litdata (patched: allow_http)", _litdata),
    "s3torch": ("AWS s3torchconnector (CRT)", _s3torch),
}
CEILING = "ceiling"
CONTESTANTS = {**{key: label for key, (label, _) in LOADERS.items()}, CEILING: "ceiling: all shards at once by curl"}
PEERS_VENV = {"mosaic", "litdata", "s3torch"}  # run in .venv-peers; the rest in the project's venv
INSTALLED_AS = {"mosaic": "mosaicml-streaming", "litdata": "litdata", "s3torch": "s3torchconnector"}  # peers_setup.sh


SHARDKIT = ("shardkit", "shardkit.reading.dataset")  # `from shardkit import StreamingDataset` (a lazy name)
IMPORTS = {  # what each one imports before its clock starts (as a training script has it imported)
    "shardkit": SHARDKIT,
    "shardkit-batched": SHARDKIT,
    "shardkit-off": SHARDKIT,
    "shardkit-presigned": SHARDKIT,
    "shardkit-obstore": SHARDKIT,
    "shardkit-s3fs": SHARDKIT,
    "webdataset": ("webdataset", "boto3"),
    "mosaic": (),
    "litdata": ("litdata", "litdata.streaming.downloader"),
    "s3torch": ("s3torchconnector", "boto3"),
    CEILING: ("boto3",),
}


def _preload(key: str) -> None:
    import importlib

    import torch.utils.data  # noqa: F401

    if key == "mosaic":  # its import, with the torchvision stand-in, takes seconds (it loads transformers)
        from bench.mosaic import import_streaming

        import_streaming()
    for module in IMPORTS[key]:
        importlib.import_module(module)


def _tree_cpu() -> float:
    """CPU seconds of this process's tree so far: itself, its children that ended (getrusage),
    and its descendants still running (/proc: theirs and their own ended children's)."""
    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    total = sum(u.ru_utime + u.ru_stime for u in used)
    parents: dict[int, list[tuple[int, int]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        parents.setdefault(int(fields[1]), []).append((int(stat.parent.name), sum(map(int, fields[11:15]))))
    todo, ticks = [os.getpid()], 0
    while todo:
        for pid, spent in parents.get(todo.pop(), []):
            ticks += spent
            todo.append(pid)
    return total + ticks / os.sysconf("SC_CLK_TCK")


def run(key: str, endpoint: str, bucket: str) -> dict:
    import gc

    _preload(key)
    os.environ.update(CREDENTIALS)
    tempfile.tempdir = tempfile.mkdtemp(prefix="run-")  # a fresh default cache (shardkit's offsets files) each run
    gc.collect()
    setup_cpu = _tree_cpu()
    if key == CEILING:
        return {**_ceiling(endpoint, bucket), "setup_cpu_s": setup_cpu, "cpu_s": _tree_cpu() - setup_cpu}
    start, began = time.perf_counter(), time.time()
    loader = LOADERS[key][1](endpoint, bucket)
    first, keys = None, []
    for batch in loader:
        if first is None:
            first = time.perf_counter() - start
        keys += _keys(batch)
    took = time.perf_counter() - start
    res = {
        "began": began,  # wall clock, for bench/timeline.py
        "first_s": first,
        "seconds": took,
        "samples": len(keys),
        "distinct": len(set(keys)),
        "setup_cpu_s": setup_cpu,
        "cpu_s": _tree_cpu() - setup_cpu,
    }
    if key.startswith("shardkit"):  # the workers' counts, summed in the main process's dataset
        res["stats"] = {k: v for k, v in loader.dataset.stats().items() if isinstance(v, (int, float, str))}
    return res


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(run(sys.argv[2], sys.argv[3], sys.argv[4])))
