"""The project's benchmarks, one module per benchmark, each on shardkit's harness
(shardkit.bench.harness: rounds, interleaving, medians, ranges, ratio tables). Run from the
repository's root as modules, ``python -m bench.remote --images 2000 --rounds 3``; each
module's docstring says what it measures and how to run it (docs/measurements.md has the
figures). Shared pieces: `readers` (the local readers' contestants), `s3` (servers on
loopback, started as the tests start them: tests/servers/), `mosaic` (mosaicml-streaming
beside torch's CPU build). Not shipped in the wheel."""
