"""Load and save HF-format checkpoints (``config.json`` + safetensors) of the target and drafter.

Tensor names are those of published checkpoints: ``DeepseekV3ForCausalLM`` (``model.layers.N.
self_attn.q_a_proj.weight``, ``model.layers.N.mlp.experts.E.gate_proj.weight``, ...) and DFlash
drafters (``layers.N.self_attn.q_proj.weight``, ``fc.weight``, ``hidden_norm.weight``,
``norm.weight``). The fused expert tensors ``mlp.experts.gate_up_proj [E, 2I, H]`` /
``mlp.experts.down_proj [E, H, I]`` of transformers 5's in-memory layout load too. Tensors of MTP
layers (``model.layers.N`` with N >= num_hidden_layers) are skipped. FP8 (e4m3) weights with a
``weight_scale_inv`` per 128x128 block (``quantization_config.weight_block_size``) are dequantised.

INT4 routed experts (compressed-tensors ``pack-quantized``, as in Kimi K2 Thinking: per expert
projection ``weight_packed`` int32 ``[out, in/8]``, ``weight_scale`` ``[out, in/G]``,
``weight_shape``, and ``weight_zero_point`` when asymmetric; ``ddtree_jax.quant_config`` checks
the ``quantization_config``): loaded packed, never dequantised (``ddtree_jax.models.int4``: each
expert's words and scales transposed to the model's ``[in, out]`` orientation and stacked), with
the shardings of the dense expert weights; ``save_checkpoint`` writes them back in that format.

Loading streams tensor by tensor from memory-mapped files: each parameter is assembled on the host
(routed experts: one stacked ``[E, ...]`` parameter at a time) and placed at once with its
sharding. Sharding: every parameter declares logical axes next to its definition
(``ddtree_jax/models/_layers.py``); ``mesh_axes`` maps logical names to mesh axis names
(default ``{"expert": "expert", "tensor": "tensor"}``); a logical axis whose mesh axis is absent,
or that does not divide the dimension, is replicated. The mesh must have ``AxisType.Auto`` axes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ddtree_jax._safetensors import SafetensorsError, read_header, read_index
from ddtree_jax.backend import Backend
from ddtree_jax.config import ExecutionConfig, execution_of
from ddtree_jax.mesh_axes import DEFAULT_MESH_AXES
from ddtree_jax.models.int4 import Int4Format, pack_int4, unpack_int4_np
from ddtree_jax.models.registry import lookup_architecture
from ddtree_jax.quant_config import QuantConfigError, int4_experts_format, int4_quantization_config

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint does not match the model, or a file of it is unreadable, truncated or corrupt:
    the message names the file or the tensor."""


