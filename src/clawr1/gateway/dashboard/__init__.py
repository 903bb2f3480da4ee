"""The live dashboard at `/dashboard` (see `routes.py`)."""

from clawr1.gateway.dashboard.routes import router

__all__ = ["router"]
