"""API keys, unit by unit: the key file (hashed, atomic, 0600), the ring that checks
presented keys (constant time, one answer for every wrong key, reload on change), and the
per-key limits in a real Redis, where two limiters stand for two routers sharing a budget."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import stat
import uuid

import pytest

from pdserve.router.auth import keys as keys_module
from pdserve.router.auth.caller import ANONYMOUS, Caller, KeyLimits
from pdserve.router.auth.gate import INVALID_KEY_MESSAGE, AuthenticationError, Gate, bearer_token
from pdserve.router.auth.keys import (
    KeyFileError,
    KeyRing,
    hash_key,
    new_key,
    parse_key_file,
    read_key_file,
    revoked,
    write_key_file,
)
from pdserve.router.auth.limits import KeyLimiter, LimitKind, RateLimitedError


@pytest.fixture
def key_file(tmp_path):
    """A key file with one key: (path, the key, its entry)."""
    path = tmp_path / "keys.json"
    key, entry = new_key("team-a", KeyLimits())
    write_key_file(path, [entry])
    return path, key, entry


def test_a_new_key_names_its_id_and_the_file_keeps_only_its_sha256(key_file):
    path, key, entry = key_file
    assert key.startswith(f"pdk_{entry.id}_") and len(key) > 50
    assert entry.sha256 == hashlib.sha256(key.encode()).hexdigest() == hash_key(key)
    text = path.read_text()
    assert key not in text and key.split("_", 2)[2] not in text
    assert json.loads(text)["keys"][0]["sha256"] == entry.sha256


def test_the_key_file_is_written_with_mode_0600_and_no_temporary_file_left(key_file):
    path, _, entry = key_file
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    write_key_file(path, [entry, new_key("team-b", KeyLimits())[1]])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["keys.json"]


def test_a_valid_key_authenticates_as_its_caller_with_its_limits(tmp_path):
    limits = KeyLimits(requests_per_minute=60, concurrent_requests=2, tokens_per_minute=1000)
    key, entry = new_key("team-a", limits)
    write_key_file(tmp_path / "k.json", [entry])
    caller = KeyRing.open(tmp_path / "k.json").authenticate(key)
    assert caller == Caller(key_id=entry.id, name="team-a", limits=limits)


def test_missing_malformed_unknown_wrong_and_revoked_keys_are_all_refused(key_file, tmp_path):
    path, key, entry = key_file
    ring = KeyRing.open(path, check_interval_s=0)
    other_key, _ = new_key("elsewhere", KeyLimits())  # of no file here
    wrong_secret = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    for presented in (None, "", "not-a-key", "pdk_", other_key, wrong_secret, key + "x"):
        assert ring.authenticate(presented) is None, presented
    write_key_file(path, [revoked(entry)])
    assert ring.authenticate(key) is None


def test_the_secret_is_compared_in_constant_time_for_known_and_unknown_ids(key_file, monkeypatch):
    path, key, _ = key_file
    ring = KeyRing.open(path)
    compared = []
    real = keys_module.hmac.compare_digest

    def recording(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(keys_module.hmac, "compare_digest", recording)
    assert ring.authenticate(key[:-1] + "!") is None  # a known id, a wrong secret
    assert ring.authenticate(new_key("x", KeyLimits())[0]) is None  # an unknown id
    assert ring.authenticate("garbage") is None
    assert ring.authenticate(key) is not None
    # every attempt went through one comparison of two full-length digests
    assert compared == [(64, 64)] * 4


def test_the_ring_reloads_the_file_when_it_changes_without_a_restart(key_file):
    path, key, entry = key_file
    ring = KeyRing.open(path, check_interval_s=0)
    second_key, second = new_key("team-b", KeyLimits())
    assert ring.authenticate(second_key) is None
    write_key_file(path, [entry, second])
    assert ring.authenticate(second_key).name == "team-b"
    write_key_file(path, [entry, revoked(second)])
    assert ring.authenticate(second_key) is None
    assert ring.authenticate(key).name == "team-a"


def test_a_file_broken_after_start_keeps_the_keys_it_had(key_file):
    path, key, _ = key_file
    ring = KeyRing.open(path, check_interval_s=0)
    path.write_text("{ half written")
    assert ring.authenticate(key).name == "team-a"


def test_the_ring_looks_at_the_file_at_most_once_per_interval(key_file):
    path, _, entry = key_file
    ring = KeyRing.open(path, check_interval_s=3600)
    second_key, second = new_key("team-b", KeyLimits())
    write_key_file(path, [entry, second])
    assert ring.authenticate(second_key) is None  # not looked at again yet


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[]", "format"),
        ('{"format": "pdserve-api-keys/v1", "keys": {}}', "keys"),
        ('{"format": "pdserve-api-keys/v1", "keys": [{"id": "zz"}]}', "keys[0].id"),
        ("not json", "not valid JSON"),
    ],
)
def test_a_malformed_file_is_refused_naming_the_field(text, field):
    with pytest.raises(KeyFileError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_key_file(text)


def test_a_negative_limit_in_the_file_is_refused_naming_it(key_file):
    path, _, _ = key_file
    data = json.loads(path.read_text())
    data["keys"][0]["limits"]["tokens_per_minute"] = -1
    path.write_text(json.dumps(data))
    with pytest.raises(KeyFileError, match=r"keys\[0\]\.limits: tokens_per_minute"):
        read_key_file(path)


def test_the_gate_refuses_every_bad_header_with_one_message(key_file):
    path, key, _ = key_file
    gate = Gate(KeyRing.open(path), None)
    assert gate.authenticate(f"Bearer {key}").name == "team-a"
    assert gate.authenticate(f"bearer   {key} ").name == "team-a"
    messages = set()
    for header in (None, "", key, f"Basic {key}", "Bearer ", f"Bearer {key}0"):
        with pytest.raises(AuthenticationError) as refused:
            gate.authenticate(header)
        messages.add(str(refused.value))
    assert messages == {INVALID_KEY_MESSAGE}


def test_without_a_key_file_every_caller_is_anonymous_and_ids_stay_global():
    assert Gate(None, None).authenticate(None) is ANONYMOUS
    assert ANONYMOUS.scoped_id("r1") == "r1"
    caller = Caller(key_id="0123456789ab", name="a")
    assert caller.scoped_id("r1") == "0123456789ab/r1"
    assert caller.client_id(caller.scoped_id("a/b")) == "a/b"
    assert bearer_token("Token abc") is None


# -- limits in Redis: two limiters are two routers -------------------------------------------


@pytest.fixture
async def routers(redis_url):
    """Two limiters on one Redis, under a prefix of this test's own."""
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    pair = [KeyLimiter(redis_url, key_prefix=prefix, slot_ttl_s=1.0) for _ in range(2)]
    yield pair
    for limiter in pair:
        await limiter.close()


