"""Exact per-row top-k for large vocabularies, without sorting whole rows.

XLA's GPU top-k sorts whole rows for large k; on V = 163,840 that was the bulk of a DDTree build.
``exact_top_k`` gives exactly ``jax.lax.top_k``'s result (values descending, ties lowest index
first) through chunk maxima, with a fallback that keeps it exact on any input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["exact_top_k"]


def exact_top_k(x: jax.Array, k: int, *, chunk: int = 32, extra: int = 32) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, k)`` exactly (values descending, ties lowest index first), through chunk
    maxima: the ``k + extra`` chunks (of ``chunk`` columns) with the largest maxima are gathered
    in column order and ``lax.top_k`` runs on those few columns. If some unselected chunk could
    hold a value >= the k-th found (``>=`` the (k+extra+1)-th chunk maximum, or NaN), the row set
    falls back to ``lax.top_k`` on everything (one ``lax.cond``), so the result is always exact."""
    *lead, V = x.shape
    nc, kc = V // chunk, k + extra
    if V % chunk or nc <= kc + 1:
        return jax.lax.top_k(x, k)
    xr = x.reshape(-1, nc, chunk)
    cmax, cidx = jax.lax.top_k(jnp.max(xr, axis=-1), kc + 1)
    sel = jnp.sort(cidx[:, :kc], axis=-1)  # column order, so top_k's tie rule sees columns in order
    cand = jnp.take_along_axis(xr, sel[..., None], axis=1).reshape(-1, kc * chunk)
    cols = (sel[..., None] * chunk + jnp.arange(chunk, dtype=sel.dtype)).reshape(-1, kc * chunk)
    vals, pos = jax.lax.top_k(cand, k)
    ids = jnp.take_along_axis(cols, pos, axis=-1)
    ok = jnp.all(cmax[:, kc] < vals[:, k - 1])
    vals, ids = jax.lax.cond(ok, lambda: (vals, ids), lambda: tuple(jax.lax.top_k(x.reshape(-1, V), k)))
    return vals.reshape(*lead, k), ids.reshape(*lead, k)
