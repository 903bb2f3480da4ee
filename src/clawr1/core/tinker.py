"""The Tinker service's client, which both Tinker backends use: the engine's sampling clients
(`engine/tinker.py`, `engine.backend = "tinker"`) and the trainer's training client
(`trainer/tinker.py`, `trainer.backend = "tinker"`). Here, below both, so neither imports the other."""

from __future__ import annotations

from typing import Any


def service_client() -> Any:
    """The SDK's `ServiceClient` (URL and key from `TINKER_BASE_URL` / `TINKER_API_KEY`)."""
    try:
        import tinker
    except ImportError as e:
        raise ImportError("trainer.backend / engine.backend = \"tinker\" needs the tinker SDK: "
                          "pip install -e '.[tinker]'") from e
    return tinker.ServiceClient()  # TINKER_BASE_URL, TINKER_API_KEY from the environment
