"""The session protocol's precedence (path ids, then X-Session-Id, then a per-session key, then
history), written once: the session a request resolves to and the replica it is routed to agree."""

from __future__ import annotations

import pytest

from clawr1.gateway.sessions import SessionResolver, affinity_key, named_session

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(("headers", "path_ids", "bound", "expected", "how"), [
    ({"x-session-id": "h"}, ("p", "g"), "k", "p", "path"),  # the path beats everything
    ({"x-session-id": "h"}, None, "k", "h", "header"),  # then the header
    ({}, None, "k", "k", "key"),  # then the per-session key
])
def test_the_named_session_wins_in_order_and_routing_follows_it(headers, path_ids, bound, expected, how):
    turn = SessionResolver(lambda session, tenant: None).resolve("acme", MESSAGES, headers, path_ids, bound)
    assert (turn.session_id, turn.how) == (expected, how)
    assert named_session(headers, path_ids, bound)[0] == expected
    assert affinity_key("acme", MESSAGES, headers, path_ids, bound) == f"acme/{expected}"


def test_without_a_name_history_decides_and_routing_hashes_the_first_user_message():
    resolver = SessionResolver(lambda session, tenant: None)
    assert named_session({}, None, None) is None
    assert resolver.resolve("acme", MESSAGES, {}).how == "new"
    key = affinity_key("acme", MESSAGES, {}, None)
    assert key.startswith("acme/") and key == affinity_key("acme", [*MESSAGES, {"role": "assistant", "content": "Yo"},
                                                                  {"role": "user", "content": "More"}], {}, None)
    assert key != affinity_key("acme", [{"role": "user", "content": "Other"}], {}, None)


def test_a_requests_messages_are_hashed_once_from_matching_to_recording(monkeypatch):
    from clawr1.gateway import matcher

    calls, extended = [], []
    real_fingerprint, real_extend = matcher.fingerprint, matcher._extend

    def counted(message):
        calls.append(message.get("content"))
        return real_fingerprint(message)

    def extend(prefix_hash, fp):
        extended.append(fp)
        return real_extend(prefix_hash, fp)

    monkeypatch.setattr(matcher, "fingerprint", counted)
    monkeypatch.setattr(matcher, "_extend", extend)
    resolver = SessionResolver(lambda session, tenant: None)
    turn = resolver.resolve("acme", MESSAGES, {})
    resolver.record(turn, MESSAGES, {"role": "assistant", "content": "Yo"})
    assert sorted(calls) == sorted(["You are terse.", "Hi", "Yo"])  # each message once, and the reply
    # Each prefix's rolling hash once (matching), then the two index keys (with and without the
    # last message) each one step on from a prefix already hashed: O(1) at recording, not O(n).
    assert len(extended) == len(MESSAGES) + 2
    follow = [*MESSAGES, {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "More"}]
    assert resolver.resolve("acme", follow, {}).session_id == turn.session_id  # still matched
