"""Every kernel test also asks the interpreter's race detector: a test whose (last) interpreted
kernel raced fails, whatever its numbers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.pallas_kernels.interpret import races_found


@pytest.fixture(autouse=True)
def no_races() -> Iterator[None]:
    yield
    assert not races_found(), "the Pallas interpreter's race detector reported a race"
