"""dflash2/runtime/gc_watch.py: collections inside the block are counted per generation and timed."""

import gc

from dflash2.runtime.gc_watch import collections_logged


def test_collections_are_counted_per_generation_and_timed():
    with collections_logged() as log:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    assert log.stats["gen0"]["collections"] >= 1 and log.stats["gen2"]["collections"] >= 2
    assert log.stats["gen2"]["max_ms"] > 0 and log.stats["gen2"]["total_ms"] >= log.stats["gen2"]["max_ms"]
    assert log not in gc.callbacks  # the callback leaves with the block
    before = log.stats["gen2"]["collections"]
    gc.collect(2)
    assert log.stats["gen2"]["collections"] == before
