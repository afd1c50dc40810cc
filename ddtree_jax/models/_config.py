"""Config validation helper shared by the model configs."""

from __future__ import annotations


def require(ok: bool, config: object, field: str, message: str) -> None:
    """Raise ``ValueError("<ConfigClass>.<field>=<value>: <message>")`` unless ``ok``."""
    if not ok:
        value = getattr(config, field, None)
        raise ValueError(f"{type(config).__name__}.{field}={value!r}: {message}")
