"""`freeze_heap`: garbage of the moment is collected, what is alive moves to the collector's permanent generation,
and garbage made afterwards is still collected. In a forked child: freezing is process-wide."""

from __future__ import annotations

import gc
import multiprocessing
import weakref
from concurrent.futures import ProcessPoolExecutor

from beyond_agent.training import freeze_heap


class Node:
    pass


def garbage_cycle() -> weakref.ref:
    """Two objects that only refer to each other: only a collection frees them; a weak reference tells when."""
    first, second = Node(), Node()
    first.other, second.other = second, first
    return weakref.ref(first)


def freeze_and_report() -> dict[str, bool]:
    kept = Node()
    before = garbage_cycle()
    frozen = freeze_heap()
    report = {"garbage before freed": before() is None,
              "count returned": frozen == gc.get_freeze_count() > 1000,
              "alive object frozen": gc.is_tracked(kept) and not any(found is kept for found in gc.get_objects())}
    after = garbage_cycle()
    gc.collect()
    report["garbage after freed"] = after() is None
    return report


def test_the_heap_is_collected_then_frozen_and_later_garbage_still_goes():
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as child:
        report = child.submit(freeze_and_report).result(timeout=60)
    assert report == {"garbage before freed": True, "count returned": True, "alive object frozen": True,
                      "garbage after freed": True}
