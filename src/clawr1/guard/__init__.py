"""The guard between the trainer and the users (`guard.py`) and its held-out probe sets (`probes.py`)."""

from clawr1.guard.guard import Guard

__all__ = ["Guard"]
