"""The formats a dataset's samples are stored in, by name (the index's `kind`).

Each format module works on files or environments it is handed and never imports storage:

- tar.py: WebDataset tar shards. `TarWriter` writes a shard deterministically (a sample's
  members adjacent, fixed headers) and records each sample's offset; `iter_samples`, `scan`
  and `read_sample` read a whole shard or one sample's byte range.
- lmdb.py: one LMDB, one record per member (key `KEY.EXT`), the index stored inside.
  `Writer` commits a job's samples and its progress in one transaction; `read_one` reads a
  sample by key.

Around them, each side plugs a format in once: the packer's commit mechanism takes a sink
(packing/tar_sink.py, packing/lmdb_sink.py) and the reader a sample source
(reading/samples.py), both chosen by these names.
"""

FORMATS = ("tar", "lmdb")
