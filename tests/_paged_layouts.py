"""Random page tables and the plain position-by-position gather and scatter that the paged
cache tests compare against (tests/test_paged_cache.py, tests/test_paged_attention.py)."""

import numpy as np


def random_page_table(rng, owned, pages_per_slot, shared=0, spare=2):
    """``(table [B, pages_per_slot] int32, num_pages)``: row b maps its first ``owned[b]`` entries to
    pool pages drawn in random order from ``1 .. num_pages - 1`` (``spare`` pages stay unused) and
    the rest to the null page 0; row 1's first ``shared`` entries are row 0's first ``shared``
    pages (a read-only common prefix), its own pages after them."""
    own = [n - (shared if b == 1 else 0) for b, n in enumerate(owned)]
    num_pages = 1 + sum(own) + spare
    pages = iter(rng.permutation(np.arange(1, num_pages)))
    table = np.zeros((len(owned), pages_per_slot), np.int32)
    for b, n in enumerate(owned):
        table[b, :n] = [next(pages) for _ in range(n)]
    table[1, :shared] = table[0, :shared]
    return table, num_pages


def random_pool(rng, num_pages, page_size, *tail):
    """A float32 pool of random entries, the null page 0 all zeros."""
    pool = rng.standard_normal((num_pages, page_size, *tail)).astype(np.float32)
    pool[0] = 0
    return pool


def plain_gather(pool, table, length):
    """``[B, length, ...]``: position p of row b from its page, zeros where the entry is the null
    page or p is past the table."""
    pool, table = np.asarray(pool), np.asarray(table)
    size = pool.shape[1]
    out = np.zeros((table.shape[0], length, *pool.shape[2:]), pool.dtype)
    for b in range(table.shape[0]):
        for p in range(length):
            if p // size < table.shape[1] and table[b, p // size] != 0:
                out[b, p] = pool[table[b, p // size], p % size]
    return out


def plain_scatter(pool, table, view):
    """``pool`` with position p of row b set to ``view[b, p]`` wherever row b's table maps p to a
    page other than the null page."""
    pool, table, view = np.array(pool), np.asarray(table), np.asarray(view)
    size = pool.shape[1]
    for b in range(table.shape[0]):
        for p in range(view.shape[1]):
            if p // size < table.shape[1] and table[b, p // size] != 0:
                pool[table[b, p // size], p % size] = view[b, p]
    return pool
