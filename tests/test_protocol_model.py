"""A CPU model of the two protocols in docs/proposals/overlapped-boundaries.md: the overlapped SP
boundary (pass 1 pulls, pass 2 launched early and gated by per-tile ready flags, the pushed
all-gather's copy-in) and the one-launch decode TP boundary (pushed partial rows with epoch flags in a
double-buffered inbox, a ticket reduction over the column-slice CTAs of a tile).

Pure Python, no GPU and no spkernels import. Each rank runs several calls back to back, enqueued up
front with nothing reset in between (CUDA-graph replay style). Every CTA is a generator that yields
before each access to modelled memory; a seeded random scheduler (ranks at skewed speeds, so that
one rank runs calls ahead of another) picks the next CTA step or the next CTA dispatch. Every value
in memory is tagged with the call that wrote it, and every read checks the tag.

What the model assumes of the primitives (the guarantees the design relies on):
- Release/acquire: a CTA's accesses happen in program order, and a flag stored with release
  (after the CTA's __syncthreads) is seen by an acquiring reader only after the CTA's earlier
  stores, local or remote; so each modelled step is atomic and sequentially consistent. Plain
  stores get no other ordering: a protocol that publishes a flag before its data is caught.
- The LSA barrier (lsa_barrier.cuh): arriving stores epoch + 1 into slot [index][me] of every
  peer's inbox, waiting spins until slot [index][peer] of its own inbox is >= epoch + 1; the epoch
  is read from local memory when the CTA constructs the barrier and written back when it ends.
- PDL (pdl.cuh): a dependent kernel's CTAs may be dispatched once every CTA of the kernel before it
  has triggered or exited (so the earlier kernel is all resident); pdl_wait() returns once the
  earlier kernel has completed, i.e. all of its CTAs have exited. A kernel with no pdl_wait() can
  complete before its predecessor. A plain launch starts after its predecessor completed.
- Residency: a rank holds `capacity` CTAs at once; a dispatched CTA keeps its slot until it exits.
- Timeouts: a spin (barrier, flag) gives up once the rank's `failed` word is set; when nothing can
  run, one blocked spin times out and sets it (SPK_BARRIER_TIMEOUT). pdl_wait() never times out.

The checks: every schedule completes within a step bound (no deadlock), no read sees a value of
another call (no stale read), every rank's outputs are equal and equal to the reference with the
partials summed in rank order. Each ordering rule, removed, makes the model find a violation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

VALUES = (1e16, 1.0, -1e16, 0.5, 3.0, -2.5e15, 7.0, 1e-3, -1.0, 2.0**60, 0.25)


def val(*key: int) -> float:
    """A partial's value: mixed magnitudes, so that the order of a sum changes its bits."""
    return VALUES[hash(key) % len(VALUES)]


def rank_sum(values) -> float:
    acc = 0.0
    for v in values:
        acc += v
    return acc


class Deadlock(Exception):
    pass


class Spin:
    """A spin wait: gives up (returns) once the rank's failed word is set."""

    def __init__(self, pred, rank: int):
        self.pred, self.rank = pred, rank


class Kernel:
    def __init__(
        self, sim: Sim, rank: int, name: str, grid: int, body, pdl: bool = True, unordered: bool = False
    ):
        self.sim, self.rank, self.name, self.grid, self.body = sim, rank, name, grid, body
        self.pdl, self.unordered = pdl, unordered
        stream = sim.streams[rank]
        self.prev = stream[-1] if stream else None
        stream.append(self)
        self.pending = list(range(grid))
        self.triggered = [False] * grid
        self.trigger_count = 0
        self.exited = 0

    def launched(self) -> bool:
        p = self.prev
        if p is None:
            return True
        if self.unordered:  # a mutant: may start as soon as its predecessor started
            return p.launched()
        if self.pdl:
            return p.trigger_count == p.grid
        return p.completed()

    def completed(self) -> bool:
        return self.exited == self.grid

    def trigger(self, cta: int) -> None:
        if not self.triggered[cta]:
            self.triggered[cta] = True
            self.trigger_count += 1

    def pdl_wait(self):
        """griddepcontrol.wait: blocks (no timeout) until the previous kernel has completed."""
        if self.prev is not None:
            p = self.prev
            yield lambda: p.completed()


