"""Pieces shared by the model benchmarks (bench_sharded.py, bench_models.py,
bench_batch_invariance.py): progress lines, timing, the copy bandwidth and bf16 matmul rate
measured in the run, the weight-read floor of a pass, random trees, and a Report that rewrites its
JSON and Markdown after every row (a run cut short keeps what it measured)."""

from __future__ import annotations

import collections
import datetime
import glob
import json
import os
import platform
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

T0 = time.perf_counter()


SMOKE_K2 = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=16,
    num_experts_per_tok=4, max_position_embeddings=4096,
)


def k2_slice(layers: int, experts: int, *, smoke: bool, **smoke_overrides):
    """A Kimi K2-shaped target config of ``layers`` layers and ``experts`` routed experts, or with
    ``smoke`` the tiny CPU shapes (``SMOKE_K2`` with ``smoke_overrides``)."""
    import ddtree_jax as dt

    if smoke:
        return dt.KimiConfig.kimi_k2(**{**SMOKE_K2, **smoke_overrides}, num_hidden_layers=layers)
    return dt.KimiConfig.kimi_k2(num_hidden_layers=layers, n_routed_experts=experts)


def k2_models(layers: int, *, smoke: bool, acceptance=None):
    """``(target, drafter)``: a random Kimi K2-shaped target of ``layers`` layers (``k2_slice``, 384
    experts, bf16) and a random one-layer DFlash drafter for it, placed by ``init_on_mesh``; with
    ``acceptance`` (``bench._controlled.Acceptance``) the pair whose acceptance it sets
    (``ControlledTarget``, ``ControlledDrafter``: the same passes)."""
    from flax import nnx

    import ddtree_jax as dt
    from bench._controlled import ControlledDrafter, ControlledTarget

    cfg = k2_slice(layers, 384, smoke=smoke)
    target_cls, drafter_cls, extra = dt.KimiForCausalLM, dt.DFlashDrafter, {}
    if acceptance is not None:
        target_cls, drafter_cls, extra = ControlledTarget, ControlledDrafter, dict(acceptance=acceptance)
    target = dt.init_on_mesh(lambda: target_cls(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, **extra))
    drafter = dt.init_on_mesh(lambda: drafter_cls(one_layer_drafter_config(cfg), rngs=nnx.Rngs(1),
                                                  dtype=jnp.bfloat16, **extra))
    return target, drafter


def one_layer_drafter_config(tcfg):
    """A one-layer DFlash drafter (block 16) for the target ``tcfg`` (``planner.drafter_config_for``):
    random weights make it a real drafter's compute with about one accepted token per round."""
    from ddtree_jax.planner import drafter_config_for

    return drafter_config_for(tcfg, 1)


def prefill_every_layer(m, ids, n, c, dense_experts=False):
    """A prefill (as ``m.prefill``) that returns every layer's output and the cache, for timing:
    returning the cache alone lets XLA drop the last layer's MoE (no cache needs it), which in a
    2-layer slice is most of the work."""
    every = tuple(range(m.config.num_hidden_layers))
    return m.prefill(ids, n, c, hidden_layer_ids=every, dense_experts=dense_experts)[1:]


def device_kernels(fn, args, calls: int) -> tuple[dict[str, float], float]:
    """Nanoseconds per call by kernel name on the GPU's streams over ``calls`` traced calls, and
    the trace's streams' total per call."""
    per_kernel, _ = device_trace(fn, args, calls)
    return per_kernel, sum(per_kernel.values())


def device_trace(fn, args, calls: int) -> tuple[dict[str, float], float]:
    """``(nanoseconds per call by kernel name, kernels launched per call)`` on the GPU's streams
    over ``calls`` traced calls of ``fn(*args)``."""
    jax.block_until_ready(fn(*args))
    per_kernel: dict[str, float] = collections.defaultdict(float)
    launched = 0
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
        data = jax.profiler.ProfileData.from_file(path)
        for plane in data.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if not line.name.startswith("Stream"):
                    continue
                for ev in line.events:
                    per_kernel[ev.name] += ev.duration_ns / calls
                    launched += 1
    return dict(per_kernel), launched / calls


def log(*a):
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def past_deadline(args) -> bool:
    """True (and says so) once ``args.deadline`` seconds have passed since the start (0: never)."""
    if getattr(args, "deadline", 0) and time.perf_counter() - T0 > args.deadline:
        log("  deadline passed: skipped")
        return True
    return False