class _SafetensorsFile:
    """Memory-mapped safetensors reader (safetensors' numpy backend cannot return float8). The
    header is checked against the file on opening (``ddtree_jax._safetensors.read_header``: dtypes,
    shapes, offsets inside the file), so ``get`` cannot read past the data; ``CheckpointError``
    naming the file and the tensor otherwise."""

    def __init__(self, path: str):
        try:
            header = read_header(path)
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from None
        self.path, self.header = path, header.tensors
        self._data = (np.memmap(path, np.uint8, "r", offset=header.data_start) if header.data_bytes
                      else np.zeros((0,), np.uint8))

    def names(self) -> list[str]:
        return list(self.header)

    def get(self, name: str) -> np.ndarray:
        info = self.header.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: has no tensor {name!r}")
        begin, end = info["data_offsets"]
        return np.array(self._data[begin:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"]))


def _checkpoint_files(path: str) -> dict[str, _SafetensorsFile]:
    """Map every tensor name of the checkpoint at directory ``path`` to its opened (and checked)
    safetensors file. With ``model.safetensors.index.json``, every shard it names must exist and
    hold the tensors it assigns to that shard."""
    if os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        try:
            weight_map = read_index(path)
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from None
        readers = {f: _SafetensorsFile(os.path.join(path, f)) for f in sorted(set(weight_map.values()))}
        for name, f in sorted(weight_map.items()):
            if name not in readers[f].header:
                raise CheckpointError(f"{readers[f].path}: has no tensor {name!r}, which "
                                      "model.safetensors.index.json places in it")
        return {name: readers[f] for name, f in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    readers = [_SafetensorsFile(os.path.join(path, f)) for f in files]
    return {name: r for r in readers for name in r.names()}


@dataclasses.dataclass
class _Dest:
    """One model parameter being assembled from one or more checkpoint tensors."""

    var: nnx.Variable
    pending: set[str]
    buffer: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class _Part:
    """Checkpoint tensor ``[hf_shape]`` -> ``dest.buffer[index] = transpose(decode(tensor))``.

    ``dest`` None: a tensor that only describes others (INT4 ``weight_shape``): on load it must
    equal ``value``, on save it is ``value``. ``file_dtype``: the tensor's dtype when it is not
    the parameter's (int32 words)."""

    dest: _Dest | None
    hf_shape: tuple[int, ...]
    index: tuple[Any, ...]
    axes: tuple[int, ...]
    covers: tuple[str, ...]
    decode: Callable[[np.ndarray], np.ndarray] | None = None
    encode: Callable[[np.ndarray], np.ndarray] | None = None
    file_dtype: Any = None
    value: tuple[int, ...] | None = None

    def nbytes(self) -> int:
        dtype = np.dtype(self.file_dtype or self.dest.var.dtype)
        return int(np.prod(self.hf_shape)) * dtype.itemsize


_INT4_LEAVES = {f"{w}_{kind}": (w, kind) for w in ("gate_up_proj", "down_proj")
                for kind in ("packed", "scale", "zero_point")}


def _int4_expert_parts(parts: dict[str, _Part], name: str, leaf: str, var: nnx.Variable,
                       dests: dict[str, _Dest]) -> None:
    """Per-expert checkpoint names of one packed expert parameter (``Experts`` with ``int4``):
    ``{name}.{i}.{proj}.weight_packed`` ``[out, in/8]`` / ``weight_scale`` ``[out, in/G]`` /
    ``weight_zero_point`` ``[ceil(out/8), in/G]`` (packed along ``out``), and ``weight_shape``."""
    weight, kind = _INT4_LEAVES[leaf]
    e, rows, d_out = var.shape  # rows: in/8 or in/G
    projs = ("gate", "up") if weight == "gate_up_proj" else ("down",)
    out = d_out // len(projs)
    per = {}
    for i in range(e):
        for j, proj in enumerate(projs):
            module = f"{name}.{i}.{proj}_proj"
            per[f"{module}.weight_{kind}"] = (i, slice(None), slice(j * out, (j + 1) * out))
            if kind == "packed":
                parts[f"{module}.weight_shape"] = _Part(None, (2,), (), (0,), (), value=(out, rows * 8),
                                                        file_dtype=np.int64)
    dest = dests.setdefault(f"{name}.{leaf}", _Dest(var, set(per)))
    for n, idx in per.items():
        if kind == "zero_point":
            parts[n] = _Part(dest, (-(-out // 8), rows), idx, (1, 0), (n,), file_dtype=np.int32,
                             decode=lambda t, out=out: unpack_int4_np(t.T, out).T,
                             encode=lambda v: np.ascontiguousarray(pack_int4(v.T).T))
        else:
            parts[n] = _Part(dest, (out, rows), idx, (1, 0), (n,), file_dtype=np.int32 if kind == "packed" else None)


def _hf_parts(model: nnx.Module) -> dict[str, _Part]:
    """Every checkpoint tensor name the model reads, derived from its parameter paths."""
    parts: dict[str, _Part] = {}
    dests: dict[str, _Dest] = {}
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param):
            continue
        name, leaf = ".".join(map(str, path[:-1])), path[-1]
        shape = tuple(var.shape)
        if leaf in _INT4_LEAVES and len(shape) == 3:  # stacked INT4 routed experts
            _int4_expert_parts(parts, name, leaf, var, dests)
        elif leaf in ("gate_up_proj", "down_proj") and len(shape) == 3:  # stacked routed experts
            e, d_in, d_out = shape
            if leaf == "gate_up_proj":
                half = d_out // 2
                per = {
                    f"{name}.{i}.{w}_proj.weight": (i, slice(None), slice(j * half, (j + 1) * half))
                    for i in range(e)
                    for j, w in enumerate(("gate", "up"))
                }
                fused_shape, piece = (e, d_out, d_in), (half, d_in)
            else:
                per = {f"{name}.{i}.down_proj.weight": (i,) for i in range(e)}
                fused_shape, piece = (e, d_out, d_in), (d_out, d_in)
            dest = _Dest(var, set(per))
            for n, idx in per.items():
                parts[n] = _Part(dest, piece, idx, (1, 0), (n,))
            parts[f"{name}.{leaf}"] = _Part(dest, fused_shape, (), (0, 2, 1), tuple(per))
        elif leaf == "kernel":
            n = f"{name}.weight"
            parts[n] = _Part(_Dest(var, {n}), shape[::-1], (), (1, 0), (n,))
        else:
            n = f"{name}.{leaf}"
            parts[n] = _Part(_Dest(var, {n}), shape, (), tuple(range(len(shape))), (n,))
    return parts


def _modules(model: nnx.Module) -> dict[str, str]:
    """Every module name of ``model`` (HF naming) -> ``"expert"`` (a routed expert's projection),
    ``"linear"`` (another torch ``Linear`` in HF's model) or ``"other"``: what compressed-tensors'
    targets match."""
    modules = {}
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param):
            continue
        name, leaf = ".".join(map(str, path[:-1])), path[-1]
        if leaf in ("gate_up_proj", "down_proj") or leaf in _INT4_LEAVES:
            projs = ("gate", "up") if leaf.startswith("gate_up_proj") else ("down",)
            modules.update({f"{name}.{i}.{p}_proj": "expert" for i in range(var.shape[0]) for p in projs})
        else:
            modules[name] = "linear" if leaf == "kernel" else "other"
    return modules


def _int4_format(raw: dict[str, Any], model: nnx.Module, path: str) -> Int4Format | None:
    """The INT4 format of the routed experts that config.json's compressed-tensors
    ``quantization_config`` gives (None: no such config, or it quantizes nothing)."""
    qc = raw.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return None
    try:
        fmt = int4_experts_format(qc, _modules(model))
        if fmt is not None:
            cfg = model.config
            try:
                fmt.check(cfg.hidden_size, cfg.moe_intermediate_size)
            except ValueError as e:
                raise QuantConfigError(f"quantization_config.config_groups.*.weights.group_size: {e}") from None
    except QuantConfigError as e:
        raise CheckpointError(f"{path}: config.json {e}") from None
    return fmt


def _dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """``weight [out, in]`` e4m3 times its per-``block`` ``scale_inv [ceil(out/bo), ceil(in/bi)]``."""
    out, inp = weight.shape
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], 0), block[1], 1)[:out, :inp]
    return weight.astype(np.float32) * scale


