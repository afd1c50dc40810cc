"""``quantization_config`` of compressed-tensors checkpoints (``quant_method: compressed-tensors``):
which modules hold INT4 ``pack-quantized`` weights, checked against what this package runs.

Supported (the scheme of Kimi K2 Thinking's published checkpoint): ``format: pack-quantized``,
``quantization_status: compressed``; config groups whose ``weights`` are 4-bit ``int``,
``strategy: group`` with a ``group_size`` that is a multiple of 8, symmetric or not (zero
points), static (``dynamic: false``), without activation quantization, and whose ``targets``
(minus ``ignore``) select exactly the routed experts' projections
(``model.layers.L.mlp.experts.J.{gate,up,down}_proj``) of every MoE layer, all under one scheme.
Anything else raises ``CheckpointError`` naming the field.

Module matching follows compressed-tensors: a target or ignore entry is ``"Linear"`` (every
linear module: the attention projections, the dense and shared MLPs, the routed experts and the
LM head; not the router, norms or embedding), ``"re:<regex>"`` (``re.match`` on the module name)
or a module name.
"""

from __future__ import annotations

import re
from typing import Any

from ddtree_jax.models.int4 import Int4Format

__all__ = ["KIMI_K2_THINKING_IGNORE", "QuantConfigError", "int4_experts_format", "int4_quantization_config"]

# What Kimi K2 Thinking's config.json ignores (its targets: ["Linear"]): everything but the
# routed experts.
KIMI_K2_THINKING_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                           r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]

_TOP_FIELDS = {"quant_method", "format", "quantization_status", "config_groups", "ignore", "kv_cache_scheme",
               "sparsity_config", "transform_config", "global_compression_ratio", "moe_sparsity_config", "version"}
