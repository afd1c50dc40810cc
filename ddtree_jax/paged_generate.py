"""``generate``'s paged caches: one ``PagePool`` for the batch, each request's page table covering
its whole run, and prompts that share full pages of a prefix sharing those pages, prefilled once.

The prompts prefill in waves (``prefix_waves``): first every request whose first full page of
cacheable positions no earlier request shares, which then publish their full pages; then the
others, which match the longest published prefix (``PageTable.admit``) and prefill only the rest
of their prompt. Target and drafter pools are indexed by the same page ids: one table serves both
caches. Design: docs/paged-caches.md, "Paged caches in generate".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.config import MIN_PAGE_SIZE, ConfigError, is_page_size
from ddtree_jax.decode_round import DecodePlan, Models, first_tokens, prefill_rows
from ddtree_jax.decode_state import DecodeState
from ddtree_jax.models.paged_cache import NULL_PAGE
from ddtree_jax.serving.pages import PagePool, PageTable, page_keys

__all__ = ["check_page_size", "paged_prefill", "prefix_waves", "without_pages"]


def check_page_size(page_size, target) -> None:
    """``ConfigError`` naming ``generate.page_size`` unless it is ``None`` or a power of two of at
    least ``MIN_PAGE_SIZE`` (the attention kernel's smallest key tile: a page size valid on every
    backend) for a target with paged caches (``init_paged_cache``)."""
    if page_size is None:
        return
    if not is_page_size(page_size):
        raise ConfigError("generate", "page_size",
                          f"must be None or a power of two >= {MIN_PAGE_SIZE}, got {page_size!r}")
    if not hasattr(target, "init_paged_cache"):
        raise ConfigError("generate", "page_size", f"{type(target).__name__} has no paged cache (init_paged_cache)")


def prefix_waves(prompts: Sequence[np.ndarray], page_size: int) -> list[list[int]]:
    """The prefill waves, request indices in order: first each request whose cacheable positions
    (``prompt[:-1]``) have no full page or a first page (``page_keys``) no earlier request has;
    then the others, whose prefixes the first wave publishes. Empty waves are left out."""
    leaders, followers, seen = [], [], set()
    for i, prompt in enumerate(prompts):
        keys = page_keys(prompt[:-1], page_size)
        if keys and keys[0] in seen:
            followers.append(i)
        else:
            leaders.append(i)
            seen.update(keys[:1])
    return [wave for wave in (leaders, followers) if wave]


def paged_prefill(models: Models, tparams, dparams, plan: DecodePlan, target, drafter,
                  prompts: Sequence[np.ndarray], needs: np.ndarray, page_size: int, roots: jax.Array,
                  first_key=None, **per_row) -> tuple[DecodeState, np.ndarray]:
    """``(state, cached)``: a fresh ``DecodeState`` (``DecodeState.start`` of ``roots`` and the
    keywords ``per_row``) over paged caches holding every prompt but its last token, and ``cached
    [B]`` int32, the prompt positions each request took from pages another request computed.
    With ``first_key``, as ``decode_round.prefill`` with it: the caches hold the whole prompts and
    each request starts with its first new token, drawn from its prompt's last position.

    Request ``b``'s table covers ``needs[b]`` positions (its prompt, its output and a round's
    scratch); the pool holds every request's pages unshared, so no allocation can fail.
    ``drafter``: ``None`` without one (then the state has no draft cache).
    """
    pool = PagePool(1 + sum(-(-int(n) // page_size) for n in needs), page_size)
    pages_per_slot = max(-(-int(n) // page_size) for n in needs)
    b = len(prompts)
    tables = [PageTable(pool) for _ in prompts]
    table = np.full((b, pages_per_slot), NULL_PAGE, np.int32)
    tcache = target.init_paged_cache(pool.num_pages, page_size, pages_per_slot, b)
    dcache = None if drafter is None else drafter.init_paged_cache(pool.num_pages, page_size, pages_per_slot, b)
    cached = np.zeros((b,), np.int32)
    last = first_key is not None  # (the prompts' last tokens prefilled too, their logits kept)
    logits = [None] * b

    def cover(i):
        covered = tables[i].ensure(int(needs[i]))
        assert covered, "the pool holds every request's pages"
        table[i] = tables[i].as_row(pages_per_slot)

    for wave in prefix_waves(prompts, page_size):
        for i in wave:
            cached[i] = tables[i].admit(prompts[i])  # (at most all but the last token)
            cover(i)
        end = [len(prompts[i]) - (0 if last else 1) for i in wave]
        counts = np.array([e - cached[i] for e, i in zip(end, wave, strict=True)], np.int32)
        ids = np.zeros((len(wave), max(1, int(counts.max()))), np.int32)
        for r, i in enumerate(wave):
            ids[r, :counts[r]] = prompts[i][cached[i]:end[r]]
        tcache, dcache = _with_table(tcache, table), _with_table(dcache, table)
        out = prefill_rows(models, tparams, dparams, plan, tcache, dcache, jnp.asarray(wave, jnp.int32),
                           jnp.asarray(ids), jnp.asarray(cached[wave]), jnp.asarray(counts), last=last)
        tcache, dcache = out[:2]
        for r, i in enumerate(wave):
            if last:
                logits[i] = out[2][r]
            # commit gives back the pages past the prompt; cover takes the decoding's pages again
            tables[i].commit(end[r])
            tables[i].publish(prompts[i][: end[r]])
            cover(i)
    state = _start(_with_table(tcache, table), _with_table(dcache, table), roots, **per_row)
    if last:
        state = state.with_first_tokens(first_tokens(jnp.stack(logits), state.sampling, state.request_ids,
                                                     first_key, plan.backend))
    return state, cached


def _with_table(cache, table: np.ndarray):
    return None if cache is None else dataclasses.replace(cache, page_table=jnp.asarray(table))


# compiled, so that the state's fields are distinct buffers (the rounds donate the state)
_start = jax.jit(DecodeState.start, static_argnames=("capacity",))


@jax.jit
def without_pages(state: DecodeState, rows: jax.Array) -> DecodeState:
    """``state`` with the page-table rows of ``rows [B]`` (bool) set to the null page in both
    caches: rows that hold no request (generate's padding after compaction, copies of a running
    row) then write nothing and read zeros, so they cannot touch the pages of the row they copy."""
    def null(cache):
        return cache if cache is None else dataclasses.replace(
            cache, page_table=jnp.where(rows[:, None], NULL_PAGE, cache.page_table))

    return dataclasses.replace(state, target_cache=null(state.target_cache), draft_cache=null(state.draft_cache))
