"""The host side of paged caches (``ddtree_jax.serving.pages``): allocation and the null page,
reference counts, LRU eviction order, the prefix cache (hits, misses, divergence inside a page,
duplicates), the copy-on-write rule of page tables, admission accounting, preemption order, errors
naming their field, keys equal across processes, ``check()`` catching planted bugs, and a seeded
fuzz of an engine's life (arrivals from shared prefixes, chunked prefills, rounds, cancellations,
preemptions, finishes) that simulates page contents and checks every invariant after each step."""

import collections
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

from ddtree_jax.config import ConfigError
from ddtree_jax.serving.pages import KEY_BYTES, PagePool, PageTable, page_keys, preemption_order


def _table(pool, tokens, positions=0):
    """A table admitted for ``tokens``, its ``len(tokens) - 1`` cacheable positions committed, then
    covering ``positions`` (scratch past them)."""
    t = PageTable(pool)
    t.admit(tokens)
    assert t.ensure(len(tokens) - 1)
    t.commit(len(tokens) - 1)
    assert t.ensure(positions)
    return t


# ----- construction and errors


@pytest.mark.parametrize("field,kwargs", [
    ("num_pages", dict(num_pages=1, page_size=4)),
    ("num_pages", dict(num_pages=True, page_size=4)),
    ("num_pages", dict(num_pages=8.0, page_size=4)),
    ("page_size", dict(num_pages=8, page_size=0)),
    ("page_size", dict(num_pages=8, page_size=3)),
    ("page_size", dict(num_pages=8, page_size=12)),
    ("page_size", dict(num_pages=8, page_size=-4)),
])
def test_bad_construction_names_the_field(field, kwargs):
    with pytest.raises(ConfigError, match=rf"^PagePool\.{field}: ") as err:
        PagePool(**kwargs)
    assert err.value.field == field


