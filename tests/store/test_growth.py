"""A store that grows under its readers: snapshots (`counts` / `upto`), a reader whose tail file the writer
replaced, and the part records (dflash/store/parts.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_store import SMALL, K, L, W, assert_sample, manifest, sample  # (tests/store is on the path)

from dflash.errors import StoreError
from dflash.store import ShardWriter, create_or_check_manifest, open_store, read_manifest
from dflash.store.parts import Part, part_path, part_rows, read_parts, write_part


def _writer(root, shard=0):
    return ShardWriter(root, shard, hidden_width=W, num_layers=L, topk=K, **SMALL)


def test_a_reader_survives_the_writer_replacing_its_tail(tmp_path):
    root = tmp_path / "s"
    create_or_check_manifest(root, manifest())
    with _writer(root) as w:
        for sid in range(5):
            w.append(sid, sid, **sample(sid))
        w.commit()
        early = open_store(root)
        tail = early.shards[0].tail_file
        assert tail is not None and tail.is_file(), "the test needs committed rows in a tail file"
        for sid in range(5, 30):  # whole objects and new tails: the early reader's tail file is deleted
            w.append(sid, sid, **sample(sid))
            w.commit()
        assert not tail.exists()
        for sid in range(5):
            assert_sample(early, sid)  # its rows moved into Zarr objects or a newer tail, unchanged
        assert early.sample_ids() == list(range(5))
        w.finalize()
    for sid in range(5):
        assert_sample(open_store(root, upto=early.counts()), sid)


def test_snapshots_read_the_store_as_it_was(tmp_path):
    root = tmp_path / "s"
    create_or_check_manifest(root, manifest())
    with _writer(root) as w:
        for sid in range(8):
            w.append(sid, sid, **sample(sid))
        w.commit()
        then = open_store(root).counts()
        for sid in range(8, 20):
            w.append(sid, sid, **sample(sid))
        w.finalize()
    assert then == {"shard-00000": 8}
    s = open_store(root, upto=then)
    assert s.sample_ids() == list(range(8)) and len(s) == 8 and s.counts() == then
    assert s.num_tokens == sum(len(sample(i)["input_ids"]) for i in range(8))
    assert open_store(root).counts() == {"shard-00000": 20}
    with pytest.raises(StoreError, match="replaced or recaptured"):
        open_store(root, upto={"shard-00000": 21})
    with pytest.raises(StoreError, match="no longer exist"):
        open_store(root, upto={"shard-00000": 3, "shard-00004": 1})


def test_parts_extend_the_manifest_and_are_checked(tmp_path):
    root = tmp_path / "s"
    create_or_check_manifest(root, manifest())
    keys = [bytes([i]) * 16 for i in range(4)]
    write_part(root, Part(0, 0, 1, 0, "data-v1", 4), keys, np.arange(4))
    write_part(root, Part(1, 1, 2, 4, "data-v2", 9, {"dataset": "/d2.jsonl"}), keys[:2], np.array([3, 7]))
    m = read_manifest(root)
    assert m["num_shards"] == 3 and sorted(m["shards"]) == ["shard-00000", "shard-00001", "shard-00002"]
    assert [p["id_base"] for p in m["parts"]] == [0, 4] and m["parts"][1]["dataset"] == "/d2.jsonl"
    assert part_rows(root, 1).tolist() == [3, 7] and [p.id_end for p in read_parts(root)] == [4, 13]
    with _writer(root, 2) as w:  # a shard of the new part
        w.append(4 + 7, 7, **sample(11))
        w.finalize()
    s = open_store(root)
    assert s.sample_ids() == [11] and not s.complete  # shards 0 and 1 never started
    assert_sample(s, 11)
    part_path(root, 1).rename(part_path(root, 3))  # a gap: part 1 missing
    with pytest.raises(StoreError, match="not contiguous"):
        read_manifest(root)
    part_path(root, 3).rename(part_path(root, 1))
    (root / "manifest.json").write_text(json.dumps({**json.loads((root / "manifest.json").read_text()), "num_shards": 2}))
    with pytest.raises(StoreError, match="part 0 has 1 shards"):
        read_manifest(root)