class Sim:
    def __init__(
        self, world: int, capacity: int, seed: int, timeouts: bool = False, max_steps: int = 200_000
    ):
        self.world, self.capacity, self.timeouts, self.max_steps = world, capacity, timeouts, max_steps
        self.rng = random.Random(seed)
        self.speed = [self.rng.choice((1, 3, 30)) for _ in range(world)]
        self.streams: list[list[Kernel]] = [[] for _ in range(world)]
        self.resident = [0] * world
        self.running: list[list] = []  # [kernel, cta, generator, pending wait, weight]
        self.failed = [False] * world
        self.violations: list[str] = []
        self.overlaps = 0  # SP: rows pushed while a pass-1 CTA of the same call still ran

    def check(self, ok: bool, what: str) -> None:
        if not ok and not any(self.failed):
            self.violations.append(what)

    def _ready(self, wait) -> bool:
        if wait is None:
            return True
        if isinstance(wait, Spin):
            return self.failed[wait.rank] or wait.pred()
        return wait()

    def _advance(self, agent) -> None:
        kernel, cta, gen = agent[:3]
        try:
            agent[3] = next(gen)
        except StopIteration:
            self.running.remove(agent)
            kernel.exited += 1
            kernel.trigger(cta)  # an exited CTA counts as triggered
            self.resident[kernel.rank] -= 1

    def run(self) -> int:
        for step in range(self.max_steps):
            actions, weights = [], []
            for r, stream in enumerate(self.streams):
                if self.resident[r] < self.capacity:
                    for k in stream:
                        if k.pending and k.launched():
                            actions.append(k)
                            weights.append(self.speed[r])
            for agent in self.running:
                if self._ready(agent[3]):
                    actions.append(agent)
                    weights.append(agent[4])
            if not actions:
                if all(k.completed() for s in self.streams for k in s):
                    return step
                spins = [a for a in self.running if isinstance(a[3], Spin)]
                if self.timeouts and spins:
                    self.failed[self.rng.choice(spins)[3].rank] = True  # the first timeout on that rank
                    continue
                blocked = sorted({f"rank {a[0].rank} {a[0].name} cta {a[1]}" for a in self.running})
                raise Deadlock("no step can run: " + "; ".join(blocked))
            choice = self.rng.choices(actions, weights)[0]
            if isinstance(choice, Kernel):  # dispatch a CTA (any pending one: HW order is not promised)
                cta = choice.pending.pop(self.rng.randrange(len(choice.pending)))
                self.resident[choice.rank] += 1
                # Some CTAs crawl: the schedules where one CTA lags far behind its kernel.
                weight = self.speed[choice.rank] * self.rng.choice((0.01, 0.3, 1.0))
                agent = [choice, cta, choice.body(choice, cta), None, weight]
                self.running.append(agent)
                self._advance(agent)
            else:
                self._advance(choice)
        raise Deadlock(f"step bound {self.max_steps} reached")


def barrier_sync(sim: Sim, inbox, r: int, index: int, epoch: int):
    """LsaBarrier::sync on barrier `index` with the epoch the CTA read: arrive, then wait."""
    for q in range(sim.world):
        if q != r:
            yield
            inbox[q][index][r] = epoch + 1
    for q in range(sim.world):
        if q != r:
            yield Spin(lambda q=q: inbox[r][index][q] >= epoch + 1, r)


# ---- The overlapped SP boundary (mhc_post_pre_rs_ag) -------------------------------------------


@dataclass
class SPConfig:
    world: int = 2
    tiles: int = 4  # tiles of T_local rows per rank
    rows_per_tile: int = 2
    slices: int = 2  # S
    groups: int = 2  # G: pass-1 CTA (g, s) owns slice s, tiles g, g + G, ...
    p2_grid: int = 3  # pass-2 CTAs looping over rows c, c + grid, ...
    ci_grid: int = 2
    capacity: int = 6  # resident CTAs per rank: pass 1 all, plus room for pass 2
    calls: int = 3
    dead_after: int | None = None  # the last rank enqueues only this many calls
    # Mutants: each removes one rule of the protocol.
    release_before_store: bool = False  # pass 1 releases a tile's flag before its ws / stream stores
    boolean_flag: bool = False  # the ready flag is 1, not the call's epoch (never reset, graph style)
    no_tail_wait: bool = False  # pass 2 never calls pdl_wait(): it may complete before pass 1
    unordered_pass2: bool = False  # pass 2 may start before every pass-1 CTA is resident


def sp_reference(cfg: SPConfig, n: int, R: int) -> float:
    y = rank_sum(val(n, p, R) for p in range(cfg.world))
    xs = [y * (s + 1) + val(n, R, s, 7) for s in range(cfg.slices)]
    return rank_sum(x * 0.5 for x in xs) + rank_sum(xs)