def test_bad_calls_name_the_argument_and_change_nothing():
    pool = PagePool(8, 2)
    t = _table(pool, [1, 2, 3, 4, 5])
    before = (pool.stats(), t.pages, t.length)
    for call, match in [
        (lambda: pool.allocate(-1), r"PagePool\.allocate: n must"),
        (lambda: pool.pages_for(-1), r"PagePool\.pages_for: positions must"),
        (lambda: pool.release([0]), r"PagePool\.release: page 0 is not a page"),
        (lambda: pool.release([8]), r"PagePool\.release: page 8 is not a page"),
        (lambda: pool.release([t.pages[0], t.pages[0]]), r"released 2x but held 1x"),
        (lambda: pool.release([t.pages[1], 7]), r"page 7 is released 1x but held 0x"),
        (lambda: pool.incref([t.pages[0], 7]), r"PagePool\.incref: page 7 is free"),
        (lambda: pool.match_prefix([[1, 2]]), r"PagePool\.match_prefix: tokens must be a 1-D"),
        (lambda: pool.match_prefix([1.0, 2.0]), r"tokens must be integer"),
        (lambda: pool.match_prefix([1, -2]), r"tokens must be in \[0, 2\*\*31\)"),
        (lambda: pool.insert_prefix([1, 2, 3, 4, 5, 6], t.pages[:2]), r"insert_prefix: pages: 2 pages cannot"),
        (lambda: pool.insert_prefix([1, 2], [7]), r"insert_prefix: pages: page 7 is not held"),
        (lambda: pool.admission_pages([], 0), r"admission_pages: tokens must hold at least the root"),
        (lambda: pool.admission_pages([1], -1), r"admission_pages: margin_positions must"),
        (lambda: t.admit([1, 2]), r"PageTable\.admit: the table holds a request"),
        (lambda: t.commit(5), r"PageTable\.commit: length must be an integer in \[0, 4\]"),
        (lambda: t.publish([1, 2, 3, 4, 5]), r"PageTable\.publish: tokens: 5 tokens, but only 4"),
        (lambda: t.as_row(1), r"PageTable\.as_row: max_pages must be an integer >= 2"),
        (lambda: PageTable(pool).ensure(3), r"PageTable\.ensure: no request is admitted"),
        (lambda: PageTable(pool).commit(0), r"PageTable\.commit: no request is admitted"),
        (lambda: PageTable(pool).admit([]), r"PageTable\.admit: tokens must hold at least the root"),
        (lambda: page_keys([1, 2], 0), r"page_keys: page_size must"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
        assert (pool.stats(), t.pages, t.length) == before
        pool.check()


# ----- allocation, references, the null page


def test_allocate_hands_out_every_page_but_the_null_page_once():
    pool = PagePool(8, 4)
    assert (pool.free_pages, pool.used, pool.shared, pool.cached) == (7, 0, 0, 0)
    got = pool.allocate(5)
    assert got == [1, 2, 3, 4, 5]
    pool.check(holders=[got])
    assert pool.allocate(3) is None  # not enough: nothing changes
    assert (pool.free_pages, pool.used) == (2, 5)
    more = pool.allocate(2)
    assert sorted(got + more) == list(range(1, 8))
    assert pool.allocate(1) is None and pool.allocate(0) == []
    pool.check(holders=[got, more])
    pool.release(got + more)
    assert (pool.free_pages, pool.used) == (7, 0)
    pool.check(holders=[])


def test_reference_counts_and_shared_pages():
    pool = PagePool(6, 2)
    a = pool.allocate(3)
    pool.incref(a[:2])
    pool.incref(a[:1])
    assert (pool.used, pool.shared) == (3, 2)
    pool.check(holders=[a, a[:2], a[:1]])
    pool.release(a[:1])
    assert (pool.used, pool.shared) == (3, 2)
    pool.check(holders=[a, a[:2]])
    pool.release(a)
    assert (pool.used, pool.shared, pool.free_pages) == (2, 0, 3)
    pool.check(holders=[a[:2]])
    with pytest.raises(AssertionError, match=r"page 3 has refcount 0 but 1 holders"):
        pool.check(holders=[a])
    pool.release(a[:2])
    assert (pool.used, pool.shared, pool.free_pages) == (0, 0, 5)
    pool.check(holders=[])


def test_as_row_points_past_the_end_at_the_null_page():
    pool = PagePool(16, 4)
    t = _table(pool, list(range(11)))  # 10 cached positions: 3 pages
    row = t.as_row(6)
    assert row.dtype == np.int32 and row.tolist() == [*t.pages, 0, 0, 0]
    assert 0 not in t.pages
    t.release_all()
    assert t.as_row(2).tolist() == [0, 0]
    pool.check()


# ----- eviction order


def test_cached_pages_are_evicted_least_recently_released_first():
    P = 2
    pool = PagePool(9, P)
    a = _table(pool, [1, 1, 1, 1, 9])  # 2 full pages
    b = _table(pool, [2, 2, 2, 2, 9])
    a.publish([1, 1, 1, 1])
    b.publish([2, 2, 2, 2])
    a_pages, b_pages = a.pages, b.pages
    a.release_all()  # released later page first: a[1], a[0]
    b.release_all()  # then b[1], b[0]
    assert (pool.cached, pool.hashed, pool.free_pages) == (4, 4, 8)
    pool.check()
    # a hit takes a page off the eviction order; its release puts it last
    c = PageTable(pool)
    assert c.admit([1, 1, 7]) == 2 and c.pages == a_pages[:1]
    assert pool.cached == 3
    pool.check()
    c.release_all()
    # the order is now a[1], b[1], b[0], a[0]
    held = pool.allocate(4)  # the 4 free pages
    assert pool.hashed == 4
    order = [pool.allocate(1)[0] for _ in range(4)]
    held += order
    assert order == [a_pages[1], b_pages[1], b_pages[0], a_pages[0]]
    assert (pool.hashed, pool.stats()["evicted"]) == (0, 4)
    pool.check(holders=[held])


def test_a_prefix_loses_its_tail_first_and_a_republish_reconnects_it():
    P = 2
    pool = PagePool(5, P)
    tokens = [3, 1, 4, 1, 5, 9, 2]
    t = _table(pool, tokens)  # 6 positions: 3 pages
    t.publish(tokens[:6])
    first = t.pages
    t.release_all()
    free = pool.allocate(1)  # the free page, then...
    assert free is not None and free[0] not in first and pool.cached == 3
    evicted = pool.allocate(1)
    assert evicted == [first[2]]  # ...the last page of the prefix goes first
    u = PageTable(pool)
    assert u.admit(tokens) == 4 and u.pages == first[:2]
    pool.check(holders=[free, evicted, u.pages])
    pool.release(free + evicted)
    # the evicted page's key is that of the whole prefix: publishing it again reconnects the chain
    assert u.ensure(6)
    u.commit(6)
    u.publish(tokens[:6])
    u.release_all()
    v = PageTable(pool)
    assert v.admit(tokens) == 6 and v.pages[:2] == first[:2]
    pool.check()


# ----- the prefix cache


def test_prefix_match_hits_misses_and_divergence_inside_a_page():
    P = 4
    pool = PagePool(32, P)
    base = list(range(100, 114))  # 14 tokens: 13 cached positions, 3 full pages
    a = _table(pool, base)
    a.publish(base[:13])
    assert (a.read_only, pool.hashed) == (3, 3)
    pool.check()
    cases = [
        (base, 12),  # same prompt: its 13 cacheable positions hold 3 full pages
        (base[:9], 8),  # shorter: 8 cacheable positions, 2 full pages
        (base[:8] + [7, 7, 7], 8),  # diverges at a page boundary
        (base[:10] + [7, 7, 7], 8),  # diverges in the middle of the third page: only 2 pages match
        (base[:5] + [7] + base[6:], 4),  # diverges in the middle of the second page
        ([7] + base[1:], 0),  # diverges at the first token
        (base[:4], 0),  # 3 cacheable positions: no full page
        ([100 + i for i in range(13)] + [5], 12),  # 13 cacheable positions equal base's
    ]
    for tokens, hit in cases:
        t = PageTable(pool)
        assert t.admit(tokens) == hit, tokens
        assert t.pages == a.pages[:hit // P] and t.read_only == hit // P and t.length == hit
        assert pool.shared == hit // P
        pool.check()
        t.release_all()
    stats = pool.stats()
    assert stats["prefix_queries"] == 1 + len(cases)
    assert stats["prefix_hit_tokens"] == sum(h for _, h in cases)
    assert stats["prefix_query_tokens"] == len(base) - 1 + sum(len(t) - 1 for t, _ in cases)


def test_insert_keeps_the_cached_page_and_the_duplicate_stays_private():
    P = 2
    pool = PagePool(16, P)
    tokens = [5, 6, 7, 8, 9, 10, 11]
    a = _table(pool, tokens)
    b = _table(pool, tokens)  # computed the same prefix before a published it
    a.publish(tokens[:6])
    b.publish(tokens[:6])
    assert pool.hashed == 3 and pool.shared == 0  # b's duplicates were not registered
    assert set(a.pages).isdisjoint(b.pages)
    pool.check()
    b.release_all()  # its duplicates go back to the free list, not to the cache
    assert (pool.cached, pool.free_pages) == (0, 15 - 3)
    c = PageTable(pool)
    assert c.admit(tokens) == 6 and c.pages == a.pages
    pool.check()
    # publishing again, or a prefix of what was published, changes nothing
    a.publish(tokens[:6])
    a.publish(tokens[:3])
    assert pool.hashed == 3
    # a page registered under one prefix cannot be registered under another
    with pytest.raises(ValueError, match=r"insert_prefix: tokens: page \d+ is registered with another prefix"):
        pool.insert_prefix([5, 6, 0, 0], a.pages)
    pool.check()


def test_a_duplicate_registers_after_the_cached_page_is_evicted():
    P = 2
    pool = PagePool(5, P)
    tokens = [1, 2, 3]
    a = _table(pool, tokens)
    a.publish(tokens[:2])
    a.release_all()
    b = _table(pool, [1, 2, 4])  # matches a's page
    assert b.read_only == 1
    b.release_all()
    victims = pool.allocate(4)  # evicts the cached page too
    assert pool.hashed == 0
    pool.release(victims)
    c = _table(pool, tokens)
    assert c.read_only == 0
    c.publish(tokens[:2])
    assert pool.hashed == 1 and c.read_only == 1
    pool.check()


def test_page_keys_chain_the_whole_prefix():
    keys = page_keys([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(keys) == 3 and all(len(k) == KEY_BYTES for k in keys)
    assert page_keys([1, 2, 3, 4], 2) == keys[:2]
    assert page_keys(np.array([1, 2, 3, 4], np.int64), 2) == keys[:2]
    assert page_keys([9, 9, 3, 4], 2)[1] != keys[1]  # same page tokens, other prefix
    assert page_keys([1, 2, 3, 4], 4)[0] != keys[1]
    assert page_keys([], 2) == [] and page_keys([1], 2) == []


_KEYS_SCRIPT = """
import sys
from ddtree_jax.serving.pages import page_keys
assert "jax" not in sys.modules, "importing the page bookkeeping imports JAX"
print(",".join(k.hex() for k in page_keys(list(range(1000, 1011)) + [2**31 - 1], 4)))
"""


def test_page_keys_are_the_same_in_every_process():
    here = ",".join(k.hex() for k in page_keys(list(range(1000, 1011)) + [2**31 - 1], 4))
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _KEYS_SCRIPT], env=env, capture_output=True, text=True,
                             check=True)
        assert out.stdout.strip() == here


# ----- page tables: the copy-on-write rule


def test_a_whole_cached_prompt_leaves_the_write_target_in_a_fresh_page():
    P = 4
    pool = PagePool(32, P)
    prompt = list(range(50, 59))  # 9 tokens: 8 cacheable positions, exactly 2 pages
    a = _table(pool, prompt)
    a.publish(prompt[:8])
    b = PageTable(pool)
    assert b.admit(prompt) == 8 and b.pages == a.pages
    assert b.ensure(8 + 5)  # the first round: root at position 8 and 4 more
    assert b.pages[:2] == a.pages and b.pages[2] not in a.pages and b.read_only == 2
    pool.check()
    # the round writes positions 8.. : page index 2 onward, held by b alone
    assert 8 // P >= b.read_only


def test_a_prompt_ending_on_a_page_boundary_recomputes_its_last_page():
    P = 4
    pool = PagePool(32, P)
    prompt = list(range(50, 59))
    a = _table(pool, prompt)
    a.publish(prompt[:8])
    b = PageTable(pool)
    # 8 tokens: the root is position 7, inside the second cached page, so only the first matches
    assert b.admit(prompt[:8]) == 4 and b.pages == a.pages[:1]
    assert b.ensure(7 + 5) and b.pages[1] != a.pages[1]
    pool.check()


def test_the_read_only_prefix_is_never_cut_and_only_private_pages_follow_it():
    P = 2
    pool = PagePool(16, P)
    tokens = [1, 2, 3, 4, 5, 6]
    a = _table(pool, tokens, positions=9)
    a.publish(tokens[:4])
    assert a.read_only == 2
    with pytest.raises(ValueError, match=r"commit: length must be an integer in \[4, 10\]"):
        a.commit(3)
    a.commit(4)  # cutting to the read-only prefix is fine
    assert len(a.pages) == 2
    assert a.ensure(7)
    pool.check()
    # registering a page past the read-only prefix behind the table's back breaks the rule
    pool.insert_prefix(tokens[:6], a.pages)
    with pytest.raises(AssertionError, match=r"past the read-only prefix, is shared or cached"):
        pool.check()


def test_check_flags_a_page_past_the_read_only_prefix_held_twice():
    pool = PagePool(8, 2)
    a = _table(pool, [1, 2, 3, 4])
    pool.incref(a.pages[-1:])
    with pytest.raises(AssertionError, match=r"refcount 2 but 1 holders.*is shared or cached"):
        pool.check()


def test_ensure_and_commit():
    P = 4
    pool = PagePool(6, P)  # 5 pages
    t = PageTable(pool)
    assert t.admit([1, 2, 3]) == 0 and t.pages == ()
    assert t.ensure(9) and len(t.pages) == 3 and t.capacity == 12
    assert t.ensure(12) and len(t.pages) == 3  # covered already
    assert not t.ensure(25) and len(t.pages) == 3  # 7 pages: none allocated
    assert t.ensure(20) and pool.free_pages == 0
    t.commit(9)  # keeps 3 pages
    assert (t.length, len(t.pages), pool.free_pages) == (9, 3, 2)
    t.commit(12)
    assert (t.length, len(t.pages)) == (12, 3)
    pool.check()
    t.release_all()
    assert (t.length, t.read_only, t.admitted, t.pages, pool.free_pages) == (0, 0, None, (), 5)
    pool.check()


# ----- admission and preemption


def test_can_admit_counts_matched_pages_and_the_cached_ones_among_them():
    P = 2
    pool = PagePool(8, P)  # 7 pages
    prompt = [1, 2, 3, 4, 5, 6, 7]  # 6 cacheable positions: 3 pages
    a = _table(pool, prompt)
    a.publish(prompt[:6])
    a.release_all()  # 3 cached pages
    assert pool.pages_for(0) == 0 and pool.pages_for(1) == 1 and pool.pages_for(6) == 3
    # a miss: 6 positions + margin 4 = 5 pages
    assert pool.admission_pages([9] * 7, 4) == 5
    # a hit on 3 cached pages: 2 new pages, and the 3 matched leave the free count
    assert pool.admission_pages(prompt, 4) == 5
    # held matched pages cost nothing
    holder = PageTable(pool)
    holder.admit(prompt)
    assert pool.admission_pages(prompt, 4) == 2
    holder.release_all()
    # at the edge: 7 free; margin 8 gives 3 cached + 4 new pages = 7, margin 10 gives 8
    assert pool.can_admit(prompt, 8) and not pool.can_admit(prompt, 10)
    t = PageTable(pool)
    t.admit(prompt)
    assert t.ensure(6 + 8) and pool.free_pages == 0
    pool.check()
    t.release_all()
    # a miss that evicts: the cached pages count as free
    assert pool.can_admit([9] * 7, 8)
    u = PageTable(pool)
    assert u.admit([9] * 7) == 0 and u.ensure(6 + 8) and pool.hashed == 0
    pool.check()


def test_preemption_order_is_most_recently_admitted_first():
    pool = PagePool(32, 2)
    tables = [PageTable(pool) for _ in range(4)]
    for i in (2, 0, 3):
        tables[i].admit([i, i, i])
    assert preemption_order(tables) == [tables[3], tables[0], tables[2]]
    tables[0].release_all()
    tables[0].admit([5])  # readmitted: now the most recent
    assert preemption_order(tables) == [tables[0], tables[3], tables[2]]
    assert preemption_order([]) == []


def test_reclaimable_counts_the_pages_no_other_table_holds():
    pool = PagePool(16, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    a = _table(pool, tokens)
    a.publish(tokens[:5])
    b = _table(pool, tokens, positions=9)  # shares a's 2 full pages, 3 of its own
    assert (a.reclaimable, b.reclaimable) == (1, 3)
    free = pool.free_pages
    b.release_all()
    assert pool.free_pages == free + 3 and a.reclaimable == 3


# ----- the fuzz, and planted bugs it must catch


def _fuzz(seed, steps, P=4, num_pages=24, slots=6, scratch=5, chunk=6):
    """An engine's life on one pool; after every step ``check()`` passes and every running
    request's committed positions hold its tokens (page contents simulated, fresh pages and scratch
    filled with junk). Returns the event counts."""
    rng = np.random.default_rng(seed)
    pool = PagePool(num_pages, P)
    tables = [PageTable(pool) for _ in range(slots)]
    margin = max(scratch, chunk)
    content = {}
    bases = [rng.integers(0, 3, size=int(rng.integers(4, 14))).tolist() for _ in range(3)]
    waiting = collections.deque()
    running = {}  # slot -> [tokens, remaining]
    events = collections.Counter()

    def write(t, start, values):
        for i, v in enumerate(values):
            pos = start + i
            assert pos // P >= t.read_only, "a write into the read-only prefix"
            content[t.pages[pos // P]][pos % P] = v

    def ensure(t, positions):
        old = set(t.pages)
        if not t.ensure(positions):
            return False
        for page in t.pages:
            if page not in old:
                content[page] = np.full(P, -1)  # a fresh page holds junk
        return True

    def stop(slot, publish):
        t = tables[slot]
        if publish:
            t.publish(running[slot][0][:t.length])
        t.release_all()
        return running.pop(slot)

    def verify():
        pool.check()
        events["most_shared"] = max(events["most_shared"], pool.shared)
        for slot, (tokens, _) in running.items():
            t = tables[slot]
            held = np.concatenate([content[p] for p in t.pages]) if t.pages else np.zeros(0, int)
            assert held[:t.length].tolist() == tokens[:t.length]
            assert t.length <= len(tokens) - 1
            row = t.as_row(16)
            assert row[:len(t.pages)].tolist() == list(t.pages) and not row[len(t.pages):].any()

    def arrive():
        base = bases[int(rng.integers(3))]
        prompt = base[:int(rng.integers(len(base) // 2, len(base) + 1))]
        prompt += rng.integers(0, 3, size=int(rng.integers(1, 9))).tolist()
        waiting.append([prompt, int(rng.integers(1, 21))])

    def admit(slot):
        tokens, remaining = waiting[0]
        if not running:
            assert pool.can_admit(tokens, margin), "an idle engine cannot admit a request"
        if pool.can_admit(tokens, margin):
            waiting.popleft()
            t = tables[slot]
            events["hit_tokens"] += t.admit(tokens)
            assert ensure(t, len(tokens) - 1 + margin), "can_admit promised these pages"
            running[slot] = [tokens, remaining]
            events["admitted"] += 1

    def prefill_chunk(t, tokens):
        n = min(chunk, len(tokens) - 1 - t.length)
        if ensure(t, t.length + n):
            write(t, t.length, tokens[t.length:t.length + n])
            t.commit(t.length + n)
            if rng.random() < 0.3:
                t.publish(tokens[:t.length])

    def round_(slot, t, tokens, remaining):
        while not ensure(t, t.length + scratch):  # preempt until the round's scratch fits
            victim = tables.index(preemption_order(tables)[0])
            waiting.appendleft(stop(victim, publish=rng.random() < 0.5))
            events["preempted"] += 1
            if victim == slot:
                events["preempted_itself"] += 1
                return
        accepted = int(rng.integers(1, min(scratch, remaining) + 1))
        new = rng.integers(0, 3, size=accepted).tolist()
        write(t, t.length, [*(tokens + new)[t.length:t.length + accepted], *[-2] * (scratch - accepted)])
        running[slot] = [tokens + new, remaining - accepted]
        t.commit(t.length + accepted)
        if remaining - accepted <= 0:
            stop(slot, publish=rng.random() < 0.8)
            events["finished"] += 1

    for _ in range(steps):
        op = rng.random()
        idle = [s for s in range(slots) if s not in running]
        if op < 0.15 and len(waiting) < 8:
            arrive()
        elif op < 0.4 and idle and waiting:
            admit(idle[0])
        elif op < 0.42 and running:
            stop(list(running)[int(rng.integers(len(running)))], publish=rng.random() < 0.5)
            events["cancelled"] += 1
        elif running:
            slot = list(running)[int(rng.integers(len(running)))]
            t = tables[slot]
            tokens, remaining = running[slot]
            if t.length < len(tokens) - 1:
                prefill_chunk(t, tokens)
            else:
                round_(slot, t, tokens, remaining)
        verify()
    for slot in list(running):
        stop(slot, publish=False)
    verify()
    assert (pool.free_pages, pool.used, pool.shared) == (num_pages - 1, 0, 0)
    everything = pool.allocate(num_pages - 1)
    assert sorted(everything) == list(range(1, num_pages)) and pool.hashed == 0
    events.update({k: v for k, v in pool.stats().items() if k in ("evicted", "prefix_hit_tokens")})
    return events


def test_fuzz_an_engine_life_keeps_every_invariant_and_leaks_nothing():
    events = _fuzz(seed=3, steps=4000)
    # every path was exercised, a round's own request preempted among them
    for name in ("admitted", "cancelled", "preempted", "finished", "evicted", "most_shared"):
        assert events[name] >= 5, (name, events)
    assert events["preempted_itself"] >= 1, events
    assert events["hit_tokens"] > 0 and events["hit_tokens"] == events["prefix_hit_tokens"]


def _forgets_a_decref(original):
    calls = itertools.count()
    return lambda self, page: None if next(calls) % 50 == 49 else original(self, page)


def _keeps_a_hit_in_the_eviction_order(original):
    def hold(self, page):
        if self._refs[page] == 0 and page in self._lru:
            self._refs[page] = 1
            self._used += 1
            return
        original(self, page)
    return hold


def _leaves_a_page_on_the_free_list(original):
    def allocate(self, n):
        got = original(self, n)
        if got:
            self._free.append(got[-1])
        return got
    return allocate


def _publishes_without_freezing(original):
    def publish(self, tokens):
        read_only = self.read_only
        original(self, tokens)
        self.read_only = read_only
    return publish


@pytest.mark.parametrize("cls,name,bug", [
    (PagePool, "_drop", _forgets_a_decref),
    (PagePool, "_hold", _keeps_a_hit_in_the_eviction_order),
    (PagePool, "allocate", _leaves_a_page_on_the_free_list),
    (PageTable, "publish", _publishes_without_freezing),  # cached pages left as write targets
])
def test_check_catches_a_planted_bug(monkeypatch, cls, name, bug):
    monkeypatch.setattr(cls, name, bug(getattr(cls, name)))
    with pytest.raises(AssertionError, match=r"PagePool\.check: "):
        _fuzz(seed=3, steps=4000)


def test_check_catches_a_missing_decref_on_commit(monkeypatch):
    pool = PagePool(8, 2)
    t = _table(pool, [1, 2, 3, 4, 5], positions=8)
    pool.check()
    last = t.pages[-1]
    original = PagePool._drop
    monkeypatch.setattr(PagePool, "_drop", lambda self, page: None if page == last else original(self, page))
    t.commit(4)
    with pytest.raises(AssertionError, match=rf"page {last} has refcount 1 but 0 holders"):
        pool.check()


def test_stats():
    pool = PagePool(10, 2)
    a = _table(pool, [1, 2, 3, 4, 5])
    a.publish([1, 2, 3, 4])
    b = _table(pool, [1, 2, 3, 9, 9], positions=6)
    a.release_all()
    assert pool.stats() == {"pages": 9, "page_size": 2, "free": 6, "used": 3, "shared": 0, "cached": 1,
                            "hashed": 2, "prefix_queries": 2, "prefix_query_tokens": 8, "prefix_hit_tokens": 2,
                            "allocated": 4, "evicted": 0}
    b.release_all()
