"""The ``deployment`` of a multi-host test (``support/deployment.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deployment import Deployment
from hosts import Hosts
from servers import PostgresServer, RedisServer, running


@pytest.fixture
def deployment() -> Iterator[Deployment]:
    with running(Hosts, 4) as hosts:
        store = PostgresServer().placed(hosts[0], 5432)
        broker = RedisServer().placed(hosts[0], 6379)
        with (
            running(lambda: store),
            running(lambda: broker),
            running(Deployment, hosts, store, broker) as deployed,
        ):
            yield deployed