def _sharding(var: nnx.Variable, mesh: Mesh | None, mesh_axes: dict[str, str]):
    if mesh is None:
        return None
    if any(t != AxisType.Auto for t in mesh.axis_types):
        raise ValueError(
            "load_*: the mesh needs Auto axes (the models leave layouts to the compiler): "
            "jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))"
        )
    axes = var.get_metadata().get("axes", (None,) * len(var.shape))
    return NamedSharding(mesh, PartitionSpec(*partition_spec(var.shape, axes, mesh.shape, mesh_axes)))


def partition_spec(shape: tuple[int, ...], axes: tuple[str | None, ...], mesh_sizes: Mapping[str, int],
                   mesh_axes: dict[str, str] = DEFAULT_MESH_AXES) -> tuple[str | None, ...]:
    """Where a parameter of ``shape`` whose dims have the logical ``axes`` lives on a mesh of
    ``mesh_sizes`` (mesh axis name -> size): per dim, the mesh axis ``mesh_axes`` maps its logical
    axis to when the mesh has that axis and its size divides the dim, else ``None`` (replicated).
    Dims past ``axes`` are replicated and not listed. Every placement of weights uses this rule (``_sharding``;
    ``ddtree_jax.planner`` counts per-device bytes with it)."""
    spec = []
    for dim, logical in zip(shape, axes, strict=False):
        axis = mesh_axes.get(logical) if logical else None
        spec.append(axis if axis in mesh_sizes and dim % mesh_sizes[axis] == 0 else None)
    return tuple(spec)


def init_on_mesh(factory: Callable[[], nnx.Module], mesh: Mesh | None = None, *,
                 mesh_axes: dict[str, str] = DEFAULT_MESH_AXES) -> nnx.Module:
    """``factory()`` (a model constructor call, e.g. ``lambda: KimiForCausalLM(cfg, rngs=nnx.Rngs(0))``)
    with its parameters created by one compiled call straight into the shardings their logical
    axes give on ``mesh`` (``None``: the default device), so a model larger than one device never
    exists whole anywhere. The values do not depend on ``mesh`` (partitionable random bits): the
    same factory gives the same weights on one device and on any mesh."""
    graphdef, abstract = nnx.split(nnx.eval_shape(factory))
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    shardings = (None if mesh is None
                 else jax.tree.map(lambda v: _sharding(v, mesh, mesh_axes), abstract, is_leaf=is_var))
    state = jax.jit(lambda: nnx.split(factory())[1], out_shardings=shardings)()
    model = nnx.merge(graphdef, state)
    _tell_placement(model, mesh, mesh_axes)
    return model


