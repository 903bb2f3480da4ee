"""What every config section shares: the base model (extra keys refused, field docstrings as
descriptions, assignments validated) and the names several sections use."""

from __future__ import annotations

import os
from pathlib import Path, PurePath

from pydantic import BaseModel, ConfigDict

EMBEDDED_MODEL = "smollm2-135m-instruct"
# Where the OPD teacher reads a hint (`trainer.hint_at`) for a model that names none: by the model's
# name or its converted directory's. SmolLM2-135M stays where its demo runs were measured; an
# instruct model that follows a system prompt (Qwen2.5, and any other) reads it there.
HINT_AT = {"smollm2-135m-instruct": "user"}


def hint_at_for(model: str) -> str:
    """`trainer.hint_at` for `engine.model` when the config names none."""
    return HINT_AT.get(PurePath(model).name, "system")
SECRET_FIELDS = frozenset({"api_keys", "admin_key", "judge_api_key", "keys", "postgres_dsn", "api_key"})
TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # safe as a directory and an adapter name


def default_data_dir() -> Path:
    """`$CLAWR1_DATA_DIR`, else `~/.clawr1`."""
    return Path(os.environ.get("CLAWR1_DATA_DIR", Path.home() / ".clawr1"))


class _Section(BaseModel):
    # Field docstrings become the fields' descriptions in the JSON schema (`Config.model_json_schema()`).
    # Inputs are left out of validation errors: a config error is printed, and its input may be a
    # key (`tenants.keys` holds every tenant's).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              hide_input_in_errors=True)
