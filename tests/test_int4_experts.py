"""INT4 routed experts (compressed-tensors ``pack-quantized``): the checkpoint format against the
``compressed-tensors`` package's own compression and decompression, the model with packed experts
against the same model with the dequantised weights, the W4A16 kernel (interpret mode) against its
reference, and the loader's errors for what it does not support."""

from __future__ import annotations

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from ddtree_jax.backend import Backend
from ddtree_jax.checkpoints import CheckpointError, load_target, save_checkpoint
from ddtree_jax.models.int4 import Int4Format, PackedWeight, dequantize, pack_int4, quantize_int4, unpack_int4
from ddtree_jax.models.moe import experts_reference, routed_experts
from ddtree_jax.quant_config import KIMI_K2_THINKING_IGNORE
from tests._model_fixtures import VOCAB, forward_uncached, tiny_kimi
from tests.test_moe_kernel import _tree_inputs, random_moe

KERNEL = Backend(kernels=True, interpret=True)
IDS = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 9)))
GROUP = 16
# the tiny target of these tests: 1 dense + 1 MoE layer, hidden 64 (4 groups), expert intermediate
# 48 (3 groups: an odd count), 8 experts, top-2
MODEL = dict(num_hidden_layers=2, moe_intermediate_size=48)


def _ct():
    """compressed-tensors' public pieces (imported late: it imports transformers)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    return BaseCompressor, unpack_from_int32, QuantizationArgs, QuantizationConfig, QuantizationScheme, \
        calculate_qparams


@pytest.fixture(scope="module")
def ct_checkpoints(tmp_path_factory):
    """``get(symmetric)`` -> ``_ct_checkpoint``'s result, built once per module and scheme."""
    cache = {}

    def get(symmetric: bool):
        if symmetric not in cache:
            cache[symmetric] = _ct_checkpoint(symmetric, tmp_path_factory.mktemp("ct"))
        return cache[symmetric]

    return get


def _ct_checkpoint(symmetric: bool, root):
    """A tiny target whose routed experts compressed-tensors quantized (min-max scales in bf16, its
    ``pack-quantized`` compressor), written with its own ``quantization_config`` (``path/int4``);
    the same target with its decompressed experts as dense bf16 weights (``path/dense``); and, per
    expert projection, its compressed tensors and its decompression (bf16 ``[out, in]``)."""
    compressor_base, _, q_args, q_config, q_scheme, calculate_qparams = _ct()
    args = q_args(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=GROUP)
    scheme = q_scheme(targets=["Linear"], weights=args)
    compressor = compressor_base.load_from_registry("pack-quantized")
    dense = tiny_kimi(5, **MODEL)
    path = root / "int4"
    save_checkpoint(dense, str(root / "dense"))
    tensors = load_file(os.path.join(root / "dense", "model.safetensors"))
    compressed, decompressed = {}, {}
    for name in [n for n in tensors if ".mlp.experts." in n]:
        w = tensors.pop(name).to(torch.bfloat16)
        grouped = w.reshape(w.shape[0], -1, GROUP)
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        module = name.removesuffix(".weight")
        out = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme)
        compressed[module] = out
        decompressed[module] = compressor.decompress(dict(out), scheme)["weight"]
        tensors.update({f"{module}.{k}": v.contiguous() for k, v in out.items()})
    path.mkdir()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    dense_tensors = load_file(os.path.join(root / "dense", "model.safetensors"))
    dense_tensors.update({f"{m}.weight": w.float().contiguous() for m, w in decompressed.items()})
    save_file(dense_tensors, os.path.join(root / "dense", "model.safetensors"))
    config = json.loads((root / "dense" / "config.json").read_text())
    qc = q_config(config_groups={"group_0": scheme}, format="pack-quantized", ignore=KIMI_K2_THINKING_IGNORE,
                  quantization_status="compressed").model_dump(mode="json")
    config["quantization_config"] = {**qc, "quant_method": "compressed-tensors"}
    (path / "config.json").write_text(json.dumps(config))
    return root, compressed, decompressed, symmetric


