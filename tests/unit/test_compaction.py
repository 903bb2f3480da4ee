"""Sessions that survive context compaction: the client replaces the older turns by a summary and
keeps its system prompt and the recent turns; history matching still continues the session, and
the last turn before the compaction still gets its next state."""

from __future__ import annotations

import openai

from clawr1.gateway.matcher import HistoryMatcher
from tests.gateway_helpers import live_gateway, steps_of, wait_for

SYSTEM = {"role": "system", "content": "You are a helpful agent."}
SUMMARY = "Summary of the conversation so far: the user asked several questions about cooking."


def compact(history: list[dict], keep: int) -> list[dict]:
    """What an agent sends after compacting: system prompt, a summary, the last `keep` messages."""
    return [history[0], {"role": "user", "content": SUMMARY}, *history[-keep:]]


def converse(matcher: HistoryMatcher | None, turns: int, every: int, keep: int) -> list[str]:
    """A stock client's long conversation through `matcher` (None: a matcher that cannot see
    compactions), compacted every `every` turns; returns the session of each turn."""
    matcher = _PrefixOnly() if matcher is None else matcher
    history, sessions, n = [SYSTEM], [], 0
    for t in range(turns):
        history = history + [{"role": "user", "content": f"question {t}"}]
        if t and t % every == 0:
            history = compact(history, keep)
        match = matcher.find("default", history)
        session = match.session_id if match else f"s{n}"
        n += match is None
        reply = {"role": "assistant", "content": f"answer {t}"}
        matcher.record("default", session, history, reply)
        history = history + [reply]
        sessions.append(session)
    return sessions


class _PrefixOnly(HistoryMatcher):
    """The matcher without compaction detection: the behaviour before it."""

    def _compacted(self, tenant, messages, fps):
        return None


def test_a_compacted_conversation_stays_one_session():
    before, after = converse(None, 30, every=6, keep=3), converse(HistoryMatcher(), 30, every=6, keep=3)
    assert len(set(before)) == 5  # every compaction started a new session
    assert len(set(after)) == 1


def test_only_the_sessions_own_latest_reply_after_its_last_message_and_system_prompt_matches():
    matcher = HistoryMatcher()
    history = [SYSTEM, {"role": "user", "content": "a"}, {"role": "assistant", "content": "A"},
               {"role": "user", "content": "b"}]
    matcher.record("default", "s", history, {"role": "assistant", "content": "B"})
    compacted = [SYSTEM, {"role": "user", "content": SUMMARY}, {"role": "user", "content": "b"},
                 {"role": "assistant", "content": "B"}, {"role": "user", "content": "c"}]
    match = matcher.find("default", compacted)
    assert match is not None and match.session_id == "s" and match.compacted and match.prefix_len == 4
    # Another system prompt, another tenant, an older reply, or the reply after another message: new.
    assert matcher.find("default", [{"role": "system", "content": "Another agent."}, *compacted[1:]]) is None
    assert matcher.find("other", compacted) is None
    assert matcher.find("default", [SYSTEM, {"role": "user", "content": SUMMARY}, {"role": "user", "content": "a"},
                                    {"role": "assistant", "content": "A"}, {"role": "user", "content": "c"}]) is None
    assert matcher.find("default", [SYSTEM, {"role": "user", "content": "x"}, {"role": "assistant", "content": "B"},
                                    {"role": "user", "content": "c"}]) is None
    # The reply must be the request's last assistant message (the one the new message answers).
    assert matcher.find("default", [*compacted, {"role": "assistant", "content": "C"},
                                    {"role": "user", "content": "d"}]) is None
    matcher.forget("default", "s")
    assert matcher.find("default", compacted) is None


