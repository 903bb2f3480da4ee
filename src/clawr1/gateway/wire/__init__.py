"""The wire formats: one module per API the gateway speaks, each a `Wire` (`pipeline.py`) that
parses its requests into a `Job` and writes its replies, plain and streamed; the one request
pipeline does the rest (admit, generate, resolve the session, record the step, teach the matcher).

- `chat`: OpenAI chat completions (`/v1/chat/completions`);
- `completions`: OpenAI completions, raw prompts as text or token ids (`/v1/completions`);
- `anthropic`: Anthropic Messages (`/v1/messages`), translated to chat and back;
- `responses`: OpenAI Responses (`/v1/responses`), translated to chat and back;
- `translated`: what the two translated formats share (they take chat's path);
- `areal`, `rllm`, `lightning`: the agent frameworks' URL schemes and session calls (AReaL's
  proxy, rLLM's model gateway, Agent Lightning's rollouts) over the formats above.

The pipeline and the serving layer never import a format: `app.py` assembles them, and `internal.py`
(the front's session match) prepares requests with them.
"""
