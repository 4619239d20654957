"""Exceptions. Every error shardkit raises on bad input is a ShardkitError with a one-line
message naming the file, shard or URL; subclasses also derive from the builtin a caller would
expect, so `except ValueError` and `except FileNotFoundError` keep working."""


class ShardkitError(Exception):
    """Base class of shardkit's errors."""


class SourceError(ShardkitError, ValueError):
    """The input folder cannot be packed (missing, empty, no class folders, bad file)."""


class CorruptShardError(ShardkitError, ValueError):
    """A shard or its index does not hold what it should (truncated, checksum, count)."""


class IndexVersionError(ShardkitError, ValueError):
    """index.json was written by a newer or unknown version of shardkit."""


class DatasetNotFoundError(ShardkitError, FileNotFoundError):
    """No index.json and no shards at the given location."""
