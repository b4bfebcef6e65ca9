"""The choice of a round's tree size as pure functions: best_size, the acceptance ledger (exact in
hindsight: checked against real accept walks on smaller trees), and TreeSizer on given cost tables
and acceptance, its exploration included."""

import numpy as np
import pytest
import torch

from ddtree.engine.acceptance import AcceptanceLedger, largest_normal
from ddtree.engine.costs import RoundCosts
from ddtree.engine.batch import PENDING_ROWS
from ddtree.engine.round import result_width
from ddtree.engine.sizing import HOLD_ROUNDS, PLAIN_BURST, PLAIN_TRY_RATE, TreeSizer, best_size
from ddtree.tree import accept_paths, build_trees

from ..tree.helpers import first_nodes, make_draft

SIZES = (1, 2, 4, 8, 16)
DEPTH = 7


class FakeRequest:
    def __init__(self, remaining=1000):
        self.remaining = remaining
        self.accepted_nodes = self.expected_nodes = 0.0

    def remaining_tokens(self):
        return self.remaining


def path(nodes: list[int]) -> tuple[list[int], int]:
    """(the accepted row a round reports: root, the nodes, -1 after; accept_len)."""
    return [0] + nodes + [-1] * (DEPTH - len(nodes)), 1 + len(nodes)


def feed(ledger: AcceptanceLedger, nodes: list[int], verified: int, rounds: int = 1, requests: int = 1) -> None:
    row, length = path(nodes)
    for _ in range(rounds):
        ledger.observe(np.array([row] * requests), np.array([length] * requests), verified)


def costs(row: dict) -> RoundCosts:
    return RoundCosts({}, {1: dict(row), 4: {s: 2 * t for s, t in row.items()}})


def taught(sizer: TreeSizer, nodes: list[int], rounds: int = 8) -> TreeSizer:
    """The sizer after `rounds` trees of its largest size whose accepted path was `nodes`."""
    feed(sizer.state.ledger, nodes, sizer.largest, rounds)
    return sizer


def test_best_size_maximizes_tokens_per_second_and_breaks_ties_small():
    assert best_size([0, 4, 16], [1.0, 2.0, 4.0], [1.0, 3.0, 5.0]) == 4
    assert best_size([0, 4], [1.0, 2.0], [1.0, 2.0]) == 0
    assert best_size([0, 4], [1.0, 1.0], [1.0, 1.5]) == 4
    with pytest.raises(ValueError, match="one cost and one token count per size"):
        best_size([0, 4], [1.0], [1.0, 2.0])


def test_the_ledger_counts_what_each_smaller_tree_would_have_committed():
    ledger = AcceptanceLedger(16, memory=float("inf"))
    with pytest.raises(KeyError, match="no round has verified 1 nodes"):
        ledger.tokens(1)
    assert ledger.tokens(0) == 1.0
    feed(ledger, [2, 5, 9], verified=16)
    assert [ledger.tokens(n) for n in (1, 2, 4, 5, 8, 9, 16)] == [1, 2, 2, 3, 3, 4, 4]
    feed(ledger, [1], verified=4)  # nodes past 4 were not verified: their rates stay as they were
    assert ledger.tokens(1) == 1.5 and ledger.tokens(2) == 2.0 and ledger.tokens(4) == 2.0
    assert ledger.tokens(5) == 3.0 and ledger.tokens(16) == 4.0 and ledger.frontier == 16
    row, _ = path([3, 6])
    ledger.observe(np.array([row]), np.array([2]), 16)  # accept_len 2: node 6 is past the path's end
    assert ledger.weight(6) == 2.0 and ledger.tokens(16) == pytest.approx(1 + 3 * (1 / 3) + 2 * (1 / 2))  # 1, 2, 3; 5, 9


def test_the_ledger_forgets_old_rounds():
    ledger = AcceptanceLedger(8, memory=4)
    feed(ledger, [1, 2, 3, 4, 5, 6, 7], verified=8, rounds=20)
    assert ledger.tokens(8) == pytest.approx(8.0)
    feed(ledger, [], verified=8, rounds=20)
    assert ledger.tokens(8) < 1.05 and ledger.weight(8) == pytest.approx(4.0, rel=1e-2)


