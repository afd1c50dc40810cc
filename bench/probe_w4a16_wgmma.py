"""Probe (issue 14): can a Hopper W4A16 expert product with the dequantised weights as the
``wgmma`` A operand in registers run the INT4 expert launches (gate/up and down) near their
weight-read floor at tree verify sizes (5-22 token copies per expert), where the Triton kernel
is 1.45-2.2x its floor?

The Triton kernel (``pallas_kernels/triton/moe_grouped_matmul.py``) multiplies 32-token tiles by
dequantised weight tiles that reach its MMAs through shared memory, as eight K=16 dots per chunk.
This probe lays the product out the other way round: ``out^T [features, tokens] = W [features,
K] @ x^T [K, tokens]``, so that the weights are the 64-row A operand of a ``wgmma`` and can come
from registers, and the tokens are the small N (here 32) read from shared memory. Per K-chunk a
compute warpgroup loads its ``[64, BK]`` INT4 tile with Mosaic GPU's 4-bit upcast layout,
converts it to bf16 in registers, multiplies each 32-input group by its per-row scale and issues
one ``wgmma`` per group against the matching 32 columns of the token tile. A memory warpgroup
streams the tiles with TMA.

Simplifications against the real launch (what a kernel for the library would still need): every
expert gets exactly ``--tokens`` token rows (no routing, no gather of token rows, no partial
tiles), the weights are in the checkpoint's ``[out, in]`` orientation as signed int4 (the
library stores offset nibbles as ``[E, in/8, out]`` words), scales as ``[E, in/G, out]``, and
the outputs are stored feature-major: ``silu(gate) * up`` as ``[E, I, tokens]`` bf16, the down
product as ``[E, H, tokens]`` float32 (no routing weights).

Run on an H100/H200: ``python bench/probe_w4a16_wgmma.py --out bench/results``; at each
``--tokens NT:ROUTED`` pair it checks every ``--variants`` against a plain-JAX reference (4
experts) and times it, then times the library's Triton INT4 launches on ROUTED randomly routed
tokens (top-8) in the same process (profiler: the gate/up launch apart). The defaults pair 32
rows with 1,040 tokens (a B=16 verify of 64 nodes: about 22 copies per expert) and 8 rows with
256 (B=16, 15 nodes: about 5). ``--lower-only`` lowers the probe for CUDA (works on a CPU).

Measured so far (bench/results/w4a16_wgmma_probe_h200_20261130.md, the first version: one
64-row tile per warpgroup, a full wait per K-chunk): 2.70 ms at 32 rows, 1.79x the floor,
against 2.84 ms for the Triton launch.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from pallas_kernels.mosaic_gpu._stream import stream_tiles  # noqa: E402

GROUP = 32  # inputs per scale
ROWS = 64  # features per compute warpgroup (one wgmma M tile)


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def _kernel(x_ref, w_ref, s_ref, h_ref, scoped, *, K, N, BK, NT, stages, m_tiles, overlap, mats):
    (x_smem, w_smem, s_smem), bars, consumed = scoped
    e, j, wg = lax.axis_index("e"), lax.axis_index("j"), lax.axis_index("wg")
    nk = K // BK
    cta_rows = 2 * ROWS * m_tiles  # rows of each matrix per CTA: m_tiles per compute warpgroup
    groups = BK // GROUP
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")

        def issue(slot, accs):
            """Dequantise this warpgroup's tiles of the K-chunk in ``slot`` and issue their products."""
            for m in range(mats):  # gate and up, or down
                for t in range(m_tiles):
                    rows = pl.ds((wg * m_tiles + t) * ROWS, ROWS)
                    a = plgpu.load(w_smem.at[slot, m, rows], (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
                    a = plgpu.layout_cast(a, plgpu.Layout.WGMMA).astype(jnp.bfloat16)
                    for g in range(groups):
                        sc = plgpu.load(s_smem.at[slot, m, g, rows], (), layout=row_layout)
                        ag = a[:, g * GROUP:(g + 1) * GROUP] * lax.broadcast_in_dim(sc, (ROWS, GROUP), [0])
                        plgpu.wgmma(accs[m * m_tiles + t], ag,
                                    x_smem.at[slot, :, pl.ds(g * GROUP, GROUP)].transpose((1, 0)))

        def body(*accs):
            def step(k, _):
                slot = lax.rem(k, stages)
                plgpu.barrier_wait(bars.at[slot])
                issue(slot, accs)
                if overlap:  # the previous chunk's products are done: release its slot
                    plgpu.wgmma_wait(mats * m_tiles * groups)
                    pl.when(k > 0)(lambda: plgpu.barrier_arrive(consumed.at[lax.rem(k + stages - 1, stages)]))
                else:
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(consumed.at[slot])

            lax.fori_loop(0, nk, step, None)
            if overlap:
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(consumed.at[(nk - 1) % stages])
            for t in range(m_tiles):
                if mats == 2:
                    gate, up = accs[t][...], accs[m_tiles + t][...]
                    out = gate / (1.0 + jnp.exp(-gate)) * up
                else:
                    out = accs[t][...]
                h_ref.at[e, pl.ds(j * cta_rows + (wg * m_tiles + t) * ROWS, ROWS)][...] = out.astype(h_ref.dtype)

        pl.run_scoped(body, *[plgpu.ACC((ROWS, NT), jnp.float32) for _ in range(mats * m_tiles)])

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def fetch(k, slot):
            ks = pl.ds(k * BK, BK)
            gs = pl.ds(k * groups, groups)
            plgpu.copy_gmem_to_smem(x_ref.at[e, :, ks], x_smem.at[slot], bars.at[slot])
            for m in range(mats):
                cols = pl.ds(m * N + j * cta_rows, cta_rows)
                plgpu.copy_gmem_to_smem(w_ref.at[e, cols, ks], w_smem.at[slot, m], bars.at[slot])
                plgpu.copy_gmem_to_smem(s_ref.at[e, gs, cols], s_smem.at[slot, m], bars.at[slot])

        stream_tiles(fetch, nk, stages, consumed)


@functools.partial(jax.jit, static_argnames=("mats", "block_k", "stages", "m_tiles", "overlap"))
def expert_product_w4a16(x, w, s, *, mats, block_k=256, stages=3, m_tiles=1, overlap=False):
    """``x [E, NT, K]`` bf16, ``w [E, mats*N, K]`` int4, ``s [E, K/32, mats*N]`` bf16 -> feature-major
    ``[E, N, NT]``: ``mats=2`` (gate rows, then up) ``silu(x Wg^T) * (x Wu^T)`` in bf16, ``mats=1``
    (down) ``x W^T`` in float32. ``m_tiles``: 64-row weight tiles per compute warpgroup (a CTA
    covers ``128 * m_tiles`` rows of each matrix and reads the token tile once for them);
    ``overlap``: a chunk's slot is released one chunk later, after ``wgmma_wait`` leaves only the
    current chunk's products in flight (its dequantisation then overlaps the previous chunk's
    products), instead of waiting for every product."""
    E, NT, K = x.shape
    N = w.shape[1] // mats
    cta_rows = 2 * ROWS * m_tiles
    if N % cta_rows or K % block_k:
        raise ValueError(f"expert_product_w4a16: N={N} must split into {cta_rows}-row blocks, K={K} into {block_k}")
    wsw = plgpu.find_swizzle(block_k * 4)
    xsw = 64  # 32 bf16 inputs: each group's K-slice of the token tile is one swizzle tile
    scratch = (
        plgpu.SMEM((stages, NT, block_k), jnp.bfloat16,
                   transforms=(plgpu.TilingTransform((8, xsw // 2)), plgpu.SwizzleTransform(xsw))),
        plgpu.SMEM((stages, mats, cta_rows, block_k), jnp.int4,
                   transforms=(plgpu.TilingTransform((8, wsw * 2)), plgpu.SwizzleTransform(wsw))),
        plgpu.SMEM((stages, mats, block_k // GROUP, cta_rows), jnp.bfloat16),
    )
    body = functools.partial(_kernel, K=K, N=N, BK=block_k, NT=NT, stages=stages, m_tiles=m_tiles,
                             overlap=overlap, mats=mats)

    def entry(*refs):
        pl.run_scoped(lambda *sc: body(*refs, sc), scratch,
                      plgpu.Barrier(num_arrivals=1 + 2 * mats, num_barriers=stages),
                      plgpu.Barrier(num_arrivals=2, num_barriers=stages), collective_axes="wg")

    out_dtype = jnp.bfloat16 if mats == 2 else jnp.float32
    return plgpu.kernel(
        entry, out_type=jax.ShapeDtypeStruct((E, N, NT), out_dtype), grid=(E, N // cta_rows),
        grid_names=("e", "j"), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(x, w, s)


def reference(x, w, s, mats):
    E, rows, K = w.shape
    wd = (w.astype(jnp.float32).reshape(E, rows, K // GROUP, GROUP)
          * jnp.swapaxes(s, 1, 2).astype(jnp.float32)[..., None]).reshape(E, rows, K).astype(jnp.bfloat16)
    y = jnp.einsum("etk,efk->eft", x, wd, preferred_element_type=jnp.float32)
    if mats == 1:
        return y
    g, u = jnp.split(y, 2, axis=1)
    return (jax.nn.silu(g) * u).astype(jnp.bfloat16)


def _shapes(mats, nt, E, H, INTER):
    """(x, w, s) shapes of gate/up (``mats=2``: K = hidden, N = intermediate) or down (K and N swapped)."""
    k, n = (H, INTER) if mats == 2 else (INTER, H)
    return ((E, nt, k), jnp.bfloat16), ((E, mats * n, k), jnp.int4), ((E, k // GROUP, mats * n), jnp.bfloat16)


def _probe_rows(variants, nt, E, H, INTER, keys, time_it, device_kernels):
    """Each variant of both products at ``nt`` token rows per expert: checked on 4 experts, timed,
    profiled, against the read floor of all experts' INT4 words and scales."""
    k1, k2, k3 = keys
    for mats, what in ((2, "gate/up"), (1, "down")):
        (xs, _), (ws, _), (ss, _) = _shapes(mats, nt, E, H, INTER)
        x = jax.random.normal(k1, xs, jnp.float32).astype(jnp.bfloat16)
        w = jax.jit(lambda k, ws=ws: jax.random.randint(k, ws, -8, 8, jnp.int8).astype(jnp.int4))(k2)
        s = (jax.random.uniform(k3, ss, jnp.float32, 0.5, 1.5) / (4.6 * xs[-1] ** 0.5)).astype(jnp.bfloat16)
        floor_ms = (ws[0] * ws[1] * ws[2] // 2 + ss[0] * ss[1] * ss[2] * 2) / 4.2e12 * 1e3
        want = np.asarray(reference(x[:4], w[:4], s[:4], mats), np.float32)
        for name, f in variants:
            row = {"product": what, "variant": name, "tokens_per_expert": nt}
            try:
                f = jax.jit(functools.partial(f, mats=mats))
                got = np.asarray(f(x, w, s)[:4], np.float32)
                err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))
                ms = time_it(f, [(x, w, s)]) * 1e3
                per, _ = device_kernels(f, (x, w, s), 5)
                kms = max(per.values()) / 1e6
                row |= {"rel_err": err, "ms": ms, "kernel_ms": kms, "floor_ms": floor_ms, "x_floor": kms / floor_ms}
            except Exception as ex:  # noqa: BLE001 - a failing variant is a row, not the end of the run
                row["failed"] = f"{type(ex).__name__}: {str(ex)[:300]}"
            log(json.dumps(row))
            yield row
        del x, w, s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--tokens", nargs="+", default=["32:1040", "8:256"], metavar="NT:ROUTED",
                    help="token rows per expert (the wgmma N) : tokens of the Triton comparison (top-8 routed)")
    ap.add_argument("--variants", nargs="+", metavar="BK,STAGES,M_TILES,OVERLAP",
                    default=["256,4,1,0", "256,2,2,0", "128,4,2,0", "256,4,1,1", "256,2,2,1", "128,4,2,1"],
                    help="block_k, stages, 64-row tiles per compute warpgroup, overlap (0/1)")
    ap.add_argument("--lower-only", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    E, H, INTER = a.experts, a.hidden, a.inter
    pairs = [tuple(int(t) for t in p.split(":")) for p in a.tokens]
    variants = []
    for v in a.variants:
        bk, st, mt, ov = (int(t) for t in v.split(","))
        variants.append((f"wgmma probe block_k={bk} stages={st} m_tiles={mt} overlap={ov}",
                         functools.partial(expert_product_w4a16, block_k=bk, stages=st, m_tiles=mt,
                                           overlap=bool(ov))))
    if a.lower_only:
        for nt, _ in pairs:
            for mats in (2, 1):
                shapes = [jax.ShapeDtypeStruct(*sd) for sd in _shapes(mats, nt, E, H, INTER)]
                for name, f in variants:
                    txt = jax.jit(functools.partial(f, mats=mats)).trace(*shapes).lower(
                        lowering_platforms=("cuda",)).as_text()
                    log(f"lowered {name} mats={mats} at {nt} rows: {len(txt)} chars")
        return
    from flax import nnx

    from bench._common import device_kernels
    from bench._timing import time_it
    from ddtree_jax.models.int4 import Int4Format, random_packed_weight
    from ddtree_jax.models.moe import experts_grouped_matmul, route_tokens
    from pallas_kernels.triton.moe_grouped_matmul import choose_blocks

    dev = jax.devices()[0]
    log("device", dev.device_kind, "jax", jax.__version__)
    rows = {"device": dev.device_kind, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
            "command": " ".join(["python"] + sys.argv), "cases": []}
    keys = jax.random.split(jax.random.key(0), 3)
    for nt, _ in pairs:
        rows["cases"].extend(_probe_rows(variants, nt, E, H, INTER, keys, time_it, device_kernels))
    # the library's Triton INT4 launches on routed tokens (same weights), gate/up apart; drawn on the
    # device under jit (the host would take longer than the run)
    fmt = Int4Format(group_size=GROUP, symmetric=True)
    gate_up = jax.jit(lambda: random_packed_weight(nnx.Rngs(1), (E, H, 2 * INTER), fmt, jnp.bfloat16))()
    down = jax.jit(lambda: random_packed_weight(nnx.Rngs(2), (E, INTER, H), fmt, jnp.bfloat16))()
    floor_ms = 3 * (E * INTER * H // 2 + E * (H // GROUP) * INTER * 2) / 4.2e12 * 1e3  # both launches
    for _, n in pairs:
        xr = jax.random.normal(keys[0], (n, H), jnp.float32).astype(jnp.bfloat16)
        ids = jnp.argsort(jax.random.uniform(keys[1], (n, E)), axis=1)[:, :8].astype(jnp.int32)
        wts = jnp.full((n, 8), 0.125, jnp.float32)
        blocks = choose_blocks(n * 8, E, int4=True)

        @jax.jit
        def triton(xr, wts, ids, gate_up, down, blocks=blocks):  # weights as arguments: not constants
            routing = route_tokens(wts, ids, E, block_m=blocks.block_m)
            return experts_grouped_matmul(xr, gate_up, down, routing, blocks)

        per, total = device_kernels(triton, (xr, wts, ids, gate_up, down), 5)
        gu = {k: v / 1e6 for k, v in per.items() if "ddtree_moe" in k}
        row = {"variant": f"Triton INT4 launches, {n} tokens x top-8 routed ({blocks})", "kernels_ms": gu,
               "all_ms": total / 1e6, "floor_ms": floor_ms, "touched_experts": int(jnp.unique(ids).size)}
        log(json.dumps(row))
        rows["cases"].append(row)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "w4a16_wgmma_probe.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
