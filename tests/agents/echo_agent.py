"""A minimal black-box agent for the runner's tests, written as any agent would be.

It reads nothing but the environment the runner sets: the stock `openai` client picks up
OPENAI_BASE_URL and OPENAI_API_KEY itself, the task comes from CLAWR1_TASK / CLAWR1_TASK_PROMPT.
It asks the model `meta.turns` times (each call one recorded turn), writes `meta.answer` to
answer.txt in its working directory (the env's workspace), and prints the answer last. With
`meta.rate`, it first tries what a greedy model behind an agent could: to rate its own session
(`POST /v1/feedback {"reward": 1}` with the key it was given), and writes the status it got to
the file `CLAWR1_TEST_RATED` names.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import openai


def main() -> None:
    task = json.loads(os.environ["CLAWR1_TASK"])
    meta = task.get("meta", {})
    time.sleep(float(meta.get("sleep", 0)))  # lets a test run past the wall-time limit
    client = openai.OpenAI(max_retries=0)
    messages = [{"role": "user", "content": os.environ["CLAWR1_TASK_PROMPT"]}]
    for _ in range(int(meta.get("turns", 1))):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=3, temperature=0)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": "Go on."}]
    if meta.get("rate"):
        import httpx

        root = os.environ["OPENAI_BASE_URL"].split(f"/{os.environ['CLAWR1_SESSION_ID']}/")[0]
        rated = httpx.post(f"{root}/v1/feedback", json={"session_id": os.environ["CLAWR1_SESSION_ID"], "reward": 1},
                           headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
        Path(os.environ["CLAWR1_TEST_RATED"]).write_text(str(rated.status_code))
    Path("answer.txt").write_text(str(meta.get("answer", "")))
    print("working on it ...")
    print(meta.get("answer", ""))


if __name__ == "__main__":
    main()
