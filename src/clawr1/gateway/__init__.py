"""The HTTP surface: OpenAI-compatible routes, session identification, auth, streaming, recording."""
