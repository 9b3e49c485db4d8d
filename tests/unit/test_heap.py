"""The cyclic collector around the making of many objects (rankscope.contract.heap)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from rankscope.contract.heap import collector_paused, settle, settle_in_this_process


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    gc.unfreeze()
    yield
    settle_in_this_process(False)
    gc.unfreeze()
    gc.enable()


def test_overlapping_pauses_share_one_and_the_last_to_end_restores_the_collector() -> None:
    outer = collector_paused()
    outer.__enter__()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the outer pause is still under way
    outer.__exit__(None, None, None)
    assert gc.isenabled() and gc.get_freeze_count() == 0  # this process did not ask to settle


def test_a_process_that_asked_sets_what_lives_aside_when_a_pause_ends() -> None:
    settle_in_this_process()
    with collector_paused():
        made = [object() for _ in range(10)]  # (objects the collector tracks are what it could set aside)
        made.append([made])
    assert gc.isenabled() and gc.get_freeze_count() > 0
    assert not any(o is made for o in gc.get_objects())
    gc.unfreeze()
    settle()
    assert gc.get_freeze_count() > 0


def test_a_caller_that_turned_the_collector_off_keeps_it_off_and_nothing_is_set_aside() -> None:
    settle_in_this_process()
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled() and gc.get_freeze_count() == 0