def test_the_ledger_knows_how_much_a_round_s_tokens_vary():
    """Two requests' rounds: one accepted nodes 1, 2, 3 (tokens 2, 3, 4, 4 at sizes 1 .. 4), the
    other nothing (1 at every size): the variance at each size is that of those two values."""
    ledger = AcceptanceLedger(8, memory=4)
    rows = np.array([path([1, 2, 3])[0], path([])[0]])
    ledger.observe(rows, np.array([4, 1]), verified=4)
    assert ledger.variance_of([0, 1, 2, 3, 4]) == pytest.approx([0.0, 0.25, 1.0, 2.25, 2.25])
    feed(ledger, [1, 2, 3], verified=4, rounds=40)  # the same path every round since: no spread left
    assert ledger.variance_of([1, 4]) == pytest.approx([0.0, 0.0], abs=1e-4)  # 0.75^40 of the first round left
    assert largest_normal(1) == 0.0 and 1.4 < largest_normal(8) < 1.45 and 2.0 < largest_normal(32) < 2.1


@pytest.mark.parametrize("kind", ["normal", "bf16", "peaked"])
def test_the_ledger_equals_the_accept_walk_of_every_smaller_tree(kind):
    """What the ledger reads off one round of 40 nodes is what rounds of 1 .. 40 nodes commit:
    the accept walk run on each smaller tree (its first n nodes) with the same target choices."""
    gen = torch.Generator().manual_seed(5)
    batch, budget = 6, 40
    lp, tok = make_draft(kind, batch, DEPTH, 12, 12, gen)
    full = build_trees(lp, tok, budget, backend="reference")
    # the target's choice after each node: mostly the token of one of its children, so that paths run deep
    posterior = torch.randint(0, 12, (batch, budget + 1), generator=gen)
    per_node = torch.cat([full.tokens.new_zeros(batch, 1), full.tokens.clamp_min(0)], 1)
    children = {}
    for b in range(batch):
        for i in range(1, int(full.num_nodes[b]) + 1):
            children.setdefault((b, int(full.parents[b, i - 1])), []).append(i)
    for (b, parent), kids in children.items():
        if torch.rand(1, generator=gen).item() < 0.8:
            posterior[b, parent] = per_node[b, kids[int(torch.randint(0, len(kids), (1,), generator=gen))]]
    accepted, accept_len, _ = accept_paths(full, posterior, backend="reference")
    ledger, at_once = AcceptanceLedger(budget, memory=float("inf")), AcceptanceLedger(budget, memory=float("inf"))
    for b in range(batch):
        ledger.observe(accepted[b : b + 1].numpy(), accept_len[b : b + 1].numpy(), budget)
    at_once.observe(accepted.numpy(), accept_len.numpy(), budget)  # the batch's rows in one round
    assert accept_len.float().mean() > 2.0  # paths deep enough to tell sizes apart
    for n in range(1, budget + 1):
        small = first_nodes(full, n)
        _, small_len, _ = accept_paths(small, posterior[:, : n + 1].contiguous(), backend="reference")
        assert ledger.tokens(n) == pytest.approx(small_len.double().mean().item()), n
        spread = small_len.double().var(unbiased=False).item()
        assert ledger.variance_of([n])[0] == pytest.approx(spread, abs=1e-9), n
        assert at_once.tokens(n) == pytest.approx(ledger.tokens(n)) and at_once.variance_of([n]) == pytest.approx(
            ledger.variance_of([n]), abs=1e-9)


def test_at_first_the_largest_size_until_it_is_known():
    sizer = TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 2.0, 2: 2.1, 4: 2.3, 8: 2.8, 16: 4.0}))
    request = FakeRequest()
    chosen = []
    for _ in range(6):
        chosen.append(sizer.choose(1, [request], 0.0, 0))
        feed(sizer.state.ledger, [], verified=chosen[-1])  # a useless drafter
    assert chosen[:4] == [16] * 4 and chosen[4:] == [0, 0]
    assert TreeSizer(SIZES, DEPTH, None).choose(1, [request], 0.0, 0) == 1  # no table: the smallest tree