def _tell_placement(model: nnx.Module, mesh: Mesh | None, mesh_axes: dict[str, str]) -> None:
    """A model with sharded kernel paths (``KimiForCausalLM``) learns the mesh its weights were
    just placed on."""
    if mesh is not None and hasattr(model, "_learn_placement"):
        model._learn_placement(mesh, mesh_axes)


def _load_into(
    model: nnx.Module,
    path: str,
    *,
    skip: Callable[[str], bool],
    fp8_block: tuple[int, int],
    mesh: Mesh | None,
    mesh_axes: dict[str, str],
) -> None:
    """Stream every tensor of the checkpoint at ``path`` into the abstract ``model``'s parameters."""
    parts = _hf_parts(model)
    files = _checkpoint_files(path)

    def read(name):
        return files[name].get(name)

    for name in sorted(files, key=lambda n: (files[n].path, n)):
        if name.endswith(".weight_scale_inv") and name[: -len("_scale_inv")] in parts:
            continue  # read together with its weight
        if skip(name):
            continue
        part = parts.get(name)
        if part is None:
            raise CheckpointError(f"unexpected tensor {name!r} in {path}: {_why_unexpected(name, parts)}")
        dest = part.dest
        tensor = read(name)
        if dest is None:  # INT4 weight_shape: must describe the tensors the model expects
            if tensor.shape != part.hf_shape or tuple(int(v) for v in tensor) != part.value:
                raise CheckpointError(f"tensor {name!r} is {tensor.tolist()}, expected {list(part.value)}")
            continue
        if not dest.pending.issuperset(part.covers):
            raise CheckpointError(f"tensor {name!r} supplies values already loaded (duplicate tensor?)")
        if part.file_dtype is not None and tensor.dtype != np.dtype(part.file_dtype):
            raise CheckpointError(f"tensor {name!r} has dtype {tensor.dtype}, expected {np.dtype(part.file_dtype)}")
        if tensor.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
            scale_name = name + "_scale_inv"
            if scale_name not in files:
                raise CheckpointError(f"FP8 tensor {name!r} has no {scale_name!r}")
            scale = read(scale_name)
            blocks = tuple(-(-d // b) for d, b in zip(tensor.shape, fp8_block, strict=False))
            if tensor.ndim != 2 or scale.shape != blocks:
                raise CheckpointError(
                    f"{scale_name!r} has shape {scale.shape}, expected {blocks} for "
                    f"{fp8_block} blocks of {name!r} {tensor.shape}"
                )
            tensor = _dequantize_fp8(tensor, scale, fp8_block)
        if tuple(tensor.shape) != part.hf_shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {part.hf_shape}")
        if part.decode is not None:
            tensor = part.decode(tensor)
        value = np.transpose(tensor, part.axes).astype(dest.var.dtype)
        if dest.buffer is None and len(dest.pending) == len(part.covers):
            dest.buffer = value  # the whole parameter in one tensor
        else:
            if dest.buffer is None:
                dest.buffer = np.zeros(dest.var.shape, dest.var.dtype)
            dest.buffer[part.index] = value
        dest.pending.difference_update(part.covers)
        if not dest.pending:
            sharding = _sharding(dest.var, mesh, mesh_axes)
            dest.var.set_value(jax.device_put(dest.buffer, sharding) if sharding else jnp.asarray(dest.buffer))
            dest.buffer = None
    missing = sorted({n for part in parts.values() if part.dest is not None for n in part.dest.pending})
    if missing:
        shown = ", ".join(repr(n) for n in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise CheckpointError(f"{len(missing)} tensor(s) missing from {path}: {shown}")


def _why_unexpected(name: str, parts: dict[str, _Part]) -> str:
    module, _, tensor = name.rpartition(".")
    if tensor == "weight" and f"{module}.weight_packed" in parts:
        return ("config.json's quantization_config makes this module INT4 (weight_packed, weight_scale expected), "
                "but the checkpoint holds a dense weight")
    if tensor.startswith("weight_") and f"{module}.weight" in parts:
        return (f"a quantized tensor ({tensor}) of a module that config.json's quantization_config leaves dense "
                "(only routed experts can be INT4, with a compressed-tensors pack-quantized quantization_config)")
    return "the model has no such parameter"


def _read_config(path: str) -> dict[str, Any]:
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise CheckpointError(f"{path}: no config.json (expected an HF checkpoint directory)")
    try:
        with open(config, "rb") as f:
            raw = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise CheckpointError(f"{config}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{config}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config}: holds a JSON {type(raw).__name__}, expected an object")
    return raw


_DTYPE_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _resolve_dtype(dtype, raw: dict[str, Any], path: str):
    """``dtype="auto"``: the checkpoint's own (``dtype`` / ``torch_dtype`` in config.json, else its
    first floating-point tensor's; FP8 weights mean bfloat16), as transformers does."""
    if not (isinstance(dtype, str) and dtype == "auto"):
        return dtype
    name = raw.get("dtype") or raw.get("torch_dtype")
    if name is not None:
        name = str(name).removeprefix("torch.")
        if name not in _DTYPE_NAMES:
            raise CheckpointError(f"{path}: config.json dtype {name!r} is not one of {sorted(_DTYPE_NAMES)}")
        return _DTYPE_NAMES[name]
    files = _checkpoint_files(path)
    for name in sorted(files):
        info = files[name].header[name]
        if info["dtype"].startswith("F8"):
            return jnp.bfloat16
        if info["dtype"] in ("F32", "BF16", "F16"):
            return {"F32": jnp.float32, "BF16": jnp.bfloat16, "F16": jnp.float16}[info["dtype"]]
    return jnp.float32


def _fp8_block(raw: dict[str, Any]) -> tuple[int, int]:
    return tuple((raw.get("quantization_config") or {}).get("weight_block_size", (128, 128)))


def load_target(
    path: str,
    *,
    mesh: Mesh | None = None,
    dtype="auto",
    mesh_axes: dict[str, str] = DEFAULT_MESH_AXES,
    execution: ExecutionConfig | None = None,
    impl: str | Backend | None = None,
):
    """Load a target checkpoint directory; its class comes from ``architectures`` in config.json
    (``ddtree_jax.models.registry.TARGETS``: ``DeepseekV3ForCausalLM``, model type ``deepseek_v3``
    or ``kimi_k2``).

    ``dtype``: ``"auto"`` (the checkpoint's own, see ``_resolve_dtype``) or a JAX dtype; router
    weights stay float32. A compressed-tensors ``quantization_config`` with INT4 routed experts
    (the module docstring) gives a model whose experts stay packed (``experts_int4``; their scales
    in ``dtype``); anything it names that is not supported raises ``CheckpointError``. With
    ``mesh``, weights are placed with the shardings their logical axes give under ``mesh_axes``,
    and the model runs its kernels sharded accordingly. ``execution``: how the model computes
    (``ddtree_jax.config.ExecutionConfig``; default ``ExecutionConfig()``, whose ``impl`` "auto"
    runs the kernels on a GPU); ``impl=`` alone is shorthand for ``ExecutionConfig(impl=impl)``.
    """
    raw = _read_config(path)
    arch = lookup_architecture(raw, "target", path)
    cfg = arch.config_class.from_hf_dict(raw)
    dtype = _resolve_dtype(dtype, raw, path)
    execution = execution_of(execution, impl)
    model = nnx.eval_shape(lambda: arch.model_class(cfg, rngs=nnx.Rngs(0), dtype=dtype, execution=execution))
    int4 = _int4_format(raw, model, path)
    if int4 is not None:  # the same model with its routed experts packed
        model = nnx.eval_shape(lambda: arch.model_class(cfg, rngs=nnx.Rngs(0), dtype=dtype, execution=execution,
                                                        experts_int4=int4))
    mtp = re.compile(r"model\.layers\.(\d+)\.")

    def is_mtp(name):  # Multi-token-prediction layers follow the decoder layers; we do not run them.
        m = mtp.match(name)
        return m is not None and int(m.group(1)) >= cfg.num_hidden_layers

    _load_into(model, path, skip=is_mtp, fp8_block=_fp8_block(raw), mesh=mesh, mesh_axes=mesh_axes)
    _tell_placement(model, mesh, mesh_axes)
    return model


def load_drafter(
    path: str, target, *, mesh: Mesh | None = None, dtype=None, mesh_axes: dict[str, str] = DEFAULT_MESH_AXES,
    execution: ExecutionConfig | None = None,
):
    """Load a drafter checkpoint directory (``DRAFTERS`` in the registry: ``DFlashDraftModel``) for
    ``target``, whose embedding and LM head it uses.

    ``dtype`` defaults to the target's weight dtype (``"auto"``: the checkpoint's own). Checks that
    the drafter fits the target. ``execution``: how it computes (``ExecutionConfig``: its ``impl``
    and ``batch_invariant``; default ``ExecutionConfig()``).
    """
    raw = _read_config(path)
    arch = lookup_architecture(raw, "drafter", path)
    cfg = arch.config_class.from_hf_dict(raw)
    tcfg = target.config
    if cfg.num_target_layers != tcfg.num_hidden_layers:
        raise ValueError(
            f"DFlashConfig.num_target_layers={cfg.num_target_layers} but the target has {tcfg.num_hidden_layers} layers"
        )
    if cfg.hidden_size != tcfg.hidden_size:
        raise ValueError(f"DFlashConfig.hidden_size={cfg.hidden_size} differs from the target's {tcfg.hidden_size}")
    if not 0 <= cfg.mask_token_id < tcfg.vocab_size:
        raise ValueError(f"DFlashConfig.mask_token_id={cfg.mask_token_id} outside the target vocabulary")
    dtype = target.model.embed_tokens.weight.dtype if dtype is None else _resolve_dtype(dtype, raw, path)
    model = nnx.eval_shape(lambda: arch.model_class(cfg, rngs=nnx.Rngs(0), dtype=dtype, execution=execution))
    _load_into(model, path, skip=lambda name: False, fp8_block=_fp8_block(raw), mesh=mesh, mesh_axes=mesh_axes)
    _tell_placement(model, mesh, mesh_axes)
    return model if execution is None or not execution.batch_invariant else model.with_execution(execution)


def save_checkpoint(model, path: str, *, max_shard_bytes: int | None = None) -> None:
    """Write ``model`` as an HF checkpoint directory: ``config.json`` + safetensors, per-expert
    names as published checkpoints use, sharded with ``model.safetensors.index.json`` when the
    tensors exceed ``max_shard_bytes``. Arrays are written in their current dtype; INT4 routed
    experts (``experts_int4``) as compressed-tensors ``pack-quantized`` tensors with their
    ``quantization_config``."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    parts = _hf_parts(model)
    float_dtypes = {
        np.dtype(p.dest.var.dtype) for p in parts.values()
        if p.dest is not None and jnp.issubdtype(p.dest.var.dtype, jnp.floating)
    }
    # The checkpoint's dtype (what ``dtype="auto"`` loads): the weights' dtype; router weights stay
    # float32 in a bfloat16 model, so a mix means the narrower one.
    main_dtype = min(float_dtypes, key=lambda d: d.itemsize) if float_dtypes else np.dtype(np.float32)
    config = {**model.config.to_hf_dict(), "torch_dtype": main_dtype.name}
    if getattr(model, "experts_int4", None) is not None:
        config["quantization_config"] = int4_quantization_config(model.experts_int4)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    names = [n for n, part in parts.items() if len(part.covers) <= 1]  # per-expert names, not fused aliases
    sizes = {n: parts[n].nbytes() for n in names}
    groups: list[list[str]] = [[]]
    group_bytes = 0
    for n in names:
        if max_shard_bytes is not None and groups[-1] and group_bytes + sizes[n] > max_shard_bytes:
            groups.append([])
            group_bytes = 0
        groups[-1].append(n)
        group_bytes += sizes[n]

    host: dict[int, np.ndarray] = {}  # the current parameter on the host (a stacked one serves 2E names)

    def tensor(n):
        part = parts[n]
        if part.dest is None:
            return np.asarray(part.value, part.file_dtype)
        if id(part.dest) not in host:
            host.clear()
            host[id(part.dest)] = np.asarray(part.dest.var[...])
        value = np.ascontiguousarray(np.transpose(host[id(part.dest)][part.index], np.argsort(part.axes)))
        return value if part.encode is None else part.encode(value)

    if len(groups) == 1:
        save_file({n: tensor(n) for n in names}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, group in enumerate(groups):  # one shard in host memory at a time
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensor(n) for n in group}, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, f, indent=2)
