"""Benchmarking: `harness` (rounds, interleaving, medians with ranges, ratio and markdown
tables), and `shardkit bench` built on it: `loader` measures StreamingDataset under a
DataLoader, `report` prints and draws the result, `memory` samples a process tree's memory,
`transforms` holds the user's and the default transform."""
