"""How often the base model keeps each preference, and how often it fails to answer at all, on the
held-out questions: `python -m clawr1.demo.base_rates [--per-question 4] [--data-dir DIR]`.
With `--hint user|system` each reply is sampled as the OPD teacher sees the turn: a correction of the
user's preference (its first wording) placed where `trainer.hint_at` puts it. What the teacher keeps
is the most OPD can teach.

A preference is only worth a simulated user if the base breaks it often enough to learn from, and
the users' non-answer rule is only honest if the base's own replies mostly pass it. Replies are
sampled on the engine directly (no gateway, nothing recorded) exactly as the demo's users ask:
their system prompt, T=0.7, 64 tokens, one seed per reply.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from clawr1.core.config import EngineConfig, default_data_dir
from clawr1.core.types import SamplingParams
from clawr1.demo.preferences import DEFAULT_PREFERENCES, PREFERENCES
from clawr1.demo.questions import HELD_OUT, non_answer, substantive
from clawr1.demo.users import NAMES


async def sample(model: Path, per_question: int, max_tokens: int, temperature: float,
                 threads: int, hint_at: str | None = None) -> list[dict[str, Any]]:
    """`per_question` replies (one user name each) to every held-out question; with `hint_at`, in
    the teacher's context: user k's preference (the demo's set, round-robin) stated as a hint."""
    from clawr1.engine.local import LocalEngine
    from clawr1.trainer.batch import with_hint

    engine = LocalEngine.load(model, EngineConfig(threads=threads, max_batch=16))
    try:
        jobs = [(q, NAMES[k % len(NAMES)]) for q in HELD_OUT for k in range(per_question)]

        async def one(i: int, question: str, name: str) -> dict[str, Any]:
            system = f"You are {name}'s personal assistant. Be helpful and friendly."
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            preference = PREFERENCES[DEFAULT_PREFERENCES[i % len(DEFAULT_PREFERENCES)]]
            if hint_at:
                messages = with_hint(messages, preference.corrections[0].format(name=name), hint_at)
            gen = await engine.generate(engine.render(messages), SamplingParams(
                max_tokens=max_tokens, temperature=temperature, seed=i)).final()
            return {"question": question, "name": name, "system": system, "text": gen.content,
                    "finished": gen.finish_reason == "stop", "preference": preference.name}

        return list(await asyncio.gather(*(one(i, q, n) for i, (q, n) in enumerate(jobs))))
    finally:
        await engine.close()


def rates(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """Per preference: the share of replies whose text keeps its rule, and the share a user counts
    as preferred (answers, keeps the rule, finished); plus the answer, substantive (answers and
    says something the question did not) and finished rates."""
    n = len(replies)
    answers = [non_answer(r["question"], r["text"], r["system"]) is None for r in replies]
    strict = [a and substantive(r["question"], r["text"]) for a, r in zip(answers, replies)]
    out: dict[str, Any] = {"replies": n, "finished": sum(r["finished"] for r in replies) / n,
                           "answers": sum(answers) / n, "substantive": sum(strict) / n, "preferences": {}}
    for name, pref in PREFERENCES.items():
        rule = [pref.check(r["text"], True, r["name"]) for r in replies]
        out["preferences"][name] = {
            "rule_kept": sum(rule) / n,
            "preferred": sum(k and a and r["finished"] for k, a, r in zip(rule, answers, replies)) / n}
    # Each reply scored by its own user's preference only (the one its hint stated, with `--hint`).
    if all("preference" in r for r in replies):
        own = [PREFERENCES[r["preference"]].check(r["text"], True, r["name"]) and a and r["finished"]
               for a, r in zip(answers, replies)]
        out["own_preferred"] = sum(own) / n
    return out


def main(argv: list[str] | None = None) -> int:
    from clawr1.engine.models import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-question", type=int, default=4, help="replies per held-out question (default 4)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--hint", choices=("user", "system"), default=None,
                        help="sample as the OPD teacher: each user's correction as a hint, placed here")
    parser.add_argument("--out", type=Path, help="also write the replies and rates here (JSON)")
    args = parser.parse_args(argv)
    model = resolve_model(args.model, args.data_dir or default_data_dir())
    replies = asyncio.run(sample(model, args.per_question, args.max_tokens, args.temperature, args.threads,
                                   args.hint))
    result = rates(replies)
    print(f"{result['replies']} {'hinted' if args.hint else 'base'} replies: {result['finished']:.2f} finished, "
          f"{result['answers']:.2f} answer the question, {result['substantive']:.2f} substantively; "
          f"{result['own_preferred']:.2f} preferred by their own user's preference")
    for name, r in result["preferences"].items():
        print(f"  {name:16s} rule kept {r['rule_kept']:.2f}  preferred {r['preferred']:.2f}")
    if args.out:
        args.out.write_text(json.dumps({"rates": result, "replies": replies}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