def caller_with(**limits) -> Caller:
    return Caller(key_id=uuid.uuid4().hex[:12], name="t", limits=KeyLimits(**limits))


async def test_two_routers_share_one_requests_per_minute_budget(routers):
    first, second = routers
    caller = caller_with(requests_per_minute=3)
    for limiter in (first, second, first):
        await limiter.admit(caller)
    with pytest.raises(RateLimitedError) as refused:
        await second.admit(caller)
    assert refused.value.kind is LimitKind.REQUESTS_PER_MINUTE
    assert 0 < refused.value.retry_after_s <= 60
    assert "3 requests per minute" in str(refused.value)


async def test_a_refused_request_costs_nothing_of_the_budget(routers):
    first, _ = routers
    caller = caller_with(requests_per_minute=2, concurrent_requests=1)
    slot = await first.admit(caller)
    with pytest.raises(RateLimitedError, match="concurrent"):
        await first.admit(caller)  # refused for concurrency: not charged to the minute
    slot.release()
    await first.wait_written()
    await first.admit(caller)  # the second of two
    with pytest.raises(RateLimitedError, match="requests per minute"):
        await first.admit(caller)


async def test_two_routers_share_the_concurrency_limit_and_a_release_frees_a_slot(routers):
    first, second = routers
    caller = caller_with(concurrent_requests=2)
    slots = [await first.admit(caller), await second.admit(caller)]
    with pytest.raises(RateLimitedError) as refused:
        await second.admit(caller)
    assert refused.value.kind is LimitKind.CONCURRENT_REQUESTS
    slots[0].release()
    await first.wait_written()
    slots.append(await second.admit(caller))


async def test_a_held_slot_is_renewed_past_its_ttl(routers):
    first, second = routers
    caller = caller_with(concurrent_requests=1)
    await first.admit(caller)
    await asyncio.sleep(2.5 * first.slot_ttl_s)  # renewed every third of the TTL
    with pytest.raises(RateLimitedError):
        await second.admit(caller)


async def test_a_dead_routers_slot_expires_within_its_ttl(routers, redis_url):
    _, survivor = routers
    caller = caller_with(concurrent_requests=1)
    prefix = survivor.prefix

    async def admit_and_die() -> None:  # a router that ends without releasing anything
        limiter = KeyLimiter(redis_url, key_prefix=prefix, slot_ttl_s=1.0)
        await limiter.admit(caller)

    await asyncio.to_thread(asyncio.run, admit_and_die())
    with pytest.raises(RateLimitedError):
        await survivor.admit(caller)
    await asyncio.sleep(1.2)
    await survivor.admit(caller)


async def test_tokens_per_minute_count_prompt_and_output_across_routers(routers):
    first, second = routers
    caller = caller_with(tokens_per_minute=100)
    await first.admit(caller)
    first.count_tokens(caller, 60)
    await first.wait_written()
    await second.admit(caller)  # 60 of 100 spent: still room
    second.count_tokens(caller, 40)
    await second.wait_written()
    with pytest.raises(RateLimitedError) as refused:
        await first.admit(caller)
    assert refused.value.kind is LimitKind.TOKENS_PER_MINUTE
    assert 0 < refused.value.retry_after_s <= 60


async def test_a_key_without_limits_needs_no_redis(redis_url):
    limiter = KeyLimiter("redis://127.0.0.1:1")  # nothing listens there
    try:
        slot = await limiter.admit(caller_with())
        slot.release()
    finally:
        await limiter.close()
