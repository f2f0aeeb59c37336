"""Stage one: run the target over a dataset and write a store (docs/DESIGN.md §1, §5).

run: the command (manifest, shards, processes); shard: one shard process (batching, capture, writes).
"""
