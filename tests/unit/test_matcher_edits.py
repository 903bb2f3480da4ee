"""History matching survives the edits clients make to the replies they resend (issue 43), and never
joins two conversations: OpenClaw's secret masking (`…`, `***`), whitespace, Unicode forms,
dropped reasoning, a cut tail; and the negatives: other replies, too little kept, an unmarked
change, two sessions that both fit, another tenant."""

from __future__ import annotations

import pytest

from clawr1.gateway.matcher import HistoryMatcher, resent_matches
from clawr1.gateway.sessions import SessionResolver

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
ASK = {"role": "user", "content": "[Sun 2026-11-29 20:04 UTC] How do I log in?"}
# As OpenClaw's `maskToken` writes a run that matches one of its key patterns: six characters, `…`, four.
REPLY = ("Run `login --key sk-live-teeth-with-braces-2024` and then open the dashboard. "
         "It keeps you signed in for a day.")
MASKED = "Run `login --key sk-liv…2024` and then open the dashboard. It keeps you signed in for a day."


def reply(text: str, **more) -> dict:
    return {"role": "assistant", "content": text, **more}


def started(matcher: HistoryMatcher, session: str, text: str, tenant: str = "default") -> None:
    matcher.record(tenant, session, [SYSTEM, ASK], reply(text))


def next_request(resent: dict) -> list[dict]:
    return [SYSTEM, ASK, resent, {"role": "user", "content": "Thanks. And to log out?"}]


@pytest.mark.parametrize("resent", [
    MASKED,  # OpenClaw's masking of a secret-looking run
    REPLY.replace("sk-live-teeth-with-braces-2024", "***"),  # its mask of a short one, or a KEY=value
    "  " + REPLY.replace(". ", ".\n\n") + "\n",  # whitespace re-flowed and trimmed
    REPLY[:60] + "…",  # the tail cut to a budget, more than half kept
    "<think>the user wants to log in</think>" + REPLY,  # reasoning the reply never had (dropped both ways)
])
def test_an_edited_resend_continues_its_session(resent):
    matcher = HistoryMatcher()
    started(matcher, "s", REPLY)
    match = matcher.find("default", next_request(reply(resent)))
    assert match is not None and match.session_id == "s" and match.prefix_len == 3


def test_unicode_forms_and_dropped_reasoning_compare_equal():
    assert resent_matches(reply("café ﬁne\u00a0day"), reply("cafe\u0301 fine day"))
    assert resent_matches(reply("<think>hmm</think>Paris."), reply("Paris."))


@pytest.mark.parametrize("resent", [
    "Run `login --key` and then open the settings page. It keeps you signed in for a week.",  # another reply
    REPLY.replace("dashboard", "settings"),  # an unmarked change: not an edit we can tell apart
    REPLY[:30] + "…",  # too little of it kept
    "…" + REPLY[-20:],
    MASKED.replace("open the dashboard", "open the door"),  # masked, but other words too
])
def test_other_replies_do_not_continue_it(resent):
    matcher = HistoryMatcher()
    started(matcher, "s", REPLY)
    assert matcher.find("default", next_request(reply(resent))) is None


def test_tool_calls_must_be_the_same():
    call = {"id": "c1", "type": "function", "function": {"name": "exec", "arguments": '{"cmd": "ls"}'}}
    other = {"id": "c1", "type": "function", "function": {"name": "exec", "arguments": '{"cmd": "rm"}'}}
    assert resent_matches(reply(REPLY, tool_calls=[call]), reply(MASKED, tool_calls=[call]))
    assert not resent_matches(reply(REPLY, tool_calls=[call]), reply(MASKED, tool_calls=[other]))
    assert not resent_matches(reply(REPLY, tool_calls=[call]), reply(MASKED))


def test_two_conversations_sharing_a_system_prompt_and_first_message_stay_apart():
    matcher = HistoryMatcher()
    other = "Open the app and press the blue button; a key like sk-abcdefghijklmnop12 is not needed."
    started(matcher, "a", REPLY)
    started(matcher, "b", other)
    assert matcher.find("default", next_request(reply(MASKED))).session_id == "a"
    assert matcher.find("default", next_request(reply(other.replace("sk-abcdefghijklmnop12", "sk-abc…op12")))).session_id == "b"
    assert matcher.find("default", next_request(reply(REPLY))).session_id == "a"  # exact, as before


def test_two_sessions_that_both_fit_match_neither():
    matcher = HistoryMatcher()
    started(matcher, "a", REPLY)
    started(matcher, "b", REPLY + " Ask me anything else.")  # the same start: its cut resend fits both
    assert matcher.find("default", next_request(reply(REPLY[:70] + "…"))) is None
    matcher.forget("default", "b")
    assert matcher.find("default", next_request(reply(REPLY[:70] + "…"))).session_id == "a"


def test_tenants_name_sessions_alike_without_touching_each_other():
    matcher = HistoryMatcher()
    started(matcher, "s", REPLY, tenant="acme")
    started(matcher, "s", REPLY, tenant="globex")
    assert matcher.find("acme", next_request(reply(MASKED))).session_id == "s"
    matcher.forget("globex", "s")
    assert matcher.find("acme", next_request(reply(MASKED))).session_id == "s"  # acme's state kept
    assert matcher.find("globex", next_request(reply(MASKED))) is None
    matcher.forget("acme", "s")
    assert not matcher._keys and not matcher._replies and not matcher._tails  # nothing left behind


def test_the_resolver_counts_how_each_turn_was_found():
    resolver = SessionResolver(lambda session, tenant: None)
    first = resolver.resolve("default", [SYSTEM, ASK], {})
    resolver.record(first, [SYSTEM, ASK], reply(REPLY))
    assert resolver.resolve("default", next_request(reply(MASKED)), {}).session_id == first.session_id
    split = resolver.resolve("default", next_request(reply("Something it never said.")), {})
    assert split.session_id != first.session_id and split.how == "unmatched"
    assert resolver.turns_by_how() == {"edited": 1, "new": 1, "unmatched": 1}
    assert resolver.turns_by_how("acme") == {}