def time_call(fn, *args, iters=10, repeats=3, target_s: float | None = None) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls, after a warm-up
    call (compilation). ``target_s``: choose ``iters`` (1..``iters``) so that a repeat lasts about
    that long (slow passes such as long prefills)."""
    jax.block_until_ready(fn(*args))
    if target_s:
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        iters = int(max(1, min(iters, target_s // max(time.perf_counter() - t, 1e-6))))
    best = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best.append((time.perf_counter() - t) / iters)
    return float(np.median(best))


def copy_bandwidth() -> float:
    """Bytes/s of a read + write of a large array on the default device (the floor's rate)."""
    n = (1 << 30) if jax.default_backend() == "gpu" else (1 << 22)
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a + 1)
    return 2 * x.nbytes / time_call(f, x, iters=10)


def matmul_rate(dtype=jnp.bfloat16) -> float:
    """FLOP/s of one large square matmul in ``dtype`` on the default device (the FLOP floor's rate)."""
    n = 8192 if jax.default_backend() == "gpu" else 256
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / time_call(f, a, a, iters=10)


def weight_read_bytes(model, cfg, tokens: int, *, embedding: str = "table") -> float:
    """Bytes a pass over ``tokens`` tokens must read from the busiest device: each weight's
    per-device shard, the routed experts scaled by the share a uniform routing of ``tokens``
    tokens touches (``1 - (1 - k/E)^tokens``). ``embedding``: ``"table"`` counts the whole
    embedding (bench_sharded's floor, kept for comparison with its results), ``"rows"`` only the
    ``tokens`` rows a pass gathers."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = 1 - (1 - k / e) ** tokens
    total = 0.0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = var[...]
        shard = value.addressable_shards[0].data if hasattr(value, "addressable_shards") else value
        nbytes = np.prod(shard.shape) * shard.dtype.itemsize
        if "embed_tokens" in path and embedding == "rows":
            nbytes = min(nbytes, tokens * shard.shape[-1] * shard.dtype.itemsize)
        is_expert = "experts" in path and "shared_experts" not in path
        total += nbytes * (touched if is_expert else 1.0)
    return float(total)


def random_tree(rng, b: int, budget: int):
    """``b`` random trees of ``budget`` non-root nodes: depths, ancestor mask (root = node 0)."""
    n = budget + 1
    depths = np.zeros((b, n), np.int32)
    anc = np.zeros((b, n, n), bool)
    for r in range(b):
        anc[r, 0, 0] = True
        for i in range(1, n):
            p = rng.integers(0, i)
            depths[r, i] = depths[r, p] + 1
            anc[r, i] = anc[r, p]
            anc[r, i, i] = True
    return jnp.asarray(depths), jnp.asarray(anc)


def device_tag(smoke: bool) -> str:
    dev = jax.devices()[0]
    return "cpu-smoke" if smoke else re.sub(r"[^A-Za-z0-9]+", "_", dev.device_kind).strip("_").lower()


class Report:
    """Rows by section, written to ``<out>/<name>_<device><suffix>_<date>.{json,md}`` after each row."""

    def __init__(self, args, *, name: str, title: str, sections, n_dev: int = 1, suffix: str = ""):
        self.args, self.title = args, title
        dev = jax.devices()[0]
        self.meta = dict(
            device=f"{dev.device_kind} x {n_dev}", backend=jax.default_backend(), jax=jax.__version__,
            date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), host=platform.node(),
            command="python " + " ".join(sys.argv),
        )
        day = datetime.date.today().strftime("%Y%m%d")
        self.stem = os.path.join(args.out, f"{name}_{device_tag(args.smoke)}{suffix}_{day}")
        self.sections: dict[str, list[dict]] = {s: [] for s in sections}
        self.notes: list[str] = []

    def add(self, section: str, row: dict):
        self.sections[section].append(row)
        self.write()

    def write(self):
        os.makedirs(self.args.out, exist_ok=True)
        with open(self.stem + ".json", "w") as f:
            json.dump(dict(meta=self.meta, notes=self.notes, **self.sections), f, indent=1)
        lines = [f"# {self.title}: {self.meta['device']}", ""]
        lines += [f"- {k}: {v}" for k, v in self.meta.items()] + [""]
        lines += [f"{n}" for n in self.notes] + ([""] if self.notes else [])
        for name, rows in self.sections.items():
            if not rows:
                continue
            cols = list(dict.fromkeys(k for r in rows for k in r))
            lines += [f"## {name}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            for r in rows:
                cells = [f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
        with open(self.stem + ".md", "w") as f:
            f.write("\n".join(lines))
