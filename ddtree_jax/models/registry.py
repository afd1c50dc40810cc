"""From a checkpoint's ``config.json`` to the classes that build it, by its ``architectures`` field.

``load_target`` and ``load_drafter`` look the architecture up here, so a second model family is
one entry in ``TARGETS`` or ``DRAFTERS``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ddtree_jax.models.dflash import DFlashDrafter
from ddtree_jax.models.dflash_config import DFlashConfig
from ddtree_jax.models.kimi import KimiForCausalLM
from ddtree_jax.models.kimi_config import KimiConfig

__all__ = ["DRAFTERS", "TARGETS", "Architecture", "lookup_architecture"]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One supported architecture: its config class (``from_hf_dict``) and its model class."""

    name: str
    config_class: type
    model_class: type
    description: str


TARGETS = {
    "DeepseekV3ForCausalLM": Architecture("DeepseekV3ForCausalLM", KimiConfig, KimiForCausalLM,
                                          "Kimi K2 / DeepSeek-V3 (MLA + sigmoid-routed MoE)"),
}
DRAFTERS = {
    "DFlashDraftModel": Architecture("DFlashDraftModel", DFlashConfig, DFlashDrafter, "DFlash block drafter"),
}


def lookup_architecture(config: dict[str, Any], role: str, where: str) -> Architecture:
    """The ``Architecture`` for a ``config.json`` dict in ``role`` ("target" or "drafter").

    Raises ``ValueError`` naming ``where`` (the checkpoint path) when the field is missing or names
    an architecture of the other role or none we support.
    """
    table, other = (TARGETS, DRAFTERS) if role == "target" else (DRAFTERS, TARGETS)
    names = config.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    for name in names:
        if name in table:
            return table[name]
    expected = ", ".join(table)
    for name in names:
        if name in other:
            raise ValueError(f"{where}: config.json names a {other[name].description} ({name}), expected a {role} "
                             f"({expected})")
    if not names:
        raise ValueError(f"{where}: config.json has no 'architectures' field; expected a {role} ({expected})")
    raise ValueError(f"{where}: unsupported architecture {names} in config.json; supported {role}s: {expected}")