def test_a_reply_two_sessions_share_matches_neither():
    """"ok" after "Done." in two open sessions of one agent: a compacted request holding that pair
    cannot say which it continues, so it starts a new session rather than joining the wrong one."""
    matcher = HistoryMatcher()
    for session in ("s1", "s2"):
        matcher.record("default", session, [SYSTEM, {"role": "user", "content": f"task {session}"},
                                             {"role": "assistant", "content": "working"},
                                             {"role": "user", "content": "Done."}], {"role": "assistant", "content": "ok"})
    request = [SYSTEM, {"role": "user", "content": SUMMARY}, {"role": "user", "content": "Done."},
               {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    assert matcher.find("default", request) is None
    matcher.forget("default", "s2")  # once only one session holds it, it is that one's
    assert matcher.find("default", request).session_id == "s1"
    matcher.forget("default", "s1")
    assert not matcher._tails and not matcher._tail_keys  # nothing left behind


def test_a_compacted_request_continues_the_session_over_http_and_pairs_the_last_turn(engine, tmp_path):
    with live_gateway(engine, tmp_path) as (base, pool):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        history = [SYSTEM]
        for t in range(4):
            history.append({"role": "user", "content": f"question {t}"})
            if t == 3:  # the client compacts: turns 0-1 become a summary, turn 2 is kept
                history = compact(history, keep=3)
            reply = client.chat.completions.create(model="m", messages=history, max_tokens=4, temperature=0)
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
        steps = sorted(steps_of(pool, 4), key=lambda s: s.turn_index)
        assert len({s.session_id for s in steps}) == 1 and [s.turn_index for s in steps] == [0, 1, 2, 3]
        # Turn 2 (the last before the compaction) is paired with the compacted request's new message.
        wait_for(lambda: pool.get_steps([steps[2].step_id])[0].next_state, what="turn 2's next state")
        next_state = pool.get_steps([steps[2].step_id])[0].next_state
        assert next_state[-1]["content"] == "question 3"


OPENCLAW_SUMMARY = ("The conversation history before this point was compacted into the following summary:\n\n"
                    "<summary>\n## Goal\nThe user asks about capitals.\n</summary>")


def openclaw_compact(history: list[dict]) -> list[dict]:
    """What the real OpenClaw sends after `openclaw sessions compact` (seen on the wire, 2026.9.6):
    the system prompt, its summary (which takes in the last user message too), the last reply kept,
    then the new message."""
    return [history[0], {"role": "user", "content": OPENCLAW_SUMMARY}, history[-1]]


def test_openclaws_compaction_folds_the_last_message_into_its_summary_and_still_continues_the_session():
    matcher = HistoryMatcher()
    history = [SYSTEM, {"role": "user", "content": "a"}, {"role": "assistant", "content": "A"},
               {"role": "user", "content": "b"}]
    matcher.record("default", "s", history, {"role": "assistant", "content": "B"})
    request = [*openclaw_compact([*history, {"role": "assistant", "content": "B"}]), {"role": "user", "content": "c"}]
    match = matcher.find("default", request)
    assert match is not None and match.session_id == "s" and match.compacted and match.prefix_len == 3
    # Text that is not a compaction summary in that place still starts a new session.
    assert _PrefixOnly().find("default", request) is None
    assert matcher.find("default", [SYSTEM, {"role": "user", "content": "Summary: capitals."}, *request[2:]]) is None


def test_a_long_openclaw_style_conversation_is_split_before_and_one_session_after():
    def converse_openclaw(matcher: HistoryMatcher, turns: int, every: int) -> list[str]:
        history, sessions, n = [SYSTEM], [], 0
        for t in range(turns):
            if t and t % every == 0:
                history = openclaw_compact(history)
            history = history + [{"role": "user", "content": f"question {t}"}]
            match = matcher.find("default", history)
            session = match.session_id if match else f"s{n}"
            n += match is None
            reply = {"role": "assistant", "content": f"answer {t}"}
            matcher.record("default", session, history, reply)
            history = history + [reply]
            sessions.append(session)
        return sessions

    assert len(set(converse_openclaw(_PrefixOnly(), 30, every=6))) == 5
    assert len(set(converse_openclaw(HistoryMatcher(), 30, every=6))) == 1


def test_the_agents_own_summarising_call_is_a_side_turn():
    from clawr1.gateway.sessions import SessionResolver

    resolver = SessionResolver(lambda session, tenant: None)
    summarise = [{"role": "system", "content": "You are a context summarization assistant. Your task is to read a "
                  "conversation between a user and an AI assistant, then produce a structured summary."},
                 {"role": "user", "content": [{"type": "text", "text": "<conversation>\n[User]: a\n</conversation>"}]}]
    assert resolver.resolve("default", summarise, {}).turn_type == "side"
    assert resolver.resolve("default", [SYSTEM, {"role": "user", "content": "a"}], {}).turn_type == "main"


SUMMARISER = {"role": "system", "content": "You are a context summarization assistant. Summarise the conversation."}


def summarise_call(history: list[dict]) -> list[dict]:
    """An agent's summarising call: its transcript rendered as one text (OpenClaw's shape)."""
    lines = [f"[{m['role'].title()}]: {m['content']}" for m in history[1:]]
    return [SUMMARISER, {"role": "user", "content": "<conversation>\n" + "\n".join(lines) + "\n</conversation>"}]


def converse_keeping_nothing(matcher: HistoryMatcher, turns: int, every: int) -> list[str]:
    """A long conversation whose agent compacts every `every` turns and keeps no reply: it asks the
    gateway for a summary (a side turn the resolver reports), then sends [system, summary, new message]."""
    from clawr1.gateway.sessions import SessionResolver, Turn

    resolver = SessionResolver(lambda session, tenant: None)
    resolver.matcher = matcher
    history, sessions = [SYSTEM], []
    for t in range(turns):
        if t and t % every == 0:
            call = summarise_call(history)
            side = resolver.resolve("default", call, {})
            written = {"role": "assistant", "content": f"The user asked questions 0 to {t - 1}; the last was answered."}
            resolver.record(side, call, written)
            history = [SYSTEM, {"role": "user", "content": OPENCLAW_SUMMARY.replace("The user asks about capitals.",
                                                                                      written["content"])}]
        history = history + [{"role": "user", "content": f"question {t}"}]
        turn = resolver.resolve("default", history, {})
        assert isinstance(turn, Turn) and turn.turn_type == "main"
        reply = {"role": "assistant", "content": f"answer {t}, with some detail"}
        resolver.record(turn, history, reply)
        history = history + [reply]
        sessions.append(turn.session_id)
    return sessions


def test_a_compaction_that_keeps_no_reply_continues_the_session_its_summary_was_written_for():
    assert len(set(converse_keeping_nothing(_PrefixOnly(), 30, every=6))) == 5  # before: split at every compaction
    assert len(set(converse_keeping_nothing(HistoryMatcher(), 30, every=6))) == 1


def test_a_summary_matches_only_its_own_session_tenant_and_system_prompt():
    matcher = HistoryMatcher()
    for session, topic in (("s1", "capitals"), ("s2", "rivers")):
        history = [SYSTEM, {"role": "user", "content": f"tell me about {topic}"}]
        matcher.record("default", session, history, {"role": "assistant", "content": f"Here is a long answer on {topic}."})
    transcript = summarise_call([SYSTEM, {"role": "user", "content": "tell me about rivers"},
                                 {"role": "assistant", "content": "Here is a long answer on rivers."}])
    written = {"role": "assistant", "content": "The user asked about rivers and got an answer."}
    assert matcher.record_summary("default", transcript, written) == "s2"
    request = [SYSTEM, {"role": "user", "content": OPENCLAW_SUMMARY.replace("The user asks about capitals.",
                                                                           written["content"])},
               {"role": "user", "content": "and lakes?"}]
    match = matcher.find("default", request)
    assert match is not None and match.session_id == "s2" and match.compacted and match.prefix_len == 2
    assert matcher.find("other", request) is None
    assert matcher.find("default", [{"role": "system", "content": "Another agent."}, *request[1:]]) is None
    unknown = [SYSTEM, {"role": "user", "content": OPENCLAW_SUMMARY}, {"role": "user", "content": "and lakes?"}]
    assert matcher.find("default", unknown) is None  # a summary this gateway never wrote
    # A transcript that holds no open session's last reply, or a too-short summary, is remembered for none.
    assert matcher.record_summary("default", summarise_call([SYSTEM, {"role": "user", "content": "x"}]),
                                  {"role": "assistant", "content": "A summary of something else entirely."}) is None
    assert matcher.record_summary("default", transcript, {"role": "assistant", "content": "ok"}) is None
    matcher.forget("default", "s2")
    assert matcher.find("default", request) is None and not matcher._summaries


def test_a_compaction_that_keeps_no_reply_pairs_the_last_turn_over_http(engine, tmp_path):
    with live_gateway(engine, tmp_path) as (base, pool):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        history = [SYSTEM]
        for t in range(2):
            history.append({"role": "user", "content": f"question {t}"})
            reply = client.chat.completions.create(model="m", messages=history, max_tokens=12, temperature=0)
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
        summary = client.chat.completions.create(model="m", messages=summarise_call(history), max_tokens=24,
                                                 temperature=0).choices[0].message.content
        assert len(" ".join(summary.split())) >= 16, summary  # the tiny model's summary identifies the session
        compacted = [SYSTEM, {"role": "user", "content": OPENCLAW_SUMMARY.replace("The user asks about capitals.", summary)},
                     {"role": "user", "content": "question 2"}]
        client.chat.completions.create(model="m", messages=compacted, max_tokens=4, temperature=0)
        steps = steps_of(pool, 4)
        main = sorted((s for s in steps if s.turn_type == "main"), key=lambda s: s.turn_index)
        assert len({s.session_id for s in main}) == 1 and [s.turn_index for s in main] == [0, 1, 2]
        assert [s.turn_type for s in steps].count("side") == 1  # the summarising call: recorded, never trained
        wait_for(lambda: pool.get_steps([main[1].step_id])[0].next_state, what="turn 1's next state")
        assert pool.get_steps([main[1].step_id])[0].next_state[-1]["content"] == "question 2"