_SCHEME_FIELDS = {"targets", "weights", "input_activations", "output_activations", "format"}
_WEIGHT_FIELDS = {"num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic",
                  "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}
_FORMAT = "pack-quantized"


class QuantConfigError(ValueError):
    """An unsupported or inconsistent ``quantization_config``: the message names the field."""


def _field(path: str, message: str) -> QuantConfigError:
    return QuantConfigError(f"quantization_config.{path}: {message}")


def _empty(value) -> bool:
    return value is None or value == {} or value == []


def _matches(module: str, linear: bool, entry: str, field: str) -> bool:
    if entry.startswith("re:"):
        try:
            return re.match(entry[3:], module) is not None
        except re.error as e:
            raise _field(field, f"{entry!r} is not a valid regular expression ({e})") from None
    return entry == module or (entry == "Linear" and linear)


def _check_entries(entries, field: str, modules: dict[str, str], *, known: bool = True) -> list[str]:
    """``entries`` (targets or ignore) as a list; with ``known``, each must be ``"Linear"``, a
    ``"re:"`` pattern or a module name of the model (an ignore entry may name a module the model
    does not have: it ignores nothing)."""
    if not isinstance(entries, list) or not all(isinstance(t, str) for t in entries):
        raise _field(field, f"expected a list of strings, got {entries!r}")
    for t in entries:
        if known and t != "Linear" and not t.startswith("re:") and t not in modules:
            raise _field(field, f"{t!r} is neither 'Linear', a 're:' pattern nor a module of this model "
                         "(other module classes are not supported)")
    return entries


def _check_weights(args: Any, field: str) -> Int4Format:
    if not isinstance(args, dict):
        raise _field(field, f"expected the weights' quantization arguments, got {args!r}")
    unknown = sorted(set(args) - _WEIGHT_FIELDS)
    if unknown:
        raise _field(f"{field}.{unknown[0]}", "unknown field (not supported)")

    def want(name, ok, expected, default=None):
        value = args.get(name, default)
        if not ok(value):
            raise _field(f"{field}.{name}", f"{value!r} is not supported (supported: {expected})")
        return value

    want("num_bits", lambda v: v == 4, "4")
    want("type", lambda v: str(v).lower() == "int", "'int'", "int")
    want("strategy", lambda v: str(v).lower() == "group", "'group'")
    group = want("group_size", lambda v: isinstance(v, int) and v > 0 and v % 8 == 0, "a positive multiple of 8")
    want("block_structure", lambda v: v is None, "null")
    want("dynamic", lambda v: v is False, "false (static scales)", False)
    want("actorder", lambda v: v in (None, False, "weight", "static"),
         "null, 'weight' or 'static' (no g_idx permutation)")
    want("scale_dtype", lambda v: v is None or str(v).removeprefix("torch.") in ("bfloat16", "float16", "float32"),
         "null or a float dtype")
    want("zp_dtype", lambda v: v is None or str(v).removeprefix("torch.") == "int8", "null or int8")
    symmetric = want("symmetric", lambda v: isinstance(v, bool), "true or false", True)
    return Int4Format(group_size=group, symmetric=symmetric)


def int4_experts_format(qc: dict[str, Any], modules: dict[str, str]) -> Int4Format | None:
    """The ``Int4Format`` of the routed experts that the compressed-tensors ``quantization_config``
    ``qc`` describes (None if it quantizes no module of the model).

    ``modules``: every module name of the model -> ``"expert"`` (a routed expert's projection),
    ``"linear"`` (another linear module) or ``"other"`` (router, norms, embedding). Raises
    ``QuantConfigError`` naming the field for anything unsupported.
    """
    unknown = sorted(set(qc) - _TOP_FIELDS)
    if unknown:
        raise _field(unknown[0], "unknown field (not supported)")
    if qc.get("format", _FORMAT) != _FORMAT:
        raise _field("format", f"{qc['format']!r} is not supported (supported: {_FORMAT!r})")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise _field("quantization_status", f"{qc['quantization_status']!r} is not supported (supported: "
                     "'compressed': packed weights)")
    for name in ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config"):
        if not _empty(qc.get(name)):
            raise _field(name, "not supported (must be null)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _field("config_groups", f"expected a non-empty mapping of schemes, got {groups!r}")
    ignore = _check_entries(qc.get("ignore") or [], "ignore", modules, known=False)

    chosen: dict[str, str] = {}  # module -> config group
    formats: dict[str, Int4Format] = {}
    for gname, scheme in groups.items():
        where = f"config_groups.{gname}"
        if not isinstance(scheme, dict):
            raise _field(where, f"expected a scheme (targets, weights, ...), got {scheme!r} (preset names "
                         "are not supported)")
        unknown = sorted(set(scheme) - _SCHEME_FIELDS)
        if unknown:
            raise _field(f"{where}.{unknown[0]}", "unknown field (not supported)")
        if scheme.get("format", _FORMAT) not in (None, _FORMAT):
            raise _field(f"{where}.format", f"{scheme['format']!r} is not supported (supported: {_FORMAT!r})")
        for name in ("input_activations", "output_activations"):
            if scheme.get(name) is not None:
                raise _field(f"{where}.{name}", "activation quantization is not supported (must be null: W4A16)")
        if scheme.get("weights") is None:
            raise _field(f"{where}.weights", "missing (a scheme without weight quantization is not supported)")
        formats[gname] = _check_weights(scheme["weights"], f"{where}.weights")
        targets = _check_entries(scheme.get("targets"), f"{where}.targets", modules)
        for module, kind in modules.items():
            linear = kind != "other"
            if not any(_matches(module, linear, t, f"{where}.targets") for t in targets):
                continue
            if any(_matches(module, linear, t, "ignore") for t in ignore):
                continue
            if module in chosen:
                raise _field(f"{where}.targets", f"module {module!r} is also targeted by config_groups."
                             f"{chosen[module]} (one scheme per module)")
            if kind != "expert":
                raise _field(f"{where}.targets", f"quantizes {module!r}; only the routed experts "
                             "(mlp.experts.J.gate_proj/up_proj/down_proj) can be INT4 here (add it to ignore)")
            chosen[module] = gname
    if not chosen:
        return None
    experts = [m for m, kind in modules.items() if kind == "expert"]
    missing = [m for m in experts if m not in chosen]
    if missing:
        raise _field("ignore", f"leaves {len(missing)} routed expert projection(s) unquantized (e.g. "
                     f"{missing[0]!r}) while others are INT4; all routed experts must be quantized alike")
    used = sorted(set(chosen.values()))
    if len({formats[g] for g in used}) > 1:
        raise _field("config_groups", f"the routed experts are split over groups {used} with different "
                     "weights schemes; they must share one")
    return formats[used[0]]


def int4_quantization_config(fmt: Int4Format) -> dict[str, Any]:
    """The ``quantization_config`` that ``save_checkpoint`` writes for INT4 routed experts: one
    group, Kimi K2 Thinking's targets and ignore list, ``fmt``'s group size and symmetry."""
    weights = {"num_bits": 4, "type": "int", "symmetric": fmt.symmetric, "strategy": "group",
               "group_size": fmt.group_size, "block_structure": None, "dynamic": False, "actorder": None,
               "observer": "minmax", "observer_kwargs": {}}
    return {
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": _FORMAT}},
        "format": _FORMAT,
        "ignore": list(KIMI_K2_THINKING_IGNORE),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }
