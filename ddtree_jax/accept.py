"""The accept walk: turn the target's per-node samples into committed tokens, exactly.

The target's forward pass over the tree is ``verify`` (a model method); this module decides what
it accepted. Sample-then-walk (docs/exact-sampling.md): every node n carries an independent
draw ``x_n`` from the target's decoding rule at n. From the root, while ``x_cur`` is the token of
a child of ``cur``, move to that child; the first ``x_cur`` that matches no child is the bonus.
The committed sequence (accepted draft tokens, then the bonus) is then an exact sample of the
target's own rule, token by token: at a node with children C, P(move to child c) = q(c), and
otherwise the emitted token is q restricted to V \\ C, renormalised by exactly the remaining
mass. Greedy is the point-mass case of the same walk.

Conditions this relies on, which ``DraftTree`` guarantees: the children of a node carry distinct
tokens; a token the target's rule removed is never drawn, so it is never accepted nor emitted.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ddtree_jax.backend import Backend, kernel_module, resolve_backend
from ddtree_jax.tree import DraftTree

__all__ = ["AcceptResult", "accept_path"]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["path", "num_accepted", "bonus", "committed"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class AcceptResult:
    """Outcome of one verification round, per request.

    Attributes:
      path: i32 ``[B, L+1]`` node indices from the root (``path[:, 0] == 0``), -1 padded.
      num_accepted: i32 ``[B]`` accepted draft tokens (root excluded), in ``[0, L]``.
      bonus: i32 ``[B]`` the target's token at the last accepted node (matched no child).
      committed: i32 ``[B, L+1]`` the accepted draft tokens then the bonus, -1 padded; the
        request commits ``num_accepted + 1`` tokens.
    """

    path: jax.Array
    num_accepted: jax.Array
    bonus: jax.Array
    committed: jax.Array


def accept_path(tree: DraftTree, node_samples: jax.Array, *, impl: str | Backend = "auto") -> AcceptResult:
    """Walks each request's tree with the target's per-node samples.

    Args:
      tree: ``DraftTree`` with M node slots.
      node_samples: i32 ``[B, M]``, the target's draw at every node (``sample_tree_nodes``).
      impl: "auto" (the Pallas walk kernel on GPU and TPU, the plain-JAX walk elsewhere),
        "pallas" (the platform's kernel; the Triton one in interpret mode off GPU/TPU),
        "pallas:triton" / "pallas:mosaic_tpu", "reference", or a resolved ``Backend``
        (``ddtree_jax.backend``). All give identical results.

    Returns:
      ``AcceptResult``.
    """
    backend = resolve_backend(impl)
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    node_samples = jnp.asarray(node_samples)
    if node_samples.shape != tree.tokens.shape:
        raise ValueError(
            f"node_samples must have the tree's shape [B, M] = {tree.tokens.shape}, got {node_samples.shape}"
        )
    if not jnp.issubdtype(node_samples.dtype, jnp.integer):
        raise ValueError(f"node_samples must be integer token ids, got {node_samples.dtype}")
    return _accept_path(tree, node_samples.astype(jnp.int32), backend)


def _accept_path(tree: DraftTree, node_samples: jax.Array, backend: Backend) -> AcceptResult:
    """``accept_path`` on validated inputs (traceable: the decode round calls it)."""
    if backend.kernels:
        accept_walk = kernel_module(backend, "accept_walk").accept_walk
        path, num_accepted, bonus, committed = accept_walk(
            tree.tokens, tree.parents, tree.valid, node_samples, draft_len=tree.draft_len, interpret=backend.interpret
        )
        return AcceptResult(path=path, num_accepted=num_accepted, bonus=bonus, committed=committed)
    return _walk_reference(tree, node_samples)


@jax.jit
def _walk_reference(tree: DraftTree, node_samples: jax.Array) -> AcceptResult:
    B, M = tree.tokens.shape
    L = tree.draft_len
    rows = jnp.arange(B)

    def step(d, carry):
        cur, done, path = carry
        x = node_samples[rows, cur]
        # Children of `cur` whose token is the target's draw there (at most one: distinct tokens).
        match = tree.valid & (tree.parents == cur[:, None]) & (tree.tokens == x[:, None])
        found = jnp.any(match, axis=1) & ~done
        child = jnp.argmax(match, axis=1).astype(jnp.int32)
        path = path.at[:, d + 1].set(jnp.where(found, child, -1))
        return jnp.where(found, child, cur), done | ~found, path

    path0 = jnp.full((B, L + 1), -1, jnp.int32).at[:, 0].set(0)
    cur, _, path = jax.lax.fori_loop(0, L, step, (jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool), path0))
    num_accepted = jnp.sum(path[:, 1:] >= 0, axis=1).astype(jnp.int32)
    bonus = node_samples[rows, cur]
    accepted_tokens = jnp.where(
        path[:, 1:] >= 0, jnp.take_along_axis(tree.tokens, jnp.maximum(path[:, 1:], 0), axis=1), -1
    )
    committed = jnp.concatenate([accepted_tokens, jnp.full((B, 1), -1, jnp.int32)], axis=1)
    committed = committed.at[rows, num_accepted].set(bonus)
    return AcceptResult(path=path, num_accepted=num_accepted, bonus=bonus, committed=committed)
