"""The serving engine on meshes of 8 CPU devices gives the same tokens as on one device
(the check and its tolerances: tests/_mesh_check.py).

Mesh: data x expert (2x4) with data-parallel attention: the 8 slots split over both axes, one per
device, the experts over the expert axis. (Tensor parallelism, expert=8 and rows that do not split
are covered by tests/test_sharded_generate.py.)
The sharded engines run in a subprocess (8 host devices) fed the one-device tokens computed
here."""

import json
import os
import subprocess
import sys

import pytest

from tests._mesh_check import check_runs, one_device_tokens

MESHES = ["data=2,expert=4"]

SCRIPT = """
import json, sys
import jax
from tests._mesh_check import mesh_runs
assert len(jax.devices()) == 8
for run in mesh_runs(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])):
    print("MESH", json.dumps(run))
"""


def test_engine_on_meshes_matches_one_device(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = [json.dumps(MESHES), json.dumps(one_device_tokens())]
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), *args], env=env, cwd=root,
                            capture_output=True, text=True, timeout=900)
    runs = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines() if line.startswith("MESH ")]
    assert len(runs) == len(MESHES), result.stderr[-3000:]
    check_runs(runs, MESHES)


def test_mesh_specs():
    from ddtree_jax.serving.sharding import parse_mesh_spec

    assert parse_mesh_spec("expert=4, tensor=2") == {"expert": 4, "tensor": 2}
    assert parse_mesh_spec("data=-1,expert=8") == {"data": -1, "expert": 8}
    for bad, match in [("experts=4", "axis"), ("expert=x", "integer"), ("expert=0", ">= 1"),
                       ("expert=2,expert=2", "twice"), ("data=-1,expert=-1", "at most one")]:
        with pytest.raises(ValueError, match=match):
            parse_mesh_spec(bad)


def test_prefill_layout_lists_each_devices_own_slots_in_its_block():
    from ddtree_jax.serving._device import prefill_layout

    # 4 devices of 2 slots; requests in slots 5, 0, 1 (devices 2, 0, 0); blocks of 2 rows
    rows, pick = prefill_layout([5, 0, 1], blocks=4, per_block=2, block_rows=2)
    assert rows.tolist() == [0, 1, 2, 2, 5, 5, 6, 6] and pick.tolist() == [1, 2, -1, -1, 0, 0, -1, -1]
    rows, pick = prefill_layout([3], blocks=1, per_block=8, block_rows=4)  # one device: padded by the first
    assert rows.tolist() == [3, 3, 3, 3] and pick.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="device 0"):
        prefill_layout([0, 1], blocks=2, per_block=2, block_rows=1)
