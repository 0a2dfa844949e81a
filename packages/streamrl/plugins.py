"""Loading the user's code: `package.module:Name` import paths and entry points.

A reference names either an object by import path (`wordgame.task:WordGame`, the module
imported, then the attribute looked up, dots descending into it) or, without a colon, a name
registered by an installed package in an entry-point group (`[project.entry-points.
"streamrl.tasks"] wordgame = "wordgame.task:WordGame"`). Every failure is a `PluginError`
that names the reference, the config field it came from and what is missing, so a run that
points at code that is not there stops at start, with the field named, as a bad config does.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Mapping

from pydantic import BaseModel, ValidationError

from streamrl.config import ConfigError
from streamrl.errors import FatalError

TASKS_GROUP = "streamrl.tasks"


class PluginError(ConfigError, FatalError):
    """A plug-in that cannot be loaded or whose options do not validate. `streamrl up`
    checks every plug-in before it starts a worker (exit 2); in a worker started alone
    (compose) it is fatal, since restarting cannot fix it."""


def load_object(ref: str, field: str) -> object:
    """The object at `package.module:Name` (Name may be dotted: `Class.attr`)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise PluginError(f"field `{field}`: `{ref}` is not an import path `package.module:Name`")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise PluginError(
            f"field `{field}`: cannot import `{module_name}` for `{ref}`: no module named "
            f"`{err.name}` (is the package installed in this environment?)"
        ) from None
    except Exception as err:
        raise PluginError(
            f"field `{field}`: importing `{module_name}` for `{ref}` failed: "
            f"{type(err).__name__}: {err}"
        ) from err
    obj: object = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(
                f"field `{field}`: `{ref}`: module `{module_name}` has no attribute `{attr}`"
            ) from None
    return obj


def entry_points(group: str) -> dict[str, str]:
    """Name -> import path of the entry points installed packages register in `group`."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=group)}


def resolve_ref(ref: str, field: str, builtin: dict[str, str], group: str | None) -> str:
    """The import path a reference stands for: itself when it has a colon, else a built-in
    name, else an entry point of `group`."""
    if ":" in ref:
        return ref
    if ref in builtin:
        return builtin[ref]
    registered = entry_points(group) if group else {}
    if ref in registered:
        return registered[ref]
    known = sorted({*builtin, *registered})
    raise PluginError(
        f"field `{field}`: unknown name `{ref}`; known: {known}, or an import path "
        "`package.module:Name`"
    )


def validate_options(model: type[BaseModel], data: Mapping[str, object], field: str) -> BaseModel:
    """`data` validated by the plug-in's options model; errors name `field.key`."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            loc = ".".join([field, *(str(p) for p in e["loc"])])
            if e["type"] == "extra_forbidden":
                lines.append(f"unknown key `{loc}`")
            else:
                lines.append(f"field `{loc}`: {e['msg']}")
        raise PluginError("invalid plug-in options:\n  " + "\n  ".join(lines)) from None
