"""The ``deployment`` of a multi-host test (``support/deployment.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deployment import Deployment, deployed


@pytest.fixture
def deployment() -> Iterator[Deployment]:
    with deployed() as deployment:
        yield deployment