def _expert_weights(model, layer):
    """``{module name: bf16 [out, in]}`` of a model's routed experts (INT4 ones dequantised)."""
    gate_up, down = (np.asarray(dequantize(w) if isinstance(w, PackedWeight) else w, np.float32)
                     for w in model.model.layers[layer].mlp.experts.weights())
    half = gate_up.shape[2] // 2
    out = {}
    for e in range(gate_up.shape[0]):
        p = f"model.layers.{layer}.mlp.experts.{e}"
        out[f"{p}.gate_proj"], out[f"{p}.up_proj"] = gate_up[e, :, :half].T, gate_up[e, :, half:].T
        out[f"{p}.down_proj"] = down[e].T
    return out


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "asymmetric"])
def test_unpacking_and_dequantisation_equal_compressed_tensors(ct_checkpoints, symmetric, tmp_path):
    """Our unpacking of its words equals its ``unpack_from_int32``; the loaded (packed) model's
    dequantised experts equal its decompression bit for bit (bf16); the tensors stay packed in
    memory; save_checkpoint writes back exactly the tensors it wrote."""
    _, unpack_from_int32, *_ = _ct()
    root, compressed, decompressed, _ = ct_checkpoints(symmetric)
    model = load_target(str(root / "int4"), dtype=jnp.bfloat16)
    assert model.experts_int4 == Int4Format(GROUP, symmetric)
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj_packed.dtype == jnp.int32 and experts.gate_up_proj_packed.shape == (8, 64 // 8, 96)
    assert experts.down_proj_scale.dtype == jnp.bfloat16 and experts.down_proj_scale.shape == (8, 48 // GROUP, 64)
    assert not hasattr(experts, "gate_up_proj")  # no dense copy
    for module, out in compressed.items():
        ours = np.asarray(unpack_int4(jnp.asarray(out["weight_packed"].numpy().T)))
        theirs = unpack_from_int32(out["weight_packed"], 4, out["weight_shape"]).numpy()
        np.testing.assert_array_equal(ours.T, theirs, err_msg=module)
    for layer in (1,):
        for module, w in _expert_weights(model, layer).items():
            np.testing.assert_array_equal(w, decompressed[module].float().numpy(), err_msg=module)
    save_checkpoint(model, str(tmp_path))
    written = load_file(os.path.join(tmp_path, "model.safetensors"))
    for module, out in compressed.items():
        assert {k for k in written if k.startswith(module + ".")} == {f"{module}.{k}" for k in out}
        for k, v in out.items():
            assert torch.equal(written[f"{module}.{k}"], v), f"{module}.{k}"
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["config_groups"]["group_0"]["weights"]["group_size"] == GROUP


def test_int4_model_logits_equal_dequantised_bf16_model(ct_checkpoints):
    """The INT4 model (bf16, symmetric like Kimi K2 Thinking) == a bf16 model holding
    compressed-tensors' decompressed experts, bit for bit, on the plain-JAX path (which dequantises
    per call to the same bf16 values). (Through the kernel: the next test, in float32.)"""
    root, *_ = ct_checkpoints(True)
    int4 = load_target(str(root / "int4"), dtype=jnp.bfloat16, impl="reference")
    dense = load_target(str(root / "dense"), dtype=jnp.bfloat16, impl="reference")
    want = np.asarray(forward_uncached(dense, IDS)[0])
    np.testing.assert_array_equal(np.asarray(forward_uncached(int4, IDS)[0]), want)
    assert np.abs(want).max() > 0.1


def test_int4_model_runs_on_the_kernel_path(ct_checkpoints):
    """The INT4 model with impl="pallas": a tree verify with ``valid`` traces and lowers with the
    W4A16 kernel on the packed arrays (interpret mode; compiling the whole model is left out for
    time: the MoE layer's numbers through the kernel are checked below, the whole model's through
    the plain-JAX path above)."""
    root, *_ = ct_checkpoints(False)
    model = load_target(str(root / "int4"), dtype=jnp.bfloat16, impl="pallas")
    tokens, depths, mask, valid = _tree_inputs(2, 9, 1)
    graphdef, state = nnx.split(model)
    verify = jax.jit(lambda st, *a: nnx.merge(graphdef, st).verify(*a[:4], valid=a[4])[0])
    text = verify.lower(state, tokens, depths, mask, model.init_cache(2, 32), valid).as_text()
    assert text.count("call @moe_grouped_matmul_int4(") == 1  # the one MoE layer
    assert "call @moe_grouped_matmul(" not in text


def test_int4_moe_layer_through_kernel_equals_reference(ct_checkpoints):
    """The loaded INT4 model (float32, asymmetric) 's MoE layer: its router's choice for 18 random
    hidden states, its packed experts through the W4A16 kernel (interpret mode) == its own dense
    reference (``Experts.reference``: every expert dequantised and run on every token)."""
    root, *_ = ct_checkpoints(False)
    moe = load_target(str(root / "int4"), dtype=jnp.float32).model.layers[1].mlp
    rng = np.random.default_rng(2)
    h = jnp.asarray(rng.normal(size=(18, 64)), jnp.float32)
    valid = jnp.asarray(rng.random(18) > 0.2)
    weights, ids = moe.gate(h)
    want = moe.experts.reference(h, weights, ids, valid)
    got = _routed(h, *moe.experts.weights(), weights, ids, valid)  # the compilation of the next test
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6 * float(jnp.abs(want).max()), rtol=0)
    assert not np.asarray(got)[~np.asarray(valid)].any()


@functools.partial(jax.jit, static_argnames=("blocks",))
def _routed(x, gate_up, down, weights, ids, valid, blocks=None):
    return routed_experts(x, gate_up, down, weights, ids, backend=KERNEL, valid=valid, blocks=blocks)


def _routings(n, e, k, rng):
    """Routings of one shape (one compilation serves all): random with invalid tokens; only two
    experts used (the rest empty); every token's first copy to expert 3 (several row tiles of one
    expert); one valid token (a decode step's row tiles); no valid token."""
    randoms = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    few = np.stack([rng.permutation(k) for _ in range(n)])
    one = randoms.copy()
    one[:, 0] = 3
    one[:, 1:] = np.where(one[:, 1:] == 3, 4, one[:, 1:])
    all_valid = np.ones(n, bool)
    return [("random, 30% invalid", randoms, rng.random(n) >= 0.3), ("two experts used", few, all_valid),
            ("one expert, 2 tiles", one, all_valid), ("one valid token", randoms, np.arange(n) == 5),
            ("no valid token", randoms, np.zeros(n, bool))]


def test_kernel_equals_reference_float32():
    """The W4A16 kernel == the dense reference on the dequantised weights (float32, asymmetric:
    zero points on top of the symmetric path's offset): the tiny model's shapes (hidden 64 and
    intermediate 48 in groups of 16: 4 and 3 groups), 8 experts, several routings of one shape."""
    from pallas_kernels.triton.moe_grouped_matmul import choose_blocks

    n, e, k, h, i = 18, 8, 2, 64, 48
    rng = np.random.default_rng(11)
    x, gate_up, down, weights, _, _ = random_moe(1, n, e, k, h, i)
    fmt = Int4Format(16, symmetric=False)
    gate_up, down = quantize_int4(gate_up, fmt), quantize_int4(down, fmt)
    assert gate_up.zero is not None and gate_up.scale.shape == (e, 4, 2 * i) and down.scale.shape == (e, 3, h)
    assert np.asarray(gate_up.zero).min() < 0 < np.asarray(gate_up.zero).max()
    dense_gu, dense_dn = dequantize(gate_up), dequantize(down)
    for name, ids, valid in _routings(n, e, k, rng):
        ids, valid = jnp.asarray(ids, jnp.int32), jnp.asarray(valid)
        want = experts_reference(x, dense_gu, dense_dn, weights, ids, valid)
        got = _routed(x, gate_up, down, weights, ids, valid, blocks=choose_blocks(n * k, e, int4=True))
        scale = float(jnp.abs(want).max()) or 1.0
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6 * scale, rtol=0, err_msg=name)
        assert not np.asarray(got)[~np.asarray(valid)].any(), name  # invalid tokens: exactly zero