def test_sizer_picks_plain_steps_for_a_useless_drafter_and_large_trees_when_verify_is_free():
    steep = {0: 1.0, 1: 2.0, 2: 2.1, 4: 2.3, 8: 2.8, 16: 4.0}
    flat = {0: 1.0, 1: 1.01, 2: 1.02, 4: 1.03, 8: 1.04, 16: 1.05}
    request = FakeRequest()
    useless = taught(TreeSizer(SIZES, DEPTH, costs(steep)), [])
    assert useless.choose(1, [request], 0.0, 0) == 0
    # a drafter right to depth 3 on its best path, and to depth 7 only through node 12
    good = taught(TreeSizer(SIZES, DEPTH, costs(flat)), [1, 2, 3], rounds=4)
    feed(good.state.ledger, [1, 2, 3, 9, 10, 11, 12], 16, rounds=4)
    assert good.state.ledger.tokens(8) == 4.0 and good.state.ledger.tokens(16) == pytest.approx(6.0, abs=0.1)
    assert good.choose(1, [request], 0.0, 0) == 16
    good.costs = costs(steep)  # 16 nodes cost 4.0, 8 cost 2.8: the second 8 nodes add less than they cost
    assert good.choose(1, [request], 0.0, 0) == 4  # 4 tokens for 2.3 beat 4 for 2.8 and 6 for 4.0
    good.costs = costs({0: 1.0, 1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0})
    assert good.choose(1, [request], 0.0, 0) == 0  # trees cost more than their tokens


def test_what_requests_may_still_take_and_what_others_commit_either_way():
    sizer = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 1.5, 2: 1.6, 4: 1.7, 8: 2.0, 16: 3.0})), [1, 2])
    assert sizer.choose(1, [FakeRequest()], 0.0, 0) == 2  # 3 tokens for 1.6
    assert sizer.choose(1, [FakeRequest(remaining=1)], 0.0, 0) == 0  # one token left: a tree adds nothing
    assert sizer.choose(4, [FakeRequest(), FakeRequest()], 0.0, 0) == 2  # 6 tokens for 3.2 against 2 for 2
    # ten ar requests beside it commit 10 tokens a step either way: 13 for 1.6 lose to 11 for 1
    assert sizer.choose(1, [FakeRequest()], 10.0, 0) == 0


def test_the_floor_and_a_forced_size():
    sizer = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0, 16: 2.0})), [])
    request = FakeRequest()
    assert sizer.choose(1, [request], 0.0, 0) == 0
    assert sizer.choose(1, [request], 0.0, 5) >= 5  # another request needs 5 nodes
    assert sizer.choose(1, [request], 0.0, 32) == 32  # past every size: the floor itself
    sizer.forced = 8
    assert sizer.choose(1, [request], 0.0, 0) == 8
    assert sizer.choose(3, [request], 0.0, 0) == 8  # bucket 3 unmeasured: forced anyway
    sizer.forced = None
    assert sizer.unmeasured([1, 2, 4]) == [2]


def test_probes_come_back_with_doubling_waits():
    sizer = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 2.0, 2: 2.1, 4: 2.3, 8: 2.8, 16: 4.0}), first_wait=2,
                             max_wait=8), [])
    for size, seconds in {1: 2.0, 2: 2.1, 4: 2.3, 8: 2.8, 16: 4.0}.items():  # every tree's cost seen:
        for _ in range(2):                                                   # a probe is one round
            sizer.observe_step(1, size, seconds)
    request = FakeRequest()
    sizes = [sizer.choose(1, [request], 0.0, 0) for _ in range(40)]
    probes = [i for i, s in enumerate(sizes) if s > 0]
    assert set(sizes) == {0, 1}  # the best tree of a useless drafter is the cheapest
    assert probes[0] == 1 and np.diff(probes).tolist()[:4] == [4, 8, 8, 8]


def test_a_probe_of_a_tree_never_seen_is_two_rounds():
    sizer = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 2.0, 2: 2.1, 4: 2.3, 8: 2.8, 16: 4.0}), first_wait=2), [])
    request = FakeRequest()
    assert [sizer.choose(1, [request], 0.0, 0) for _ in range(5)] == [0, 1, 1, 0, 0]


