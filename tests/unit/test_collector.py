"""``sidecar serve``'s collector settings (``sidecar.collector``); that serve applies them:
``tests/e2e/test_serve_collector.py``."""

from __future__ import annotations

import gc

from sidecar import collector


def test_tuning_freezes_startup_and_raises_only_the_young_threshold(gc_restored: None) -> None:
    _, older, oldest = gc.get_threshold()
    built_at_startup: list[list[int]] = [[]]  # a container the collector tracks
    assert any(o is built_at_startup for o in gc.get_objects())
    collector.tune_for_serving()
    assert gc.get_threshold() == (collector.YOUNG_THRESHOLD, older, oldest)
    # Frozen: in the permanent generation, which no collection walks.
    assert not any(o is built_at_startup for o in gc.get_objects())
    assert gc.get_freeze_count() > 0


def test_a_reference_cycle_is_still_collected_after_tuning(gc_restored: None) -> None:
    collector.tune_for_serving()

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # type: ignore[attr-defined]
    del a, b
    assert gc.collect() >= 2