def run_sp(cfg: SPConfig, seed: int) -> Sim:
    W, S, G, rpt = cfg.world, cfg.slices, cfg.groups, cfg.rows_per_tile
    tl = cfg.tiles * rpt  # T_local
    sim = Sim(W, cfg.capacity, seed, timeouts=cfg.dead_after is not None)
    init = (-1, 0.0)
    partial = [[init] * (W * tl) for _ in range(W)]  # window: each rank's whole partial [T, D]
    gather = [[init] * (W * tl) for _ in range(W)]  # window: rows the peers push
    max_idx = max(S * G, cfg.ci_grid)
    inbox = [[[0] * W for _ in range(max_idx)] for _ in range(W)]  # window: barrier slots
    epochs = [[0] * max_idx for _ in range(W)]  # local
    calls = [0] * W  # local: the device-side call counter
    ready = [[[0] * S for _ in range(cfg.tiles)] for _ in range(W)]  # local: per (tile, slice)
    new_stream = [[[init] * S for _ in range(tl)] for _ in range(W)]
    ws = [[[init] * S for _ in range(tl)] for _ in range(W)]  # one address for every call: worst case
    layer_input = [[init] * (W * tl) for _ in range(W)]
    results: dict[tuple[int, int, int], float] = {}

    def read(cell, n, what):
        tag, v = cell
        sim.check(tag == n, f"stale read of {what}: call {tag} seen in call {n}")
        return v

    def stage(r, n):
        def body(k, cta):  # the host's staging copy: plain stream order
            for R in range(W * tl):
                yield
                partial[r][R] = (n, val(n, r, R))

        return body

    def pass1(r, n):
        def body(k, b):
            yield from k.pdl_wait()
            yield
            e = 1 if cfg.boolean_flag else calls[r] + 1
            k.trigger(b)  # every CTA triggers at its start: pass 2 launches once all are resident
            yield
            epoch = epochs[r][b]
            yield from barrier_sync(sim, inbox, r, b, epoch)  # entry: every peer's partial is written
            epoch += 1
            g, s = b // S, b % S
            for t in range(g, cfg.tiles, G):
                if cfg.release_before_store:
                    yield
                    ready[r][t][s] = e
                for row in range(t * rpt, (t + 1) * rpt):
                    R = r * tl + row
                    y = 0.0
                    for p in range(W):  # pull the peers' partial rows, sum in rank order
                        yield
                        y += read(partial[p][R], n, f"rank {p}'s partial row {R}")
                    x = y * (s + 1) + val(n, R, s, 7)
                    yield
                    new_stream[r][row][s] = (n, x)
                    yield
                    ws[r][row][s] = (n, x * 0.5)
                if not cfg.release_before_store:
                    yield  # __syncthreads, then one thread's st.release.gpu
                    ready[r][t][s] = e
            yield
            epochs[r][b] = epoch  # the barrier's destructor

        return body

    def pass2(r, n):
        def body(k, c):
            yield  # reads only calls before its (tail) wait: pass 1 waited and triggered after
            e = 1 if cfg.boolean_flag else calls[r] + 1
            k.trigger(c)  # the copy-in kernel may launch (it waits for this grid)
            for row in range(c, tl, cfg.p2_grid):
                t = row // rpt
                for s in range(S):  # the coefficient warp, lane s: ld.acquire.gpu until the epoch
                    yield Spin(lambda s=s, t=t: ready[r][t][s] == e, r)
                acc = rank_sum(read(ws[r][row][s], n, f"ws row {row}") for s in range(S))
                yield
                xs = [read(new_stream[r][row][s], n, f"new stream row {row}") for s in range(S)]
                out = acc + rank_sum(xs)
                R = r * tl + row
                sim.overlaps += k.prev.exited < k.prev.grid
                yield
                layer_input[r][R] = (n, out)
                results[(r, n, R)] = out
                for q in range(W):  # push the finished row into every peer's gather region
                    if q != r:
                        yield
                        gather[q][R] = (n, out)
            if not cfg.no_tail_wait:
                yield from k.pdl_wait()  # pass 2 completes only after pass 1 (F3)

        return body

    def copy_in(r, n):
        def body(k, j):
            yield from k.pdl_wait()
            if j == 0:
                yield
                calls[r] += 1  # every reader of calls in this op has read it
            yield
            epoch = epochs[r][j]
            yield from barrier_sync(sim, inbox, r, j, epoch)  # every peer's pass 2 completed
            for q in range(W):
                if q == r:
                    continue
                for row in range(j, tl, cfg.ci_grid):
                    R = q * tl + row
                    yield
                    v = read(gather[r][R], n, f"gather row {R} pushed by rank {q}")
                    yield
                    layer_input[r][R] = (n, v)
                    results[(r, n, R)] = v
            yield
            epochs[r][j] = epoch + 1

        return body

    for r in range(W):
        n_calls = cfg.calls if cfg.dead_after is None or r < W - 1 else cfg.dead_after
        for n in range(n_calls):
            Kernel(sim, r, f"stage {n}", 1, stage(r, n), pdl=False)
            Kernel(sim, r, f"pass1 {n}", S * G, pass1(r, n))
            Kernel(sim, r, f"pass2 {n}", cfg.p2_grid, pass2(r, n), unordered=cfg.unordered_pass2)
            Kernel(sim, r, f"copy-in {n}", cfg.ci_grid, copy_in(r, n))
    sim.run()
    if cfg.dead_after is None:
        for r in range(W):
            for n in range(cfg.calls):
                for R in range(W * tl):
                    got, want = results.get((r, n, R)), sp_reference(cfg, n, R)
                    sim.check(got == want, f"rank {r} call {n} row {R}: {got} != {want}")
    return sim


