"""Checkpoint I/O: error messages, sharded index, fused expert names, MTP skipping, FP8, mesh placement."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree_jax.checkpoints import CheckpointError, _dequantize_fp8, load_target, save_checkpoint
from tests._model_fixtures import VOCAB, forward_uncached, tiny_kimi

IDS = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 12)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny target and its single-file checkpoint directory."""
    model = tiny_kimi(7)
    path = tmp_path_factory.mktemp("kimi")
    save_checkpoint(model, str(path))
    return model, path


def _rewrite(src, dst, edit):
    """Copy checkpoint ``src`` to ``dst`` with ``edit(tensors: dict) -> None`` applied."""
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    return config


def _write_config(dst, config):
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)


def _logits(model):
    return np.asarray(forward_uncached(model, IDS)[0])


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"), "model.layers.1.self_attn.kv_b_proj.weight"),
        (lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"), "model.layers.2.mlp.experts.5.up_proj.weight"),
        (lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(3)}), "model.layers.0.mlp.extra.weight"),
        (lambda t: t.update({"model.norm.weight": torch.ones(63)}), "model.norm.weight"),
        (lambda t: t.update({"lm_head.weight": torch.ones(64, VOCAB)}), "lm_head.weight"),
    ],
)
def test_errors_name_the_tensor(tmp_path, saved, edit, message):
    _, src = saved
    _write_config(tmp_path, _rewrite(src, tmp_path, edit))
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.")):
        load_target(str(tmp_path), dtype=jnp.float32)


