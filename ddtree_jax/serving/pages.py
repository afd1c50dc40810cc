"""Host-side bookkeeping of paged caches: a pool of pages, one page table per request, a prefix
cache over full pages, and the admission and preemption helpers the serving engine calls.

Pure Python and numpy (no JAX); the device side reads a table through ``PageTable.as_row``.
Design note: ``docs/paged-caches.md``.

* ``PagePool(num_pages, page_size)``: pages ``1 .. num_pages - 1`` of ``page_size`` positions
  (a power of two). Page 0 is the null page: never allocated, the target of every unused
  page-table entry, its contents never meaningful. Every other page is exactly one of

  - free: on the free list;
  - referenced: held by ``refcount >= 1`` page tables (it may also be in the prefix cache);
  - cached: in the prefix cache and held by none, evictable, least recently released first.

  ``allocate`` hands out fresh private pages (free ones first, then evicting cached ones);
  ``incref`` / ``release`` count references. The prefix cache maps the key of a full page (a
  BLAKE2b digest of the previous page's key and the page's token ids, ``page_keys``) to the page
  holding it: ``match_prefix`` takes the longest cached run of full pages of a token sequence,
  ``insert_prefix`` registers a request's full pages. ``check`` verifies every invariant.
* ``PageTable(pool)``: the pages of one request in position order (reusable across requests of
  one slot). ``admit`` matches the prefix cache, ``ensure`` covers positions, ``commit`` records
  the committed length and returns the pages past it, ``publish`` registers the committed full
  pages, ``release_all`` empties it, ``as_row`` gives the device row. Its first ``read_only``
  pages are those it matched or published (in the prefix cache, or private duplicates of cached
  pages) and are never written again; every page after them is private (one reference, no key),
  and a round writes only at positions at or past ``length >= read_only * page_size``. That is the
  whole copy-on-write rule: no shared page is ever a write target, so no page is ever copied.
* ``preemption_order(tables)``: the running tables, the most recently admitted first.

Cache convention followed: a request whose tokens so far are ``t`` (its prompt, then what it
generated) holds ``len(t) - 1`` positions (all but the last token, the root of its next round); a
round writes up to one block of scratch past that length, then keeps the accepted positions.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import weakref
from collections.abc import Iterable, Sequence

import numpy as np

from ddtree_jax.config import ConfigError, is_int

__all__ = ["PagePool", "PageTable", "page_keys", "preemption_order"]

NULL_PAGE = 0
KEY_BYTES = 32
_TOKEN_LIMIT = 2**31


def _bad(where: str, message: str) -> ValueError:
    return ValueError(f"{where}: {message}")


def _as_tokens(tokens, where: str) -> np.ndarray:
    """``tokens`` as a 1-D little-endian int32 array, each id in ``[0, 2**31)``."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise _bad(where, f"tokens must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros((0,), "<i4")
    if not np.issubdtype(arr.dtype, np.integer):
        raise _bad(where, f"tokens must be integer token ids, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) >= _TOKEN_LIMIT:
        raise _bad(where, f"tokens must be in [0, 2**31), got [{int(arr.min())}, {int(arr.max())}]")
    return arr.astype("<i4")


def _page_key(parent: bytes, page_tokens: np.ndarray) -> bytes:
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(page_tokens.tobytes())
    return h.digest()


def _keys(arr: np.ndarray, page_size: int) -> Iterable[bytes]:
    """The keys of the full pages of ``arr`` (an ``_as_tokens`` array), in order, lazily."""
    parent = b""
    for k in range(arr.size // page_size):
        parent = _page_key(parent, arr[k * page_size:(k + 1) * page_size])
        yield parent


def page_keys(tokens: Sequence[int] | np.ndarray, page_size: int) -> list[bytes]:
    """The prefix-cache keys of the full pages of ``tokens`` (``len(tokens) // page_size`` keys of
    ``KEY_BYTES`` bytes): key ``k`` is ``blake2b(key[k-1] + int32-LE bytes of tokens[kP:(k+1)P])``
    (no ``key[-1]`` for the first page), so equal keys mean equal whole prefixes, and keys are the
    same in every process and on every machine."""
    if not (is_int(page_size) and page_size >= 1):
        raise _bad("page_keys", f"page_size must be an integer >= 1, got {page_size!r}")
    return list(_keys(_as_tokens(tokens, "page_keys"), page_size))


class PagePool:
    """``num_pages`` pages of ``page_size`` positions (page 0 the null page), their reference
    counts, the prefix cache and its LRU eviction order. Not thread-safe: one engine thread owns it.

    Counts: ``free_pages`` (free plus cached: what ``allocate`` can hand out now), ``used`` (pages
    held by a table), ``shared`` (held by more than one), ``cached`` (in the prefix cache, held by
    none), ``hashed`` (in the prefix cache, held or not); ``free_pages + used == num_pages - 1``.
    """

    def __init__(self, num_pages: int, page_size: int):
        if not (is_int(num_pages) and num_pages >= 2):
            raise ConfigError("PagePool", "num_pages",
                              f"must be an integer >= 2 (page 0 is the null page), got {num_pages!r}")
        if not (is_int(page_size) and page_size >= 1 and page_size & (page_size - 1) == 0):
            raise ConfigError("PagePool", "page_size", f"must be a power of two >= 1, got {page_size!r}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self._refs = [0] * self.num_pages
        self._free = list(range(self.num_pages - 1, NULL_PAGE, -1))  # a stack: page 1 is handed out first
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, oldest first
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._used = 0
        self._shared = 0
        self._tables: weakref.WeakSet[PageTable] = weakref.WeakSet()
        self._admissions = itertools.count()
        self._counters = dict.fromkeys(("prefix_queries", "prefix_query_tokens", "prefix_hit_tokens",
                                        "allocated", "evicted"), 0)

    @property
    def free_pages(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def used(self) -> int:
        return self._used

    @property
    def shared(self) -> int:
        return self._shared

    @property
    def cached(self) -> int:
        return len(self._lru)

    @property
    def hashed(self) -> int:
        return len(self._page_of)

    def stats(self) -> dict[str, int]:
        """The counts above and the running totals for metrics: ``prefix_queries`` (``match_prefix``
        calls), ``prefix_query_tokens`` / ``prefix_hit_tokens`` (tokens looked up / found),
        ``allocated`` (pages handed out), ``evicted`` (cached pages reclaimed by ``allocate``)."""
        return {"pages": self.num_pages - 1, "page_size": self.page_size, "free": self.free_pages,
                "used": self.used, "shared": self.shared, "cached": self.cached, "hashed": self.hashed,
                **self._counters}

    def pages_for(self, positions: int) -> int:
        """Pages that cover ``positions`` positions: ``ceil(positions / page_size)``."""
        if not (is_int(positions) and positions >= 0):
            raise _bad("PagePool.pages_for", f"positions must be an integer >= 0, got {positions!r}")
        return -(-int(positions) // self.page_size)

    # ----- references

    def _check_pages(self, pages: Sequence[int], where: str) -> None:
        for page in pages:
            if not (is_int(page) and NULL_PAGE < page < self.num_pages):
                raise _bad(where, f"page {page!r} is not a page of this pool (1 .. {self.num_pages - 1})")

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh pages, each held once and in no prefix cache entry: free pages first, then
        cached ones evicted least recently released first. ``None``, changing nothing, when fewer
        than ``n`` are available (``free_pages``)."""
        if not (is_int(n) and n >= 0):
            raise _bad("PagePool.allocate", f"n must be an integer >= 0, got {n!r}")
        if n > self.free_pages:
            return None
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._lru.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
                self._counters["evicted"] += 1
            self._refs[page] = 1
            out.append(page)
        self._used += n
        self._counters["allocated"] += n
        return out

    def incref(self, pages: Sequence[int]) -> None:
        """One more reference to each of ``pages`` (each held, or cached: a cached page leaves the
        eviction order). Checks every page before changing anything."""
        self._check_pages(pages, "PagePool.incref")
        for page in pages:
            if self._refs[page] == 0 and page not in self._lru:
                raise _bad("PagePool.incref", f"page {page} is free (neither held nor cached)")
        for page in pages:
            self._hold(page)

    def _hold(self, page: int) -> None:
        if self._refs[page] == 0:
            del self._lru[page]
            self._used += 1
        elif self._refs[page] == 1:
            self._shared += 1
        self._refs[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """One reference less to each of ``pages`` (given in position order; each must be held as
        often as it appears). A page left unreferenced goes back to the free list, or, when it is in
        the prefix cache, to the end of the eviction order; the pages of one call are released last
        first, so a prefix's later pages are evicted before its earlier ones. Checks every page
        before changing anything."""
        self._check_pages(pages, "PagePool.release")
        for page, times in collections.Counter(pages).items():
            if self._refs[page] < times:
                raise _bad("PagePool.release", f"page {page} is released {times}x but held {self._refs[page]}x")
        for page in reversed(pages):
            self._drop(page)

    def _drop(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 1:
            self._shared -= 1
        elif self._refs[page] == 0:
            self._used -= 1
            if page in self._key_of:
                self._lru[page] = None
            else:
                self._free.append(page)

    # ----- prefix cache

    def _lookup(self, arr: np.ndarray) -> list[int]:
        """The pages of the longest cached run of full pages of ``arr``; changes nothing."""
        pages = []
        for key in _keys(arr, self.page_size):
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def match_prefix(self, tokens: Sequence[int] | np.ndarray) -> tuple[list[int], int]:
        """``(pages, n_tokens)``: the longest run of cached full pages holding a prefix of
        ``tokens``, each now held once more (leaving the eviction order), and the ``n_tokens`` (a
        multiple of ``page_size``) they hold. The caller owns the references."""
        arr = _as_tokens(tokens, "PagePool.match_prefix")
        pages = self._lookup(arr)
        self.incref(pages)
        n_tokens = len(pages) * self.page_size
        self._counters["prefix_queries"] += 1
        self._counters["prefix_query_tokens"] += arr.size
        self._counters["prefix_hit_tokens"] += n_tokens
        return pages, n_tokens

    def insert_prefix(self, tokens: Sequence[int] | np.ndarray, pages: Sequence[int]) -> None:
        """Register the full pages of a request whose ``pages`` (held, in position order) hold
        ``tokens`` at positions ``0 .. len(tokens) - 1``: page ``k`` (for ``(k + 1) * page_size <=
        len(tokens)``) enters the prefix cache under its key. A key already cached keeps its page (the
        request's duplicate stays private); a page already registered must carry the same key.
        Checks everything before changing anything."""
        arr = _as_tokens(tokens, "PagePool.insert_prefix")
        full = arr.size // self.page_size
        if len(pages) < full:
            raise _bad("PagePool.insert_prefix", f"pages: {len(pages)} pages cannot hold the {full} full pages "
                                                 f"of {arr.size} tokens")
        self._check_pages(pages[:full], "PagePool.insert_prefix")
        new = {}
        for page, key in zip(pages, _keys(arr, self.page_size), strict=False):
            if self._refs[page] == 0:
                raise _bad("PagePool.insert_prefix", f"pages: page {page} is not held")
            have = self._key_of.get(page)
            if have is not None and have != key:
                raise _bad("PagePool.insert_prefix", f"tokens: page {page} is registered with another prefix")
            if have is None and key not in self._page_of:
                new[key] = page
        for key, page in new.items():
            self._page_of[key] = page
            self._key_of[page] = key

    # ----- admission

    def admission_pages(self, tokens: Sequence[int] | np.ndarray, margin_positions: int) -> int:
        """The pages admitting a request with ``tokens`` (its prompt, or prompt and generated tokens
        when it resumes; the last is the root) would take from ``free_pages``: pages covering its
        ``len(tokens) - 1`` cached positions plus ``margin_positions`` (scratch for its first rounds
        or prefill chunks), less those ``PageTable.admit`` would match, plus the matched pages that
        are cached now (matching them takes them off the free count). Changes nothing."""
        arr = _as_tokens(tokens, "PagePool.admission_pages")
        if arr.size == 0:
            raise _bad("PagePool.admission_pages", "tokens must hold at least the root token")
        if not (is_int(margin_positions) and margin_positions >= 0):
            raise _bad("PagePool.admission_pages",
                       f"margin_positions must be an integer >= 0, got {margin_positions!r}")
        hit = self._lookup(arr[:-1])
        return (self.pages_for(arr.size - 1 + int(margin_positions)) - len(hit)
                + sum(self._refs[page] == 0 for page in hit))

    def can_admit(self, tokens: Sequence[int] | np.ndarray, margin_positions: int) -> bool:
        """Whether ``admission_pages(tokens, margin_positions)`` pages are available now: then
        ``PageTable.admit(tokens)`` followed by ``ensure(len(tokens) - 1 + margin_positions)``
        succeeds."""
        return self.admission_pages(tokens, margin_positions) <= self.free_pages

    # ----- invariants

    def check(self, holders: Iterable[Sequence[int]] | None = None) -> None:
        """Verify every invariant, raising ``AssertionError`` naming each one broken: each page is
        exactly one of null, free, referenced, cached; each refcount equals the number of holders
        holding the page (``holders``: lists of pages, default every page table of this pool); the
        counts agree (``free_pages + used == num_pages - 1``); the prefix map and its reverse agree;
        and per page table, ``read_only * page_size <= length <= capacity``, no page twice, and every
        page past the read-only prefix private (held once, no key)."""
        problems = []
        tables = list(self._tables) if holders is None else []
        held = collections.Counter()
        for pages in ([t._pages for t in tables] if holders is None else holders):
            held.update(pages)
        bad = [p for p in held if not (is_int(p) and 0 <= p < self.num_pages)]
        if bad:
            problems.append(f"holders hold pages outside the pool: {sorted(bad)[:8]}")
        if held[NULL_PAGE] or self._refs[NULL_PAGE] or NULL_PAGE in self._lru or NULL_PAGE in self._key_of:
            problems.append("the null page 0 is held, cached or registered")
        free = collections.Counter(self._free)
        dup = [p for p, c in free.items() if c > 1]
        if dup:
            problems.append(f"pages on the free list twice: {dup[:8]}")
        if NULL_PAGE in free:
            problems.append("the null page 0 is on the free list")
        for page in range(1, self.num_pages):
            states = [name for name, on in (("free", page in free), ("cached", page in self._lru),
                                            ("referenced", self._refs[page] > 0)) if on]
            if len(states) != 1:
                problems.append(f"page {page} is {' and '.join(states) or 'in no state (leaked)'}")
            if page in free and page in self._key_of:
                problems.append(f"page {page} is free but registered in the prefix cache")
            if page in self._lru and page not in self._key_of:
                problems.append(f"page {page} is cached but has no key")
            if self._refs[page] != held[page]:
                problems.append(f"page {page} has refcount {self._refs[page]} but {held[page]} holders")
        used = sum(r > 0 for r in self._refs)
        shared = sum(r > 1 for r in self._refs)
        if (used, shared) != (self._used, self._shared):
            problems.append(f"counted used {self._used}, shared {self._shared}; actual {used}, {shared}")
        if len(self._free) + len(self._lru) + used != self.num_pages - 1:
            problems.append(f"free {len(self._free)} + cached {len(self._lru)} + used {used} "
                            f"!= {self.num_pages - 1} pages")
        if len(self._key_of) != len(self._page_of) or any(self._page_of.get(k) != p for p, k in self._key_of.items()):
            problems.append("the prefix map and its reverse disagree")
        for t in tables:
            problems += [f"page table (admitted {t.admitted}): {m}" for m in t._problems()]
        if problems:
            raise AssertionError("PagePool.check: " + "; ".join(problems[:12])
                                 + (f"; and {len(problems) - 12} more" if len(problems) > 12 else ""))


class PageTable:
    """The pages of one request, in position order: page ``k`` holds positions
    ``k * page_size .. (k + 1) * page_size - 1``. One per engine slot, reused by its requests.

    ``length``: the committed positions (the request's tokens but the last); ``read_only``: the
    leading pages it matched or published, never written again (``read_only * page_size <= length``);
    ``admitted``: the pool's admission number of the current request (``None`` when empty);
    ``capacity``: the positions its pages cover. A round writes positions ``length ..
    length + scratch - 1`` after ``ensure(length + scratch)``, all in private pages.
    """

    def __init__(self, pool: PagePool):
        self.pool = pool
        self._pages: list[int] = []
        self.length = 0
        self.read_only = 0
        self.admitted: int | None = None
        pool._tables.add(self)

    @property
    def pages(self) -> tuple[int, ...]:
        return tuple(self._pages)

    @property
    def capacity(self) -> int:
        return len(self._pages) * self.pool.page_size

    @property
    def reclaimable(self) -> int:
        """Pages ``release_all`` would add to ``pool.free_pages``: those no other table holds."""
        return sum(self.pool._refs[page] == 1 for page in self._pages)

    def admit(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Start a request whose tokens so far are ``tokens`` (its prompt, or prompt and generated
        tokens when it resumes; the last is the root of its next round): take a fresh admission
        number and the longest cached prefix of ``tokens[:-1]`` (its cacheable positions), and return
        ``length``, the positions those pages already hold (a multiple of ``page_size``); the request
        computes positions ``length .. len(tokens) - 2``. The table must be empty."""
        if self.admitted is not None:
            raise _bad("PageTable.admit", "the table holds a request; release_all it first")
        arr = _as_tokens(tokens, "PageTable.admit")
        if arr.size == 0:
            raise _bad("PageTable.admit", "tokens must hold at least the root token")
        self._pages, self.length = self.pool.match_prefix(arr[:-1])
        self.read_only = len(self._pages)
        self.admitted = next(self.pool._admissions)
        return self.length

    def ensure(self, positions: int) -> bool:
        """Cover ``positions`` positions, adding fresh private pages; ``False``, allocating nothing,
        when the pool has too few (the engine then preempts, ``preemption_order``)."""
        if self.admitted is None:
            raise _bad("PageTable.ensure", "no request is admitted (admit first)")
        missing = self.pool.pages_for(positions) - len(self._pages)
        if missing <= 0:
            return True
        pages = self.pool.allocate(missing)
        if pages is None:
            return False
        self._pages += pages
        return True

    def commit(self, length: int, keep: int = 0) -> None:
        """The first ``length`` positions now hold the request's cache (after a prefill chunk or a
        round kept its accepted positions): record it and return the pages past
        ``max(length, keep)`` positions to the pool (``keep``: positions to go on covering, e.g. the
        scratch of rounds still to run). ``length`` must lie in ``[read_only * page_size,
        capacity]``: read-only pages are never cut."""
        if self.admitted is None:
            raise _bad("PageTable.commit", "no request is admitted (admit first)")
        lo = self.read_only * self.pool.page_size
        if not (is_int(length) and lo <= length <= self.capacity):
            raise _bad("PageTable.commit", f"length must be an integer in [{lo}, {self.capacity}] (read-only "
                                           f"prefix to capacity), got {length!r}")
        if not (is_int(keep) and keep >= 0):
            raise _bad("PageTable.commit", f"keep must be an integer >= 0, got {keep!r}")
        keep = self.pool.pages_for(max(int(length), int(keep)))
        self.pool.release(self._pages[keep:])
        del self._pages[keep:]
        self.length = int(length)

    def publish(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Register the full pages among the first ``len(tokens)`` committed positions, which hold
        ``tokens`` (``len(tokens) <= length``), in the prefix cache (``PagePool.insert_prefix``);
        they join the read-only prefix."""
        arr = _as_tokens(tokens, "PageTable.publish")
        if arr.size > self.length:
            raise _bad("PageTable.publish", f"tokens: {arr.size} tokens, but only {self.length} positions "
                                            "are committed")
        self.pool.insert_prefix(arr, self._pages)
        self.read_only = max(self.read_only, arr.size // self.pool.page_size)

    def release_all(self) -> None:
        """Return every page to the pool (finish, cancellation, preemption); the table is empty."""
        self.pool.release(self._pages)
        self._pages = []
        self.length = self.read_only = 0
        self.admitted = None

    def as_row(self, max_pages: int) -> np.ndarray:
        """The device page-table row: int32 ``[max_pages]``, the pages then the null page 0."""
        if not (is_int(max_pages) and max_pages >= len(self._pages)):
            raise _bad("PageTable.as_row", f"max_pages must be an integer >= {len(self._pages)} (the pages "
                                           f"held), got {max_pages!r}")
        row = np.zeros((max_pages,), np.int32)
        row[:len(self._pages)] = self._pages
        return row

    def _problems(self) -> list[str]:
        out = []
        P = self.pool.page_size
        if not self.read_only * P <= self.length <= self.capacity:
            out.append(f"read_only {self.read_only} pages, length {self.length}, capacity {self.capacity} "
                       "out of order")
        if len(set(self._pages)) != len(self._pages):
            out.append("holds a page twice")
        if self.admitted is None and (self._pages or self.length or self.read_only):
            out.append("not admitted but holds pages")
        for k in range(self.read_only, len(self._pages)):
            page = self._pages[k]
            if self.pool._refs[page] != 1 or page in self.pool._key_of:
                out.append(f"page {page} at index {k}, past the read-only prefix, is shared or cached "
                           "(a write target must be private)")
        return out


def preemption_order(tables: Iterable[PageTable]) -> list[PageTable]:
    """The admitted tables of ``tables``, the most recently admitted first: the engine preempts
    them in this order (release_all, requeue the request with its generated tokens) until its
    ``ensure`` succeeds (docs/paged-caches.md, "Admission and preemption")."""
    return sorted((t for t in tables if t.admitted is not None), key=lambda t: -t.admitted)