# ---- The one-launch decode TP boundary (mhc_post_pre_ar, T <= 128) ------------------------------


@dataclass
class TPConfig:
    world: int = 3
    tiles: int = 2
    rows_per_tile: int = 2
    slices: int = 2  # CTA (tile, slice); the grid is tiles * slices, all resident
    calls: int = 4
    dead_after: int | None = None
    # Mutants
    single_buffer: bool = False  # every call uses inbox slot 0
    flag_before_data: bool = False  # the epoch flag is released before the rows are stored
    boolean_flag: bool = False  # the inbox flag is 1, not the call's epoch (the slot's parity alone)
    arrival_order: bool = False  # the partials are summed in the order they arrive
    wait_before_push: bool = False  # a CTA waits for the peers' rows before pushing its own


def tp_reference(cfg: TPConfig, n: int, row: int, s: int) -> float:
    ys = [rank_sum(val(n, p, row, s2) for p in range(cfg.world)) for s2 in range(cfg.slices)]
    t = row // cfg.rows_per_tile
    coef = {}
    for rr in range(t * cfg.rows_per_tile, (t + 1) * cfg.rows_per_tile):
        yr = [rank_sum(val(n, p, rr, s2) for p in range(cfg.world)) for s2 in range(cfg.slices)]
        coef[rr] = rank_sum(y * (s2 + 1) for s2, y in enumerate(yr))
    sq = rank_sum((coef[row] * ys[s2]) ** 2 for s2 in range(cfg.slices))
    return coef[row] * ys[s] / (1.0 + sq)