def test_sharded_index_and_mtp_layers_skipped(tmp_path, saved):
    model, _ = saved
    save_checkpoint(model, str(tmp_path), max_shard_bytes=40_000)
    with open(tmp_path / "model.safetensors.index.json") as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) > 2
    extra = {
        "model.layers.3.eh_proj.weight": torch.zeros(64, 128),  # an MTP layer (3 >= num_hidden_layers)
        "model.layers.3.mlp.experts.0.up_proj.weight": torch.zeros(32, 64),
    }
    save_file(extra, str(tmp_path / "mtp.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "mtp.safetensors" for k in extra})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    np.testing.assert_array_equal(_logits(load_target(str(tmp_path), dtype=jnp.float32)), _logits(model))


def test_fused_expert_tensors_load(tmp_path, saved):
    """transformers 5's in-memory layout: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]."""
    model, src = saved

    def fuse(t):
        for layer in (1, 2):
            p = f"model.layers.{layer}.mlp.experts"
            gate_up = [
                torch.cat([t.pop(f"{p}.{e}.gate_proj.weight"), t.pop(f"{p}.{e}.up_proj.weight")]) for e in range(8)
            ]
            t[f"{p}.gate_up_proj"] = torch.stack(gate_up)
            t[f"{p}.down_proj"] = torch.stack([t.pop(f"{p}.{e}.down_proj.weight") for e in range(8)])

    _write_config(tmp_path, _rewrite(src, tmp_path, fuse))
    np.testing.assert_array_equal(_logits(load_target(str(tmp_path), dtype=jnp.float32)), _logits(model))


def test_auto_dtype_is_the_checkpoints_own(saved, tmp_path):
    model, path = saved
    assert load_target(str(path)).model.embed_tokens.weight.dtype == jnp.float32  # saved in float32
    bf16 = load_target(str(path), dtype=jnp.bfloat16)
    save_checkpoint(bf16, str(tmp_path / "bf16"))
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_target(str(tmp_path / "bf16")).model.embed_tokens.weight.dtype == jnp.bfloat16
    # Without a dtype field, the first floating-point tensor decides (as in transformers).
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    del cfg["torch_dtype"]
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(cfg))
    assert load_target(str(tmp_path / "bf16")).model.embed_tokens.weight.dtype == jnp.bfloat16
    # An explicit dtype wins.
    assert load_target(str(tmp_path / "bf16"), dtype=jnp.float32).model.embed_tokens.weight.dtype == jnp.float32


def test_bfloat16_load_keeps_router_in_float32(saved):
    model, path = saved
    loaded = load_target(str(path), dtype=jnp.bfloat16)
    assert loaded.model.layers[0].self_attn.kv_b_proj.kernel.dtype == jnp.bfloat16
    assert loaded.model.layers[1].mlp.experts.gate_up_proj.dtype == jnp.bfloat16
    assert loaded.model.layers[1].mlp.gate.weight.dtype == jnp.float32
    assert loaded.model.layers[1].mlp.gate.e_score_correction_bias.dtype == jnp.float32
    assert all(a.dtype == jnp.bfloat16 for a in loaded.init_cache(1, 4).latent)
    want = _logits(model)
    got = _logits(loaded)
    assert got.dtype == np.float32 and np.abs(got - want).max() < 0.1 * np.abs(want).max()


def _dequantize_loops(weight, scale_inv, block):
    """Element-by-block reference for the FP8 dequantisation."""
    out = np.zeros(weight.shape, np.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = weight[rows, cols].astype(np.float32) * scale_inv[i, j]
    return out


def test_fp8_block_dequantisation_matches_reference():
    rng = np.random.default_rng(0)
    w = torch.tensor(rng.normal(size=(300, 200)), dtype=torch.float32).to(torch.float8_e4m3fn)
    scale = rng.uniform(0.1, 2.0, size=(3, 2)).astype(np.float32)
    w_np = w.to(torch.float32).numpy()
    np.testing.assert_array_equal(_dequantize_fp8(w_np, scale, (128, 128)), _dequantize_loops(w_np, scale, (128, 128)))


def test_fp8_checkpoint_loads_dequantised(tmp_path, saved):
    """q_b_proj stored as e4m3 + weight_scale_inv per 16x16 block (tiny stand-in for 128x128)."""
    model, src = saved
    name = "model.layers.1.self_attn.q_b_proj.weight"  # [48, 24]
    quantised = {}

    def quantise(t):
        w = t[name].numpy()
        scale = np.ones((3, 2), np.float32)
        for i in range(3):
            for j in range(2):
                scale[i, j] = np.abs(w[i * 16 : (i + 1) * 16, j * 16 : (j + 1) * 16]).max() / 448.0
        q = torch.tensor(w / np.repeat(np.repeat(scale, 16, 0), 16, 1)[:48, :24]).to(torch.float8_e4m3fn)
        t[name], t[name + "_scale_inv"] = q, torch.tensor(scale)
        quantised["want"] = _dequantize_loops(q.to(torch.float32).numpy(), scale, (16, 16))

    config = _rewrite(src, tmp_path, quantise)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    _write_config(tmp_path, config)
    loaded = load_target(str(tmp_path), dtype=jnp.float32)
    got = np.asarray(loaded.model.layers[1].self_attn.q_b_proj.kernel[...]).T
    np.testing.assert_array_equal(got, quantised["want"])
    original = model.model.layers[1].self_attn.q_b_proj.kernel[...].T
    assert np.abs(got - original).max() < 0.07 * np.abs(original).max()  # e4m3 rounding only


MESH_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from ddtree_jax.checkpoints import load_target
    assert len(jax.devices()) == 8
    path = sys.argv[1]
    mesh = jax.make_mesh((4, 2), ("expert", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharded = load_target(path, mesh=mesh, dtype=jnp.float32)
    plain = load_target(path, dtype=jnp.float32)
    experts = sharded.model.layers[1].mlp.experts
    assert experts.gate_up_proj[...].sharding.spec == P("expert", None, "tensor"), experts.gate_up_proj[...].sharding
    assert experts.down_proj[...].sharding.spec == P("expert", "tensor", None)
    assert sharded.model.layers[0].self_attn.o_proj.kernel[...].sharding.spec == P("tensor", None)
    assert sharded.lm_head.kernel[...].sharding.spec == P(None, "tensor")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 12)))
    np.testing.assert_allclose(jax.jit(lambda x: sharded(x))(ids), jax.jit(lambda x: plain(x))(ids),
                               rtol=1e-5, atol=1e-5)
    print("MESH_OK")
""")


def test_mesh_loading_on_8_cpu_devices(saved):
    _, path = saved
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT, str(path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert "MESH_OK" in result.stdout, result.stderr[-3000:]


def test_architecture_decides_the_role(saved, tmp_path):
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    for architectures, message in (
        (["DFlashDraftModel"], "DFlash block drafter"),
        (["LlamaForCausalLM"], "unsupported architecture"),
        (None, "no 'architectures' field"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": architectures}))
        with pytest.raises(ValueError, match=message):
            load_target(str(tmp_path))
    with pytest.raises(CheckpointError, match="no config.json"):
        load_target(str(tmp_path / "absent"))


# ---- file integrity: every failure names the file (and the tensor), never a numpy or JSON error


def _sharded_copy(model, path):
    save_checkpoint(model, str(path), max_shard_bytes=40_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    return sorted(set(index.values()))


def _header(file):
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def test_truncated_shard_names_the_file_and_the_tensor(tmp_path, saved):
    model, _ = saved
    shard = tmp_path / _sharded_copy(model, tmp_path)[1]
    n, header = _header(shard)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    with pytest.raises(CheckpointError) as e:
        load_target(str(tmp_path), dtype=jnp.float32)
    assert str(shard) in str(e.value) and repr(last) in str(e.value) and "truncated" in str(e.value)


@pytest.mark.parametrize("corrupt,expected", [
    (lambda n, h: b" " * n, "not valid JSON"),
    (lambda n, h: b"\xff" * n, "not valid JSON"),
    (lambda n, h: json.dumps([1]).encode(), "JSON list"),
    (lambda n, h: _edit(h, shape=lambda s: [s[0] + 1, *s[1:]]), "corrupt header"),
    (lambda n, h: _edit(h, dtype=lambda d: "Q9"), "dtype 'Q9'"),
    (lambda n, h: _edit(h, data_offsets=lambda o: [o[0], o[1] - 1]), "corrupt header"),
], ids=["spaces", "not utf-8", "a list", "shape", "dtype", "offsets"])
def test_corrupt_header_names_the_file(tmp_path, saved, corrupt, expected):
    model, _ = saved
    shard = tmp_path / _sharded_copy(model, tmp_path)[0]
    n, header = _header(shard)
    new = corrupt(n, header)
    shard.write_bytes(struct.pack("<Q", len(new)) + new + shard.read_bytes()[8 + n :])
    with pytest.raises(CheckpointError) as e:
        load_target(str(tmp_path), dtype=jnp.float32)
    assert str(e.value).startswith(f"{shard}: ") and expected in str(e.value), str(e.value)


def _edit(header, **change):
    """The header (bytes) with fields of its last tensor's entry changed: ``field=old -> new``."""
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    entry = {k: change[k](v) if k in change else v for k, v in header[last].items()}
    return json.dumps({**header, last: entry}).encode()


def test_header_length_beyond_the_file(tmp_path, saved):
    _, src = saved
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(CheckpointError, match="header length says 1000000000 bytes but the file has 10 bytes"):
        load_target(str(tmp_path), dtype=jnp.float32)


def test_missing_shard_and_mismatched_index_are_named(tmp_path, saved):
    model, _ = saved
    shards = _sharded_copy(model, tmp_path)
    (tmp_path / shards[2]).unlink()
    with pytest.raises(CheckpointError, match=f"names the shard {shards[2]}, which is missing"):
        load_target(str(tmp_path), dtype=jnp.float32)
    save_checkpoint(model, str(tmp_path), max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = shards[0] if index["weight_map"]["model.norm.weight"] != shards[0] \
        else shards[1]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="has no tensor 'model.norm.weight', which model.safetensors.index.json"):
        load_target(str(tmp_path), dtype=jnp.float32)
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not valid JSON"):
        load_target(str(tmp_path), dtype=jnp.float32)


def test_config_that_is_not_json_is_named(tmp_path, saved):
    _, src = saved
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_target(str(tmp_path))


def test_header_dtype_sizes_agree_with_the_loader():
    from ddtree_jax._safetensors import DTYPE_SIZES
    from ddtree_jax.checkpoints import _DTYPES

    assert {k: np.dtype(v).itemsize for k, v in _DTYPES.items()} == DTYPE_SIZES
