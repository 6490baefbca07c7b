"""What every plugin shares: strict typed parameters and the configuration error."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["PluginConfigError", "PluginParams", "parse_params"]


class PluginConfigError(ValueError):
    """A plugin's parameters are wrong; the message names the type, the instance and the key."""


class PluginParams(BaseModel):
    """Base of each plugin's ``Params``: unknown keys are errors, values are validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


P = TypeVar("P", bound=PluginParams)


def parse_params(model: type[P], type_: str, name: str, params: Mapping[str, Any] | None) -> P:
    try:
        return model.model_validate(dict(params or {}))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(parameters)"
            msg = "unknown parameter" if err["type"] == "extra_forbidden" else err["msg"]
            problems.append(f"{loc}: {msg}")
        raise PluginConfigError(f"plugin '{name}' (type {type_}): " + "; ".join(problems)) from None
