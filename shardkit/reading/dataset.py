"""StreamingDataset: a torch IterableDataset over shards, split across DDP ranks and
DataLoader workers, every rank yielding exactly the same number of samples.

The dataset object is cheap to build and to pickle: it holds the index as numpy arrays.
Everything else (open files, the worker's plan) is made inside `__iter__`, in the worker.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import numpy as np

from .. import checks
from ..decode import decoder
from ..formats.gzip import MAX_MEMBER
from ..index.resolve import resolve
from ..storage import StorageOptions, opening_counts
from ..storage.fetch import per_worker
from ..storage.stores import store_for
from .sources import compressed
from .counters import Slot
from .epoch_stream import EpochStream
from .epochs import EpochDataset, distinct
from .mix import MixedDataset, check_parts
from .pass_ import Pass
from .sources import source_for
from .sources.base import SampleSource
from .spec import ReadAhead, ReadSpec, SampleOrder


class StreamingDataset(EpochDataset):
    """Stream samples from tar shards (a dataset folder with index.json, a brace pattern
    such as ``shards-{000000..000009}.tar``, or a list of shard paths or URLs).

    Yields WebDataset-style dicts: ``__key__``, ``__url__`` and one entry per field,
    images decoded as `decode` says ("raw" bytes, "pil", "rgb8" HWC uint8 numpy, "tensor"
    CHW uint8 torch), ``cls`` as int, ``json`` as dict. Decoded, the image is under
    ``"image"`` whatever its extension, which ``"__ext__"`` keeps (``s["jpg"]`` still reads
    it), so the default collate batches mixed formats. JPEG decodes by libjpeg-turbo's fast
    path to PIL's very pixels unless ``backend="pil"`` (see shardkit.decode). `transform(sample)`
    runs in the worker and its result is what the DataLoader receives.

    Every rank yields ``len(ds)`` samples per epoch. With ``remainder="repeat"`` (default)
    the last few samples that don't divide evenly are topped up by repeating samples from
    the start of the epoch's order, so none is ever left out; ``"drop"`` leaves a few out.
    With ``shuffle=True`` the order depends only on (seed, epoch) and the layout (world size,
    num_workers); call ``set_epoch`` each epoch, or let each pass advance the epoch by one.
    With ``global_batch_size=B`` it depends on (seed, epoch) alone: the epoch is a sequence
    of global batches of B samples, the same for any layout, each rank handing over its
    B / world-size slice of batch k as its k-th batch.

    ``batch_size=B`` makes each worker yield whole batches, collated as ``default_collate``
    would but straight into reused shared memory (see batching.py): use it with
    ``DataLoader(ds, batch_size=None)``. ``len(ds)`` then counts batches, at most one of them
    short per rank.

    gzip-compressed shards (``.tar.gz``, told by their first bytes) are read as streams:
    each is one block of the shuffle, inflated once a pass. ``.gz`` fields are inflated
    (keeping their names, as webdataset does); ``max_member_size`` caps what a field, or a
    compressed shard's sample, may inflate to.

    Args:
        source: a dataset folder or URL prefix holding index.json, a brace pattern of shards
            (``shards-{000000..000009}.tar``), or a list of shard paths or URLs.
        shuffle: shuffle each epoch: shard blocks in a permuted order, then a bounded buffer.
        seed: the shuffle's seed; the order is a pure function of (seed, epoch, layout).
        decode: how image fields come back: ``"raw"`` bytes, ``"pil"``, ``"rgb8"`` (HWC uint8
            numpy) or ``"tensor"`` (CHW uint8 torch), decoded ones under ``"image"``.
        backend: ``"auto"`` decodes JPEGs by libjpeg-turbo's fast path (PIL's very pixels;
            docs/decoding.md), the rest with PIL; ``"pil"`` decodes every image with PIL.
        transform: a function of the sample dict, run in the worker; its result is what the
            DataLoader receives (a top-level function under spawn).
        rank: this process's rank; default from torch.distributed, else RANK, else 0.
        world_size: the number of ranks; default from torch.distributed, else WORLD_SIZE, else 1.
        remainder: ``"repeat"`` tops every rank up to the same count with samples from the start
            of the epoch's order; ``"drop"`` leaves the last few out.
        shuffle_window: the shuffle buffer's size, in samples.
        block: samples per block: the unit that is shuffled and read from a remote shard.
        on_error: ``"raise"`` stops at a bad sample, naming it; ``"skip"`` skips it (a good one
            stands in, so every rank's count stays exact) and counts it in ``stats()``.
        verify: check each shard's sha256 against the index before reading it.
        prefetch: read-ahead depth: the most blocks in flight per worker (0: no background reads;
            None: 8 from local disk, 32 from a store, where the read-ahead keeps as many as the
            link needs below it, within prefetch_bytes).
        prefetch_bytes: the most bytes read ahead per worker (``"256MB"`` or an int).
        cache_dir: a local folder that keeps remote blocks read once (None: no cache).
        cache_limit: the cache's size cap; least recently used blocks go first.
        storage_options: passed to fsspec unchanged (``endpoint_url``, ``anon``, ...), but for
            shardkit's own ``timeout`` (seconds of silence before a request is tried again,
            default 20) and ``attempts`` (see docs/guides/remote.md), and ``client``: the S3 client
            of the shard reads, ``"presigned"`` (the default), ``"obstore"`` or ``"s3fs"``
            (storage/stores/choice.py).
        batch_size: yield batches of this many samples, built in the workers.
        global_batch_size: B: the epoch becomes a sequence of global batches of B samples that
            is the same for any world size and num_workers; each rank's DataLoader (its
            ``batch_size=ds.local_batch_size``, B / world size) hands over its slice of global
            batch k as its k-th batch (docs/guides/resume.md).
        max_member_size: the most a ``.gz`` field, or a sample of a compressed shard, may
            inflate to (a decompression bomb is refused, naming it).
    """

    def __init__(
        self,
        source: str | Sequence[str],
        *,
        shuffle: bool = False,
        seed: int = 0,
        decode: str = "raw",
        backend: str = "auto",
        transform: Callable[[dict[str, Any]], Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        remainder: str = "repeat",
        shuffle_window: int = 1024,
        block: int = 64,
        on_error: str = "raise",
        verify: bool = False,
        prefetch: int | None = None,
        prefetch_bytes: int | str = "256MB",
        cache_dir: str | None = None,
        cache_limit: int | str = "20GB",
        storage_options: StorageOptions | None = None,
        batch_size: int | None = None,
        max_member_size: int | str = MAX_MEMBER,
        global_batch_size: int | None = None,
    ):
        super().__init__(
            rank,
            world_size,
            shuffle=shuffle,
            seed=seed,
            shuffle_window=shuffle_window,
            remainder=remainder,
            batch_size=batch_size,
            global_batch_size=global_batch_size,
        )
        on_error = checks.on_error(on_error)
        self.block = checks.integer("block", block, 1)
        self.prefetch = None if prefetch is None else checks.integer("prefetch", prefetch)
        decoder(decode, backend)  # validate early, in the main process
        before = opening_counts()
        self.urls, self.index = resolve(source, checks.mapping("storage_options", storage_options))
        self.decode, self.backend, self.on_error = decode, backend, on_error
        self.transform = checks.function("transform", transform)
        self.storage_options, self.verify = storage_options, checks.flag("verify", verify)
        self.prefetch_bytes = checks.size("prefetch_bytes", prefetch_bytes, 1)
        self.cache_dir, self.cache_limit = cache_dir, checks.size("cache_limit", cache_limit, 1)
        if cache_dir is not None and os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
            raise ValueError(f"cache_dir {cache_dir!r} is a file, not a folder")
        if cache_dir is not None and self.cache_limit < self.prefetch_bytes:
            raise ValueError(
                f"cache_limit ({self.cache_limit} bytes) is smaller than the read-ahead budget prefetch_bytes "
                f"({self.prefetch_bytes} bytes): raise cache_limit or lower prefetch_bytes"
            )
        self._counts = np.array([s.samples for s in self.index.shards], dtype=np.int64)
        self.max_member_size = checks.size("max_member_size", max_member_size, 1)
        self._samples = source_for(
            self.index, self.urls, storage_options, cache_dir, self.cache_limit, self.max_member_size
        )
        self._opened = {name: n - before[name] for name, n in opening_counts().items()}
        self._blocks = compressed.blocks(self.index.shards, self.block)
        self.index = self.index.slim()  # the per-sample tables live on in the source's arrays only
        # made once: a worker building them again from the shards touches every shard's objects,
        # and with them copies the pages they sit on (~30 MB a worker at 100k shards)
        self._shard_values = (
            tuple(self.urls),
            tuple(s.sha256 for s in self.index.shards),
            tuple(s.version for s in self.index.shards),
        )
        self._store: str | None = None  # store_name(), once asked
        self._config: list[dict[str, str]] | None = None  # store_config(), once asked

    @property
    def classes(self) -> tuple[str, ...]:
        return self.index.classes

    @staticmethod
    def mix(
        parts: Sequence[tuple[str | Sequence[str] | StreamingDataset, float]],
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        **options: Any,
    ) -> MixedDataset:
        """Several datasets drawn by weight: `StreamingDataset.mix([("s3://a", 0.7), ("s3://b", 0.3)],
        shuffle=True)`. Options: samples_per_epoch (default: all samples together), shuffle,
        seed, shuffle_window, remainder, rank, world_size, batch_size (batches of the mixture,
        as StreamingDataset's), global_batch_size (global batches of the mixture), and any
        StreamingDataset option for the parts given as URLs.
        See shardkit/reading/mix.py for the epoch semantics."""
        check_parts(parts)
        own = {k: options.pop(k) for k in MixedDataset.OPTIONS if k in options}
        if any(isinstance(p, StreamingDataset) and p.batch_size for p, _ in parts):
            raise ValueError("the datasets of a mix yield samples: give batch_size to the mix, not to its parts")
        if options and any(isinstance(p, StreamingDataset) for p, _ in parts):
            raise ValueError(
                f"options for the parts ({', '.join(sorted(options))}) apply to parts given as URLs: "
                "give them to the StreamingDataset parts themselves"
            )
        built = [
            (
                p
                if isinstance(p, StreamingDataset)
                else StreamingDataset(p, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size, **options),
                w,
            )
            for p, w in parts
        ]
        return MixedDataset(built, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size, **own)

    def total_samples(self) -> int:
        return int(self._counts.sum())

    def _piece(self) -> int:
        return max(1, self.block // 2)  # a block's halves go to different global batches

    def _bounds(self) -> Callable[[int], Callable[[int, int], tuple[np.ndarray, np.ndarray]]]:
        order = self._sample_order()
        return lambda epoch: order.epoch(epoch).bounds

    def order_key(self) -> dict[str, Any]:
        if not self.shuffle:
            return super().order_key()
        # the shuffled order goes shard by shard: the same samples cut into other shards are another order
        digest = hashlib.sha256(np.asarray(self._counts, dtype="<i8").tobytes()).hexdigest()[:12]
        order = {
            **super().order_key(),
            "block": self.block,
            "shard_sizes": f"{len(self._counts)} shards, sha256 {digest}",
        }
        if isinstance(self._blocks, np.ndarray):  # compressed shards are blocks of their own
            order["blocks"] = hashlib.sha256(np.asarray(self._blocks, dtype="<i8").tobytes()).hexdigest()[:12]
        return order

    def read_spec(self) -> ReadSpec:
        """What a pass over this dataset needs, as it is set now (frozen, picklable)."""
        urls, versions, pins = self._shard_values
        return ReadSpec(
            urls,
            self.storage_options,
            versions,
            pins,
            self._sample_order(),
            self.decode,
            self.backend,
            self.transform,
            self.on_error,
            self.verify,
            ReadAhead(self.block, self.prefetch, self.prefetch_bytes),
            self.cache_dir,
            self.cache_limit,
            bool(self.global_batch_size),
        )

    @property
    def source(self) -> SampleSource:
        """The dataset's samples by global id (its format's reads and parsing)."""
        return self._samples

    def store_name(self) -> str:
        if self._store is None:
            names = {store_for(u, self.storage_options).name for u in self.urls}
            self._store = ", ".join(sorted(names))
        return self._store

    def store_config(self) -> list[dict[str, str]]:
        if self._config is None:
            self._config = distinct(store_for(u, self.storage_options).describe(u) for u in self.urls)
        return [dict(c) for c in self._config]

    def slot(self, worker_id: int) -> Slot:
        """Where worker `worker_id`'s statistics go (what `stats()` sums)."""
        return Slot(self._shared, worker_id)

    def _sample_order(self) -> SampleOrder:
        return SampleOrder(self._counts, self.seed, self.shuffle, self._blocks)

    def ids_at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The samples at `positions` of epoch `epoch`'s global sequence."""
        return self._sample_order().ids_at(epoch, positions)

    def _pass(self, rank: int, world: int, worker_id: int, num_workers: int) -> EpochStream:
        spec, source, slot, window = self.read_spec(), self._samples, self.slot(worker_id), self.shuffle_window
        connections = per_worker(num_workers)

        def run(epoch: int, positions: Iterator[np.ndarray]) -> Generator[Any, None, None]:
            return Pass(spec, source, spec.order.ids_in(epoch, positions), slot, window, connections).samples()

        return self._epoch_stream(rank, world, worker_id, num_workers, run)

    def __iter__(self) -> Iterator[Any]:
        return self._stream(self._pass(*self._layout()))
