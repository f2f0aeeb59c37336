"""The store: a directory of precomputed target hidden states (docs/DESIGN.md §5).

    from dflash.store import open_store, verify_store, ShardWriter
"""

from dflash.store.manifest import (
    FORMAT_VERSION,
    compare_manifest,
    create_or_check_manifest,
    mark_shard,
    read_manifest,
    require_final_hidden,
    shard_name,
)
from dflash.store.reader import Store, open_store
from dflash.store.verify import Report, verify_store
from dflash.store.writer import ShardWriter

__all__ = [
    "FORMAT_VERSION",
    "Report",
    "ShardWriter",
    "Store",
    "compare_manifest",
    "create_or_check_manifest",
    "mark_shard",
    "open_store",
    "read_manifest",
    "require_final_hidden",
    "shard_name",
    "verify_store",
]