def run_tp(cfg: TPConfig, seed: int) -> Sim:
    W, S, rpt = cfg.world, cfg.slices, cfg.rows_per_tile
    T = cfg.tiles * rpt
    grid = cfg.tiles * S
    sim = Sim(W, grid, seed, timeouts=cfg.dead_after is not None)
    init = (-1, 0.0)
    y = [[[init] * S for _ in range(T)] for _ in range(W)]  # the caller's partial, local
    # window: inbox[owner][slot][sender][row][slice], flag[owner][slot][sender][tile][slice]
    inbox = [[[[[init] * S for _ in range(T)] for _ in range(W)] for _ in range(2)] for _ in range(W)]
    flag = [[[[[0] * S for _ in range(cfg.tiles)] for _ in range(W)] for _ in range(2)] for _ in range(W)]
    calls = [0] * W  # local
    kticket = [0] * W  # local: CTAs done with `calls` in this call
    # local, per reduction round (0: fn . x -> coefficients, 1: the norm's squares)
    tticket = [[[0] * cfg.tiles for _ in range(2)] for _ in range(W)]
    part = [[[[init] * S for _ in range(T)] for _ in range(2)] for _ in range(W)]  # per round, row, slice
    total = [[[init] * T for _ in range(2)] for _ in range(W)]  # the last CTA's sums
    done = [[[0] * cfg.tiles for _ in range(2)] for _ in range(W)]  # epoch flags of the sums
    results: dict[tuple[int, int, int, int], float] = {}

    def read(cell, n, what):
        tag, v = cell
        sim.check(tag == n, f"stale read of {what}: call {tag} seen in call {n}")
        return v

    def tile_round(r, n, e, rnd, t, s, values):
        """Every slice CTA of tile t stores its partial per row; the last to take the ticket sums
        them in slice order and releases the sums; the others wait for them."""
        rows = range(t * rpt, (t + 1) * rpt)
        for row in rows:
            yield
            part[r][rnd][row][s] = (n, values[row])
        yield  # __syncthreads, then one thread: atomic fetch_add (acq_rel, gpu scope)
        ticket = tticket[r][rnd][t]
        tticket[r][rnd][t] = ticket + 1
        if ticket == S - 1:
            tticket[r][rnd][t] = 0  # every slice CTA of the tile has arrived
            for row in rows:
                yield
                sums = [
                    read(part[r][rnd][row][s2], n, f"round {rnd} partial of row {row}") for s2 in range(S)
                ]
                total[r][rnd][row] = (n, rank_sum(sums))
            yield
            done[r][rnd][t] = e
        else:
            yield Spin(lambda: done[r][rnd][t] == e, r)
        out = {}
        for row in rows:
            yield
            out[row] = read(total[r][rnd][row], n, f"round {rnd} sum of row {row}")
        return out

    def producer(r, n):
        def body(k, cta):  # the caller's kernel writing this rank's partial (plain stream order)
            for row in range(T):
                for s in range(S):
                    yield
                    y[r][row][s] = (n, val(n, r, row, s))

        return body

    def boundary(r, n):
        def body(k, b):
            t, s = b // S, b % S
            rows = range(t * rpt, (t + 1) * rpt)
            yield from k.pdl_wait()
            yield
            c = calls[r]
            slot = 0 if cfg.single_buffer else c & 1
            e = c + 1  # the call's epoch
            e_push = 1 if cfg.boolean_flag else e
            mine = {}
            for row in rows:
                yield
                mine[row] = read(y[r][row][s], n, f"own partial row {row}")
            peers = [q for q in range(W) if q != r]

            def push():
                if cfg.flag_before_data:
                    for q in peers:
                        yield
                        flag[q][slot][r][t][s] = e_push
                for row in rows:
                    for q in peers:
                        yield
                        inbox[q][slot][r][row][s] = (n, mine[row])
                if not cfg.flag_before_data:
                    for q in peers:
                        yield  # __syncthreads, then st.release.sys per peer
                        flag[q][slot][r][t][s] = e_push

            def arrived(p):
                return flag[r][slot][p][t][s] == e_push

            def take(p, acc):
                for row in rows:
                    yield
                    acc[row] += read(inbox[r][slot][p][row][s], n, f"rank {p}'s pushed row {row}")

            if not cfg.wait_before_push:
                yield from push()
            # (fn is read here, while the peers' rows are on their way)
            acc = {row: 0.0 for row in rows}
            if cfg.arrival_order:
                left = list(peers)
                for row in rows:
                    acc[row] += mine[row]
                while left:
                    yield Spin(lambda: any(arrived(p) for p in left), r)
                    p = next((p for p in left if arrived(p)), left[0])
                    left.remove(p)
                    yield from take(p, acc)
            else:
                for p in range(W):  # rank order, the own partial in its place
                    if p == r:
                        for row in rows:
                            acc[row] += mine[row]
                    else:
                        yield Spin(lambda p=p: arrived(p), r)
                        yield from take(p, acc)
            if cfg.wait_before_push:
                yield from push()
            coef = yield from tile_round(r, n, e, 0, t, s, {row: acc[row] * (s + 1) for row in rows})
            sq = yield from tile_round(r, n, e, 1, t, s, {row: (coef[row] * acc[row]) ** 2 for row in rows})
            for row in rows:
                results[(r, n, row, s)] = coef[row] * acc[row] / (1.0 + sq[row])
            yield  # __syncthreads, then one thread: the kernel's ticket
            ticket = kticket[r]
            kticket[r] = ticket + 1
            if ticket == grid - 1:
                kticket[r] = 0
                calls[r] += 1  # every CTA has read calls: the next call takes the other slot

        return body

    for r in range(W):
        n_calls = cfg.calls if cfg.dead_after is None or r < W - 1 else cfg.dead_after
        for n in range(n_calls):
            Kernel(sim, r, f"producer {n}", 1, producer(r, n), pdl=False)
            Kernel(sim, r, f"boundary {n}", grid, boundary(r, n))
    sim.run()
    if cfg.dead_after is None:
        for r in range(W):
            for n in range(cfg.calls):
                for row in range(T):
                    for s in range(S):
                        got, want = results.get((r, n, row, s)), tp_reference(cfg, n, row, s)
                        sim.check(got == want, f"rank {r} call {n} row {row} slice {s}: {got} != {want}")
    return sim