class Plan:
    paths, experts = True, False

    def __init__(self, budget):
        self.budget = budget


def learn_round(sizer: TreeSizer, request, size: int, nodes: list[int]) -> None:
    """Read a tree round of `size` whose accepted path was `nodes` into the sizer, as the engine does."""
    start = result_width(DEPTH, 0)
    row = np.full(start + DEPTH + 1, -1, dtype=np.int64)
    kept = [n for n in nodes if n <= size]
    row[0] = 1 + len(kept)
    row[start : start + DEPTH + 1] = path(kept)[0]
    sizer.learn([request], [0], row[None, :], Plan(size), 0)


def run(sizer: TreeSizer, request, rounds: int, nodes: list[int]) -> list[int]:
    """The sizes of `rounds` choices, each tree round read one step late (the engine's overlap:
    the next round is chosen before the last one is read)."""
    sizes, pending = [], None
    for _ in range(rounds):
        size = sizer.choose(1, [request], 0.0, 0)
        if pending:
            learn_round(sizer, request, pending, nodes)
        pending = size or None
        sizes.append(size)
    return sizes


def test_trees_explore_the_next_larger_size_now_and_then():
    sizer = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 1.2, 2: 1.4, 4: 1.8, 8: 3.0, 16: 5.0}),
                             explore_every=4), [1, 2, 3])
    request = FakeRequest()
    for _ in range(2):
        sizer.observe_step(1, 0, 1.0)  # plain steps seen at the table's cost: no plain burst in the way
    sizes = run(sizer, request, 120, [1, 2, 3])
    # 4 tokens for 1.8 beat 3 for 1.4 and 4 for 3.0; each exploration of 8 that fails, judged once
    # its round was read, doubles the gap to the next, up to EXPLORE_BACKOFF times explore_every
    explored = [i + 1 for i, s in enumerate(sizes) if s == 8]
    assert set(sizes) == {4, 8} and explored == [4, 12, 28, 60, 92]


def test_an_exploration_is_judged_only_after_its_round_was_read():
    """Chosen before the explored round is read (overlap), a choice leaves the gap alone, and no
    other exploration starts before this one is judged."""
    sizer = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 1.2, 2: 1.4, 4: 1.8, 8: 3.0, 16: 5.0}),
                             explore_every=4), [1, 2, 3])
    request = FakeRequest()
    for _ in range(2):
        sizer.observe_step(1, 0, 1.0)
    sizes = [sizer.choose(1, [request], 0.0, 0) for _ in range(16)]  # no round ever read
    assert sizes.count(8) == 1 and sizer.state.explore_gap == 4 and sizer.state.explored == 8


def test_an_exploration_that_pays_brings_the_next_one_sooner():
    """Explorations of 8 that fail come rarer; once one shows 8 pays (the drafter got good), the
    choice moves up and explorations come at the first gap again."""
    sizer = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 1.2, 2: 1.4, 4: 1.8, 8: 2.2, 16: 5.0}),
                             explore_every=4), [1, 2, 3])
    request = FakeRequest()
    for _ in range(2):
        sizer.observe_step(1, 0, 1.0)
    sizes = run(sizer, request, 24, [1, 2, 3])
    assert set(sizes) == {4, 8} and sizer.state.explore_gap > 4  # backed off
    while sizer.choose(1, [request], 0.0, 0) != 8:
        pass
    feed(sizer.state.ledger, [1, 2, 3, 4, 5, 6, 7], 8, 64)  # the drafter got good: 8 pays now
    learn_round(sizer, request, 8, [1, 2, 3, 4, 5, 6, 7])  # the explored round, read
    sizes = run(sizer, request, 8, [1, 2, 3, 4, 5, 6, 7])
    # 8 tokens for 2.2 beat 5 for 1.8; the gap back at 4: 16 explored within the next 4 rounds of 8
    assert sizes[0] == 8 and 16 in sizes[:5] and sizer.state.explore_gap in (4, 8)


