"""`python -m shardkit`: the `shardkit` command, for environments without its script on PATH."""

from .cli import main

main(prog_name="shardkit")
