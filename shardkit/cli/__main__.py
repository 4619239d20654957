"""`python -m shardkit.cli`: the `shardkit` command, as `python -m shardkit` is."""

import sys

from ..cli import run

sys.exit(run())