def test_plain_steps_never_seen_are_tried_in_a_burst_when_they_may_pay():
    """The table's plain step may be off (it once was by 1.6x): a burst of plain steps every
    plain_every tree rounds while the table rates them at least PLAIN_TRY_RATE as good as the best
    tree; never where they cannot pay; 8x rarer once their real cost was seen."""
    table = costs({0: 1.0, 1: 2.0, 2: 2.3, 4: 2.5, 8: 2.8, 16: 3.2})
    sizer = taught(TreeSizer(SIZES, DEPTH, table, explore_every=1000, plain_every=10), [1, 2])
    request = FakeRequest()
    sizes = [sizer.choose(1, [request], 0.0, 0) for _ in range(9 + PLAIN_BURST)]
    assert sizes[:9] == [2] * 9 and sizes[9:] == [0] * PLAIN_BURST  # 3 tokens for 2.3 against 1 for 1
    for _ in range(PLAIN_BURST - 2):  # the engine observes the burst's steps after its first two
        sizer.observe_step(1, 0, 1.0)
    assert sizer.correction.seen(1, 0)
    sizes = [sizer.choose(1, [request], 0.0, 0) for _ in range(79)]
    assert sizes.count(0) == 0 and sizer.choose(1, [request], 0.0, 0) == 0  # the 80th round after
    hopeless = taught(TreeSizer(SIZES, DEPTH, table, explore_every=1000, plain_every=10), [1, 2, 3, 4, 5, 6, 7])
    assert 0 not in [hopeless.choose(1, [request], 0.0, 0) for _ in range(40)]  # 8 tokens for 2.8: never plain
    sizer = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 1.6, 2: 1.7, 4: 1.8, 8: 2.0, 16: 2.5}),
                             explore_every=1000, plain_every=10), [1, 2])
    rated = 1.0 / (3 / 1.7)  # plain steps rated at 0.57 of the best tree: below PLAIN_TRY_RATE, no burst
    assert rated < PLAIN_TRY_RATE and 0 not in [sizer.choose(1, [request], 0.0, 0) for _ in range(40)]


def test_plain_steps_dearer_than_the_table_make_trees_pay():
    """A host-bound pair: the table says a plain step costs 1 and a tree 2, and the request
    accepts 1.5 tokens a round, so plain steps; real plain steps take 2 (the host's work per step
    the stand-ins hid): now a tree's 1.5 tokens for 2 s beat 1 token for 2 s."""
    sizer = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0, 16: 2.0})), [1], 4)
    feed(sizer.state.ledger, [], 16, 4)
    request = FakeRequest()
    assert 1.2 < sizer.state.ledger.tokens(16) < 2.0
    assert sizer.choose(1, [request], 0.0, 0) == 0
    for _ in range(3):
        sizer.observe_step(1, 0, seconds=2.0)
    assert sizer.correction.ratio(1, 0) == 2.0 and sizer.choose(1, [request], 0.0, 0) > 0


def test_trees_that_cost_more_than_the_table_says_are_given_up():
    """The table says a tree of 16 costs 2 plain steps and the request accepts 8 tokens a round; the
    engine then sees its trees take 10 times what the table predicted: plain steps win. Plain steps
    seen cheaper than predicted keep it there; trees seen at the table's cost bring trees back."""
    sizer = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0, 16: 2.0})),
                   [1, 2, 3, 4, 5, 6, 7])
    request = FakeRequest()
    size = sizer.choose(1, [request], 0.0, 0)
    assert size == 8
    for s in SIZES:
        for _ in range(3):
            sizer.observe_step(1, s, seconds=20.0)
    assert sizer.correction.ratio(1, size) == 4.0  # 10x, clamped: 8 tokens for 8 s against 1 for 1 s
    assert sizer.choose(1, [request], 0.0, 0) == 0
    sizer.observe_step(4, 0, seconds=1.0)  # another bucket learns on its own
    assert sizer.correction.ratio(4, 0) == 1.0 and sizer.correction.ratio(1, 0) == 1.0
    for _ in range(16):
        sizer.observe_step(1, size, seconds=2.0)
    assert sizer.choose(1, [request], 0.0, 0) == size
    seen = dict(sizer.correction.ratios)
    sizer.forced = 8
    sizer.observe_step(1, 8, seconds=100.0)  # the table's own measurement teaches nothing
    assert sizer.correction.ratios == seen


def test_plain_steps_keep_their_rows_for_the_drafter_only_near_the_next_tree():
    """Far from the next probe a plain step leaves its row out of the drafter's context (it costs
    an ar step); the PENDING_ROWS - 1 steps before a probe set theirs aside, so the probe drafts
    from the latest rows."""
    sizer = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 2.0, 2: 2.1, 4: 2.3, 8: 2.8, 16: 4.0}), first_wait=64,
                             max_wait=64), [])
    for size in SIZES:
        for _ in range(2):
            sizer.observe_step(1, size, {1: 2.0, 2: 2.1, 4: 2.3, 8: 2.8, 16: 4.0}[size])
    kept = []
    for _ in range(64):
        size = sizer.choose(1, [FakeRequest()], 0.0, 0)
        kept.append((size, sizer.set_aside))
    assert [s for s, _ in kept] == [0] * 63 + [1]
    assert [k for _, k in kept[:63]] == [False] * (64 - PENDING_ROWS) + [True] * (PENDING_ROWS - 1)
    assert sizer.choose(1, [FakeRequest(remaining=1)], 0.0, 0) == 0 and not sizer.set_aside  # about to end
    sizer.forced, sizer.forced_set_aside = 0, False
    assert sizer.choose(1, [FakeRequest()], 0.0, 0) == 0 and not sizer.set_aside


def test_a_closed_batch_takes_the_size_whose_slowest_request_ends_first():
    """Trees of 4 commit 4 tokens for 2.3 plain steps' time. Per round that beats plain steps, and
    while the requests keep up with the pooled rates a closed batch (generate, nothing queued)
    takes trees too. Once one request accepts far less than the rest, the batch ends when it does,
    and it ends sooner with plain steps; an open batch (a server) still takes the trees' rate."""
    sizer = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 2.2, 2: 2.25, 4: 2.3, 8: 2.8, 16: 4.0})), [1, 2, 3])
    fast, slow = FakeRequest(100), FakeRequest(100)
    assert [sizer.choose(1, [fast, slow], 0.0, 0, closed=True) for _ in range(HOLD_ROUNDS)] == [4] * HOLD_ROUNDS
    fast.accepted_nodes, fast.expected_nodes = 90.0, 90.0
    slow.accepted_nodes, slow.expected_nodes = 2.0, 90.0  # its tokens at 4: 1 + 3 (2 + prior) / (90 + prior)
    assert sizer.choose(1, [fast, slow], 0.0, 0, closed=True) == 0  # the next full choice, after the hold
    assert sizer.choose(1, [fast, slow], 0.0, 0) == 4
    sizer.state.held = None
    slow.remaining = 20  # the lagging request is nearly done: the other's end counts
    assert sizer.choose(1, [fast, slow], 0.0, 0, closed=True) == 4


@pytest.mark.parametrize("spread", [True, False])
def test_a_closed_batch_of_many_requests_needs_a_margin_that_covers_the_rounds_luck(spread):
    """Trees of 4 commit 3 tokens a round on average for 2.7 plain steps' time: 11% better per
    round. One request waited for alone still takes them; a batch of 32 ends with its unluckiest
    request, and when rounds commit 5 or 1 tokens at random (variance 4) that one needs about 8
    rounds more than the mean: plain steps end it first, and probes, which could not change
    that, are skipped. Rounds that always commit 3: trees."""
    sizer = TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 2.2, 2: 2.25, 4: 2.7, 8: 3.0, 16: 4.0}))
    rows = [path([1, 2, 3, 4])[0], path([])[0]] if spread else [path([1, 2])[0]] * 2
    for _ in range(8):
        sizer.state.ledger.observe(np.array(rows), np.array([5, 1] if spread else [3, 3]), 16)
    assert sizer.state.ledger.tokens(4) == pytest.approx(3.0)
    assert sizer.choose(1, [FakeRequest(100)], 0.0, 0, closed=True) == (4 if spread else 2)
    sizer.state.held = None
    batch = [FakeRequest(100) for _ in range(32)]
    assert sizer.choose(1, batch, 0.0, 0, closed=True) == (0 if spread else 2)
    if spread:  # trees expected to end the batch 15% after plain steps: no probe, no rows set aside for one
        for _ in range(200):
            assert sizer.choose(1, batch, 0.0, 0, closed=True) == 0 and not sizer.set_aside
        assert sizer.state.wait == sizer.max_wait


def test_learning_a_round_counts_each_request_s_accepted_and_expected_nodes():
    sizer = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 2.0, 2: 2.1, 4: 2.3, 8: 2.8, 16: 4.0})), [1, 2])
    width = result_width(DEPTH, 0)
    result = np.full((3, width + DEPTH + 1), -1, dtype=np.int64)
    result[:, 0] = [4, 0, 1]  # slot 1 sat the round out
    result[0, width : width + 4], result[2, width] = [0, 1, 2, 3], 0
    a, b, c = FakeRequest(), FakeRequest(), FakeRequest()
    sizer.learn([a, b, c], [0, 1, 2], result, type("Plan", (), {"paths": True, "experts": False, "budget": 4}), 0)
    expected = sizer.state.ledger.tokens(4) - 1.0  # the pooled rates with this round in them
    assert 1.5 < expected < 2.5
    assert (a.accepted_nodes, a.expected_nodes) == (3.0, pytest.approx(expected))
    assert (b.accepted_nodes, b.expected_nodes) == (0.0, 0.0)
    assert (c.accepted_nodes, c.expected_nodes) == (0.0, pytest.approx(expected))


def test_a_plain_run_holds_until_its_probe_unless_its_batch_or_a_cost_changes():
    """Between probes a plain run is not chosen again (host time per step), while its batch keeps
    its bucket, its requests and its switches; a plain step's cost seen far from the table's makes
    the next step choose again."""
    sizer = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 2.0, 2: 2.1, 4: 2.3, 8: 2.8, 16: 4.0}), first_wait=64,
                             max_wait=64), [])
    request = FakeRequest()
    assert sizer.choose(1, [request], 0.0, 0) == 0 and (sizer.state.held.key, sizer.state.held.size) == ((1, 0, False, 1, False), 0)
    sizer.state.ledger.observe(np.array([path([1, 2, 3, 4, 5, 6, 7])[0]] * 8), np.array([8] * 8), 16)
    assert sizer.choose(1, [request], 0.0, 0) == 0  # held: what trees would commit now is not looked at
    assert sizer.choose(1, [request, FakeRequest()], 0.0, 0) > 0  # another request: chosen again
    plain = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0, 16: 2.0}), first_wait=64,
                             max_wait=64), [1], 4)
    feed(plain.state.ledger, [], 16, 4)
    assert plain.choose(1, [request], 0.0, 0) == 0
    plain.observe_step(1, 0, 1.01)  # about the table's cost: still held
    assert plain.state.held is not None
    for _ in range(2):
        plain.observe_step(1, 0, 2.0)
    assert plain.state.held is None and plain.choose(1, [request], 0.0, 0) > 0


def test_a_tree_size_holds_a_few_rounds_and_a_request_near_its_end_ends_the_hold():
    """A tree size chosen in full holds HOLD_ROUNDS rounds while the batch stays as it was (its
    exploration on its clock); a request about to end makes the next round choose again."""
    sizer = taught(TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 1.5, 2: 1.6, 4: 1.7, 8: 2.0, 16: 3.0})), [1, 2])
    request = FakeRequest()
    assert sizer.choose(1, [request], 0.0, 0) == 2 and sizer.state.held.rounds_left == HOLD_ROUNDS - 1
    feed(sizer.state.ledger, [1, 2, 3, 4, 5, 6, 7], 16, rounds=40)  # trees of 8 would now pay more
    assert [sizer.choose(1, [request], 0.0, 0) for _ in range(HOLD_ROUNDS - 1)] == [2] * (HOLD_ROUNDS - 1)
    assert sizer.choose(1, [request], 0.0, 0) == 8  # chosen again in full
    request.remaining = 1
    assert sizer.choose(1, [request], 0.0, 0) == 0  # one token left: a tree adds nothing, held or not