def test_kernel_bfloat16_within_rounding_of_float32_reference():
    """bf16 activations, symmetric INT4 with bf16 scales (the K2 Thinking scheme, group 32): within
    2% of the largest output of the float32 reference on the same dequantised weights (bf16
    weights and h between the launches, float32 sums)."""
    n, e, k, h, i = 40, 8, 2, 64, 32
    x, gate_up, down, weights, ids, valid = random_moe(5, n, e, k, h, i, dtype=jnp.bfloat16, invalid=0.2)
    fmt = Int4Format(32, symmetric=True)
    gate_up, down = quantize_int4(gate_up, fmt), quantize_int4(down, fmt)
    assert gate_up.scale.dtype == jnp.bfloat16 and gate_up.zero is None
    got = _routed(x, gate_up, down, weights, ids, valid)
    assert got.dtype == jnp.bfloat16
    want = np.asarray(experts_reference(x.astype(jnp.float32), dequantize(gate_up, jnp.float32),
                                        dequantize(down, jnp.float32), weights, ids, valid))
    got = np.asarray(got, np.float32)
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()
    assert not got[~np.asarray(valid)].any()


def test_kernel_lowers_to_triton():
    """Interpret mode skips the Triton lowering rules; lowering for CUDA (no GPU needed) runs them
    (int32 shifts and masks, the scale gathers), for both schemes and at K2's group size 32."""
    from pallas_kernels.triton.moe_grouped_matmul import MoEBlocks, max_row_tiles, moe_grouped_matmul_int4

    sd = jax.ShapeDtypeStruct
    e, h, i, r = 8, 256, 128, 10
    t = max_row_tiles(r, e, 16)
    for zero in (False, True):
        args = (sd((5, h), jnp.bfloat16), sd((e, h // 8, 2 * i), jnp.int32), sd((e, h // 32, 2 * i), jnp.bfloat16),
                sd((e, i // 8, h), jnp.int32), sd((e, i // 32, h), jnp.bfloat16), sd((r + 16,), jnp.int32),
                sd((r + 16,), jnp.float32), sd((t,), jnp.int32), sd((t,), jnp.int32), sd((t,), jnp.int32))
        zeros = dict(gate_up_zero=sd((e, h // 32, 2 * i), jnp.int8), down_zero=sd((e, i // 32, h), jnp.int8))
        fn = functools.partial(moe_grouped_matmul_int4, blocks=MoEBlocks())
        text = jax.jit(fn).trace(*args, **(zeros if zero else {})).lower(lowering_platforms=("cuda",)).as_text()
        assert "ddtree_moe_gate_up_int4" in text and "ddtree_moe_down_int4" in text
        # bf16 scales without zero points take the packed-bf16 PTX; with zero points, float32
        assert ("fma.rn.bf16x2" in text) == (not zero)


def test_pack_int4_round_trip_and_quantiser():
    rng = np.random.default_rng(3)
    q = rng.integers(-8, 8, (3, 5, 40)).astype(np.int8)
    packed = pack_int4(q)
    assert packed.dtype == np.int32 and packed.shape == (3, 5, 5)
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed.swapaxes(1, 2)))).swapaxes(1, 2), q)
    with pytest.raises(ValueError, match="outside"):
        pack_int4(np.array([8]))
    w = rng.normal(size=(2, 32, 24)).astype(np.float32)
    for symmetric in (True, False):
        pw = quantize_int4(w, Int4Format(16, symmetric))
        err = np.abs(np.asarray(dequantize(pw)) - w).max(axis=1)  # per (expert, column)
        assert (err <= np.asarray(pw.scale).max(axis=1) * 0.5 + 1e-6).all()  # round to nearest: half a step


# ---- loader errors: one per unsupported field, each message naming it ----

def _edit(key, value):
    def edit(qc):
        target = qc
        *path, last = key.split(".")
        for p in path:
            target = target[p]
        target[last] = value
    return edit


QC_ERRORS = [
    (_edit("format", "int-quantized"), "quantization_config.format"),
    (_edit("quantization_status", "frozen"), "quantization_config.quantization_status"),
    (_edit("kv_cache_scheme", {"num_bits": 8, "type": "float"}), "quantization_config.kv_cache_scheme"),
    (_edit("sparsity_config", {"format": "sparse-24-bitmask"}), "quantization_config.sparsity_config"),
    (_edit("transform_config", {"config_groups": {}}), "quantization_config.transform_config"),
    (_edit("some_new_field", 1), "quantization_config.some_new_field"),
    (_edit("config_groups", {}), "quantization_config.config_groups"),
    (_edit("config_groups.group_0", ["Linear"]), "quantization_config.config_groups.group_0"),
    (_edit("config_groups.group_0.format", "nvfp4-pack-quantized"), "config_groups.group_0.format"),
    (_edit("config_groups.group_0.input_activations", {"num_bits": 8, "type": "int", "strategy": "token",
                                                       "dynamic": True}), "group_0.input_activations"),
    (_edit("config_groups.group_0.output_activations", {"num_bits": 8}), "group_0.output_activations"),
    (_edit("config_groups.group_0.weights", None), "group_0.weights"),
    (_edit("config_groups.group_0.weights.num_bits", 8), "group_0.weights.num_bits"),
    (_edit("config_groups.group_0.weights.type", "float"), "group_0.weights.type"),
    (_edit("config_groups.group_0.weights.strategy", "channel"), "group_0.weights.strategy"),
    (_edit("config_groups.group_0.weights.group_size", 12), "group_0.weights.group_size"),
    (_edit("config_groups.group_0.weights.group_size", 64), "weights.group_size"),  # does not divide I=48
    (_edit("config_groups.group_0.weights.dynamic", True), "group_0.weights.dynamic"),
    (_edit("config_groups.group_0.weights.actorder", "group"), "group_0.weights.actorder"),
    (_edit("config_groups.group_0.weights.block_structure", [128, 128]), "group_0.weights.block_structure"),
    (_edit("config_groups.group_0.weights.scale_dtype", "torch.float8_e4m3fn"), "group_0.weights.scale_dtype"),
    (_edit("config_groups.group_0.weights.zp_dtype", "torch.float8_e4m3fn"), "group_0.weights.zp_dtype"),
    (_edit("config_groups.group_0.weights.global_scale", 1.0), "group_0.weights.global_scale"),
    (_edit("config_groups.group_0.targets", ["Embedding"]), "group_0.targets"),
    (_edit("config_groups.group_0.targets", ["re:(unclosed"]), "group_0.targets"),
    (_edit("ignore", ["lm_head", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]),
     "group_0.targets: quantizes 'model.layers.0.self_attn"),  # attention would be INT4
    (_edit("ignore", KIMI_K2_THINKING_IGNORE + [r"re:.*experts\.0\..*"]), "quantization_config.ignore"),
]


@pytest.fixture(scope="module")
def error_dir(ct_checkpoints, tmp_path_factory):
    """A directory with the symmetric INT4 checkpoint's tensors and a config.json to edit."""
    root, *_ = ct_checkpoints(True)
    path = tmp_path_factory.mktemp("errors")
    os.symlink(root / "int4" / "model.safetensors", path / "model.safetensors")
    return path, json.loads((root / "int4" / "config.json").read_text())


@pytest.mark.parametrize("edit,field", QC_ERRORS, ids=[f for _, f in QC_ERRORS])
def test_unsupported_quantization_config_names_the_field(error_dir, edit, field):
    path, config = error_dir
    config = json.loads(json.dumps(config))
    edit(config["quantization_config"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=re.escape(field)):
        load_target(str(path), dtype=jnp.float32)


TENSOR_ERRORS = [
    (lambda t: t.update({"model.layers.1.mlp.experts.2.up_proj.weight": torch.zeros(48, 64)}),
     "'model.layers.1.mlp.experts.2.up_proj.weight'"),
    (lambda t: t.update({"model.layers.1.mlp.experts.2.up_proj.weight_packed":
                         t["model.layers.1.mlp.experts.2.up_proj.weight_packed"].float()}), "dtype float32"),
    (lambda t: t.update({"model.layers.1.mlp.experts.2.up_proj.weight_shape": torch.tensor([48, 56])}),
     "weight_shape' is [48, 56], expected [48, 64]"),
    (lambda t: t.update({"model.layers.1.mlp.experts.2.up_proj.weight_scale":
                         t["model.layers.1.mlp.experts.2.up_proj.weight_scale"][:, :2].contiguous()}),
     "weight_scale' has shape"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_packed": torch.zeros(64, 4, dtype=torch.int32)}),
     "leaves dense"),
    (lambda t: t.pop("model.layers.1.mlp.experts.7.down_proj.weight_scale"), "experts.7.down_proj.weight_scale"),
]


@pytest.mark.parametrize("edit,message", TENSOR_ERRORS, ids=[m for _, m in TENSOR_ERRORS])
def test_int4_tensor_errors_name_the_tensor(ct_checkpoints, tmp_path, edit, message):
    root, *_ = ct_checkpoints(True)
    tensors = load_file(os.path.join(root / "int4", "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    (tmp_path / "config.json").write_text((root / "int4" / "config.json").read_text())
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_target(str(tmp_path), dtype=jnp.float32)


def test_packed_experts_shard_like_dense_experts():
    """On an expert=4 x tensor=2 mesh (abstract: no devices needed) every packed array takes its
    dense weight's placement: the expert dim over ``expert``, gate_up's output columns and down's
    (packed) input rows over ``tensor`` (here 2 groups and 4 word rows per expert: a dim the
    axis does not divide is replicated, as for every parameter). (The placement itself is
    ``_sharding``'s, which tests/test_checkpoints.py checks on 8 CPU devices.)"""
    from jax.sharding import AbstractMesh, AxisType
    from jax.sharding import PartitionSpec as P

    from ddtree_jax.checkpoints import DEFAULT_MESH_AXES, _sharding
    from ddtree_jax.models import KimiForCausalLM
    from tests._model_fixtures import tiny_kimi_config

    mesh = AbstractMesh((4, 2), ("expert", "tensor"), axis_types=(AxisType.Auto,) * 2)
    cfg = tiny_kimi_config(num_hidden_layers=2)  # expert intermediate 32
    dense = nnx.eval_shape(lambda: KimiForCausalLM(cfg, rngs=nnx.Rngs(0)))
    int4 = nnx.eval_shape(lambda: KimiForCausalLM(cfg, rngs=nnx.Rngs(0), experts_int4=Int4Format(16, False)))
    d, q = dense.model.layers[1].mlp.experts, int4.model.layers[1].mlp.experts
    for name, spec in (("gate_up_proj", P("expert", None, "tensor")), ("down_proj", P("expert", "tensor", None))):
        assert _sharding(getattr(d, name), mesh, DEFAULT_MESH_AXES).spec == spec
        for part in ("packed", "scale", "zero_point"):
            assert _sharding(getattr(q, f"{name}_{part}"), mesh, DEFAULT_MESH_AXES).spec == spec, (name, part)


def test_kimi_k2_thinking_quantization_config_is_understood():
    """The quantization_config as published with Kimi K2 Thinking (fields and values as in its
    config.json) selects exactly the routed experts: group 32, symmetric. An ignore entry naming
    a module the model lacks (here an MTP layer's) ignores nothing and is accepted."""
    from ddtree_jax.checkpoints import _modules
    from ddtree_jax.models import KimiForCausalLM
    from ddtree_jax.quant_config import int4_experts_format
    from tests._model_fixtures import tiny_kimi_config

    published = {
        "config_groups": {"group_0": {
            "input_activations": None, "output_activations": None, "targets": ["Linear"],
            "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                        "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                        "type": "int"}}},
        "format": "pack-quantized",
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
    }
    modules = _modules(nnx.eval_shape(lambda: KimiForCausalLM(tiny_kimi_config(), rngs=nnx.Rngs(0))))
    assert sum(kind == "expert" for kind in modules.values()) == 2 * 8 * 3
    assert int4_experts_format(published, modules) == Int4Format(32, True)
    published["ignore"].append("model.layers.3.mlp.experts.0.gate_proj")
    assert int4_experts_format(published, modules) == Int4Format(32, True)
