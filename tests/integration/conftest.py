"""Fixtures of the integration tests (pytest finds them here; import nothing from this file)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from headless_drills import HeadlessDrills


@pytest.fixture(scope="session")
def headless_drills(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HeadlessDrills]:
    """Headless drills shared by the tests that assert on the same job: each distinct one runs once a session."""
    drills = HeadlessDrills(tmp_path_factory.mktemp("headless-drills"))
    try:
        yield drills
    finally:
        drills.close()
