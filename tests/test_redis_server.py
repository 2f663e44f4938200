import os
import subprocess

import pytest
import redis

from pdserve.state.redis_server import PrivateRedis, find_redis_server, redis_url

pytestmark = pytest.mark.cluster


def test_round_trip_through_the_shared_fixture(redis_client):
    redis_client.set("pdserve:test:key", b"value", ex=30)
    assert redis_client.get("pdserve:test:key") == b"value"
    assert redis_client.delete("pdserve:test:key") == 1


def test_private_server_is_real_and_stops_on_exit(monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    with redis_url() as url:
        client = redis.Redis.from_url(url)
        info = client.info("server")
        assert info["redis_version"]
        assert client.config_get("save")["save"] == ""  # no persistence
        client.close()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()


def test_redis_url_env_is_used_as_is(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    with redis_url() as url:
        assert url == "redis://127.0.0.1:1/0"


def test_binary_runs():
    out = subprocess.run([find_redis_server(), "--version"], capture_output=True, check=True)
    assert b"Redis server" in out.stdout


def test_stop_removes_the_data_directory():
    server = PrivateRedis().start()
    data_dir = server._dir
    assert os.path.isdir(data_dir)
    server.stop()
    assert not os.path.exists(data_dir)


class Interrupted(BaseException):
    """Stands in for Ctrl-C (or SIGTERM as a command raises it) during the wait."""


def _interrupt_the_first_ping(monkeypatch) -> list[subprocess.Popen]:
    """Make the readiness wait end in Interrupted; the redis-server processes started."""
    started: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def recorded(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    def interrupted(self, *args, **kwargs):
        raise Interrupted

    monkeypatch.setattr(subprocess, "Popen", recorded)
    monkeypatch.setattr(redis.Redis, "ping", interrupted)
    return started


@pytest.mark.parametrize("kind", ["private", "supervised"])
def test_a_start_interrupted_while_waiting_leaves_no_redis_server(monkeypatch, kind):
    from pdserve.cluster.supervisor import RedisChild
    from pdserve.state.redis_server import free_port

    started = _interrupt_the_first_ping(monkeypatch)
    server = PrivateRedis() if kind == "private" else RedisChild(free_port())
    with pytest.raises(Interrupted):
        server.start()
    [proc] = started
    assert proc.poll() is not None  # stopped before the interrupt went on