# ---- Tests -----------------------------------------------------------------------------------------


def assert_clean(run, cfg, seeds) -> None:
    for seed in seeds:
        sim = run(cfg, seed)
        assert not sim.violations, f"seed {seed}: {sim.violations[:3]}"
        assert not any(sim.failed), f"seed {seed}: a wait timed out"


def find_violation(run, cfg, seeds) -> str:
    """The first violation or deadlock any of the schedules shows ('' if none)."""
    for seed in seeds:
        try:
            sim = run(cfg, seed)
        except Deadlock as e:
            return f"deadlock: {e}"
        if sim.violations:
            return sim.violations[0]
    return ""


SP_SHAPES = [
    SPConfig(),
    SPConfig(tiles=5, groups=3, p2_grid=4, capacity=8),  # uneven tiles per CTA, rows per CTA
    SPConfig(world=3, tiles=3, slices=3, groups=1, p2_grid=2, ci_grid=3, capacity=5),
    SPConfig(capacity=4),  # no room for pass 2 beside pass 1: no overlap, still correct
]


@pytest.mark.parametrize(
    "cfg", SP_SHAPES, ids=lambda c: f"tp{c.world}-t{c.tiles}-s{c.slices}-cap{c.capacity}"
)
def test_sp_protocol_holds(cfg):
    assert_clean(run_sp, cfg, range(40))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    tiles=st.integers(1, 5),
    slices=st.integers(1, 3),
    groups=st.integers(1, 3),
    p2_grid=st.integers(1, 4),
    ci_grid=st.integers(1, 3),
    spare=st.integers(0, 3),
    seed=st.integers(0, 2**31),
)
def test_sp_protocol_any_shape(tiles, slices, groups, p2_grid, ci_grid, spare, seed):
    """Any grid, provided pass 1 and the copy-in are each all resident (their barriers need it)."""
    cap = max(slices * groups, ci_grid) + spare
    cfg = SPConfig(tiles=tiles, slices=slices, groups=groups, p2_grid=p2_grid, ci_grid=ci_grid, capacity=cap)
    assert_clean(run_sp, cfg, [seed])


TP_SHAPES = [TPConfig(), TPConfig(world=2, tiles=3, slices=3), TPConfig(world=4, tiles=1, calls=5)]


@pytest.mark.parametrize("cfg", TP_SHAPES, ids=lambda c: f"tp{c.world}-t{c.tiles}-s{c.slices}")
def test_tp_protocol_holds(cfg):
    assert_clean(run_tp, cfg, range(60))


def test_sp_overlaps():
    """The model does exercise the overlap: pass-2 CTAs run while pass-1 CTAs still pull."""
    assert sum(run_sp(SPConfig(), seed).overlaps for seed in range(5)) > 0


@pytest.mark.parametrize(
    "mutant",
    ["release_before_store", "boolean_flag", "no_tail_wait", "unordered_pass2"],
)
def test_sp_mutant_is_caught(mutant):
    cfg = SPConfig(**{mutant: True})
    if mutant == "unordered_pass2":  # pass 1 fills the rank, as the fused grids do today
        cfg = SPConfig(unordered_pass2=True, capacity=4, p2_grid=4)
    assert find_violation(run_sp, cfg, range(300)), f"{mutant}: no schedule broke the protocol"


@pytest.mark.parametrize(
    "mutant", ["single_buffer", "flag_before_data", "boolean_flag", "arrival_order", "wait_before_push"]
)
def test_tp_mutant_is_caught(mutant):
    what = find_violation(run_tp, TPConfig(**{mutant: True}), range(300))
    assert what, f"{mutant}: no schedule broke the protocol"
    if mutant == "wait_before_push":
        assert what.startswith("deadlock")


@pytest.mark.parametrize("run,cfg", [(run_sp, SPConfig(dead_after=1)), (run_tp, TPConfig(dead_after=1))])
def test_dead_peer_times_out(run, cfg):
    """A peer that stops after one call: every wait of the live ranks gives up (the timeout, then the
    failed word), every kernel still runs to its end, and the failure is recorded."""
    for seed in range(10):
        sim = run(cfg, seed)
        assert sim.failed[0]
