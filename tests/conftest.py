"""Shared fixtures: a real Redis (REDIS_URL or a private server), never a fake."""

from __future__ import annotations

import pytest
import redis

from pdserve.state.redis_server import redis_url as _redis_url


@pytest.fixture(scope="session")
def redis_url():
    with _redis_url() as url:
        yield url


@pytest.fixture
def redis_client(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()
