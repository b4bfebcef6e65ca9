"""The choice of a round's tree size as pure functions: best_size, the acceptance forecast and its
calibration, and TreeSizer on given cost tables and drafter probabilities."""

import math

import numpy as np
import pytest

from ddtree.engine.costs import RoundCosts
from ddtree.engine.forecast import NO_NODE, PATH_SCALE, AcceptanceForecast, Calibration, RequestForecast
from ddtree.engine.sizing import TreeSizer, best_size

SIZES = (1, 2, 4, 8, 16)
DEPTH = 7


class FakeRequest:
    def __init__(self, remaining=1000):
        self.forecast = RequestForecast()
        self.remaining = remaining

    def remaining_tokens(self):
        return self.remaining


def fixed(logps):
    """The fixed-point path log-probs a round reports, NO_NODE-padded to the sizer's info nodes."""
    out = [round(lp * PATH_SCALE) for lp in logps]
    return out + [NO_NODE] * (SIZES[-1] - len(out))


def observe(forecast: AcceptanceForecast, request: RequestForecast, logps, verified: int, accepted: list[int]):
    """One request's tree round read back: the path of `accepted` nodes (1-based) was committed."""
    path = [0] + accepted + [-1] * (DEPTH - len(accepted))
    forecast.observe([request], np.array([fixed(logps)]), verified, np.array([path]), np.array([1 + len(accepted)]))


def confident_chain(p=0.9, nodes=16):
    """Path log-probs of a drafter sure of one continuation: p, p^2, ... then small siblings."""
    return sorted([math.log(p) * (i + 1) for i in range(DEPTH)] + [math.log(0.01)] * (nodes - DEPTH), reverse=True)


def bushy(q=0.9, nodes=16):
    """Path log-probs of a drafter that spreads its mass: node i at q^i."""
    return [math.log(q) * (i + 1) for i in range(nodes)]


def costs(row: dict) -> RoundCosts:
    return RoundCosts({}, {1: dict(row), 4: {s: 2 * t for s, t in row.items()}})


def test_best_size_maximizes_tokens_per_second_and_breaks_ties_small():
    assert best_size([0, 4, 16], [1.0, 2.0, 4.0], [1.0, 3.0, 5.0]) == 4
    assert best_size([0, 4], [1.0, 2.0], [1.0, 2.0]) == 0
    assert best_size([0, 4], [1.0, 1.0], [1.0, 1.5]) == 4
    with pytest.raises(ValueError, match="one cost and one token count per size"):
        best_size([0, 4], [1.0], [1.0, 2.0])


def test_calibration_learns_acceptance_rates_by_path_probability():
    cal = Calibration(prior_weight=4.0, decay=1.0)
    logps = [0.0, math.log(0.6), math.log(0.4), math.log(0.2499), math.log(1e-9)]
    assert cal.bins(np.array(fixed(logps)[:5] + [NO_NODE])).tolist() == [0, 0, 1, 2, 15, 15]
    assert cal.rates()[0] == pytest.approx(2 ** -0.5)  # prior: the drafter is right
    for i in range(400):
        cal.observe(np.array([0, 1]), np.array([i % 2 == 0, False]))
    rates = cal.rates()
    assert rates[0] == pytest.approx(0.5, abs=0.02) and rates[1] < 0.01


def test_forecast_curve_scale_and_caps():
    fc = AcceptanceForecast(SIZES[-1], DEPTH, smoothing=0.0)
    request = RequestForecast()
    assert fc.expected_tokens([request], [0, 4], [100]) is None  # nothing read yet
    observe(fc, request, confident_chain(), verified=4, accepted=[1, 2, 3, 4])
    tokens = fc.expected_tokens([request], [0, 1, 4, 16], [100])[0]
    assert tokens[0] == 1.0 and np.all(np.diff(tokens) >= 0) and tokens[-1] <= 1 + DEPTH
    assert fc.expected_tokens([request], [16], [3])[0, 0] == 3.0  # no more than the request may take
    other = RequestForecast()
    # the pooled prior: the trees read so far, through the calibration as it is now (it learned
    # that this drafter was right, so the same tree now promises more than when it was read)
    pooled = fc.calibrated_curves(np.array([fixed(confident_chain())]))[0]
    assert fc.expected_tokens([other], [4], [100])[0, 0] == pytest.approx(1 + pooled[4]) and pooled[4] > request.curve[4]
    for _ in range(10):  # this request's drafter keeps failing: its own scale falls
        observe(fc, other, confident_chain(), verified=8, accepted=[])
    assert fc.expected_tokens([other], [8], [100])[0, 0] < 1.5 < fc.expected_tokens([request], [8], [100])[0, 0]


def test_sizer_picks_plain_steps_for_a_useless_drafter_and_large_trees_when_verify_is_free():
    steep = {0: 1.0, 1: 2.0, 2: 2.1, 4: 2.3, 8: 2.8, 16: 4.0}
    flat = {0: 1.0, 1: 1.01, 2: 1.02, 4: 1.03, 8: 1.04, 16: 1.05}
    useless, good = TreeSizer(SIZES, DEPTH, costs(steep)), TreeSizer(SIZES, DEPTH, costs(flat))
    r_useless, r_good = FakeRequest(), FakeRequest()
    for _ in range(6):
        observe(useless.forecast, r_useless.forecast, confident_chain(0.5), verified=4, accepted=[])
        observe(good.forecast, r_good.forecast, bushy(), verified=16, accepted=list(range(1, 8)))
    assert useless.choose(1, [r_useless], 0.0, 0) == 0
    assert good.choose(1, [r_good], 0.0, 0) == 16
    tokens = good.forecast.expected_tokens([r_good.forecast], [0, 8, 16], [1000])[0]
    assert tokens[2] > tokens[1] > 5  # it accepted all 7 depths every round
    good.costs = costs(steep)  # 16 nodes cost 4.0, 8 cost 2.8: the second 8 nodes add less than they cost
    assert tokens[2] / 4.0 < tokens[1] / 2.8 and good.choose(1, [r_good], 0.0, 0) == 8
    good.costs = costs({0: 1.0, 1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0})
    assert good.choose(1, [r_good], 0.0, 0) == 0  # trees cost more than their 8 tokens


def test_a_batch_is_sized_for_the_sum_of_its_requests():
    table = costs({0: 1.0, 1: 1.5, 2: 1.6, 4: 1.7, 8: 2.0, 16: 3.0})
    sizer = TreeSizer(SIZES, DEPTH, table)
    hopeless, keen = FakeRequest(), FakeRequest()
    for _ in range(6):
        observe(sizer.forecast, hopeless.forecast, confident_chain(0.5), verified=8, accepted=[])
        observe(sizer.forecast, keen.forecast, confident_chain(0.95), verified=16, accepted=list(range(1, 8)))
    alone = sizer.choose(1, [hopeless], 0.0, 0)
    together = sizer.choose(1, [hopeless, keen], 0.0, 0)
    assert alone == 0 and together > 0
    assert sizer.choose(4, [hopeless], 0.0, 0) == 0
    assert sizer.choose(1, [hopeless], 50.0, 0) > 0  # other requests' 50 tokens come either way: a tree adds


def test_sizer_without_costs_or_knowledge_takes_the_smallest_tree_and_respects_the_floor():
    request = FakeRequest()
    assert TreeSizer(SIZES, DEPTH, None).choose(1, [request], 0.0, 0) == 1
    sizer = TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0, 16: 2.0}))
    assert sizer.choose(1, [request], 0.0, 0) == 1  # no tree read anywhere yet
    observe(sizer.forecast, request.forecast, confident_chain(0.5), verified=4, accepted=[])
    assert sizer.choose(1, [request], 0.0, 5) >= 5  # another request needs 5 nodes
    sizer.forced = 8
    assert sizer.choose(1, [request], 0.0, 0) == 8
    assert sizer.choose(3, [request], 0.0, 0) == 8  # bucket 3 unmeasured: forced anyway
    sizer.forced = None
    assert sizer.unmeasured([1, 2, 4]) == [2]


def test_probes_come_back_with_doubling_waits():
    sizer = TreeSizer(SIZES, DEPTH, costs({0: 1.0, 1: 2.0, 2: 2.1, 4: 2.3, 8: 2.8, 16: 4.0}), first_wait=2, max_wait=8)
    request = FakeRequest()
    for _ in range(4):
        observe(sizer.forecast, request.forecast, confident_chain(0.5), verified=4, accepted=[])
    sizes = [sizer.choose(1, [request], 0.0, 0) for _ in range(40)]
    probes = [i for i, s in enumerate(sizes) if s > 0]
    assert set(sizes) == {0, 1}
    # One probe costs one plain step more here: the probe comes once the plain steps since the
    # last tree (the probe's own included) reach the wait, which doubles from 2 up to 8.
    assert probes[0] == 1 and np.diff(probes).tolist()[:4] == [4, 8, 8, 8]


def test_plain_steps_dearer_than_the_table_make_trees_pay():
    """A host-bound pair: the table says a plain step costs 1 and a tree 2, and the request
    accepts 1.5 tokens a round, so plain steps; real plain steps take 2 (the host's work per step
    the stand-ins hid): now a tree's 1.5 tokens for 2 s beat 1 token for 2 s."""
    table = costs({0: 1.0, 1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0, 16: 2.0})
    sizer = TreeSizer(SIZES, DEPTH, table)
    request = FakeRequest()
    for _ in range(6):
        observe(sizer.forecast, request.forecast, confident_chain(0.5), verified=16, accepted=[1])
    tokens = sizer.forecast.expected_tokens([request.forecast], [0, 16], [1000])[0]
    assert 1.2 < tokens[1] < 2.0
    assert sizer.choose(1, [request], 0.0, 0) == 0
    for _ in range(3):
        sizer.observe_step(1, 0, seconds=2.0)
    assert sizer.correction.ratio(1, 0) == 2.0 and sizer.choose(1, [request], 0.0, 0) > SIZES[0]


def test_trees_that_cost_more_than_the_table_says_are_given_up():
    """The table says a tree of 16 costs 2 plain steps and the request accepts 8 tokens a round; the
    engine then sees its trees take 10 times what the table predicted: plain steps win. Plain steps
    seen cheaper than predicted keep it there; trees seen at the table's cost bring trees back."""
    table = costs({0: 1.0, 1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0, 16: 2.0})
    sizer = TreeSizer(SIZES, DEPTH, table)
    request = FakeRequest()
    for _ in range(6):
        observe(sizer.forecast, request.forecast, confident_chain(0.99), verified=16, accepted=list(range(1, 8)))
    size = sizer.choose(1, [request], 0.0, 0)
    assert size > 0
    for _ in range(3):
        sizer.observe_step(1, size, seconds=20.0)
    assert sizer.correction.ratio(1, size) == 4.0  # 10x, clamped: 8 tokens for 8 s against 1 for 1 s
    assert sizer.choose(1, [request], 0.0, 0) == 0
    sizer.observe_step(4, 0, seconds=1.0)  # another bucket learns on its own
    assert sizer.correction.ratio(4, 0) == 1.0 and sizer.correction.ratio(1, 0) == 1.0
    for _ in range(16):
        sizer.observe_step(1, size, seconds=2.0)
    assert sizer.choose(1, [request], 0.0, 0) > 0
    seen = dict(sizer.correction.ratios)
    sizer.forced = 8
    sizer.observe_step(1, 8, seconds=100.0)  # the table's own measurement teaches nothing
    assert sizer.correction.ratios == seen


def test_the_pooled_prior_follows_the_calibration_at_once():
    """Requests with no tree of their own are forecast from recent trees read through the
    calibration as it is now: once the drafter is shown wrong, a new request expects little."""
    fc = AcceptanceForecast(SIZES[-1], DEPTH)
    first = RequestForecast()
    observe(fc, first, confident_chain(0.95), verified=16, accepted=list(range(1, 8)))
    fresh = RequestForecast()
    hopeful = fc.expected_tokens([fresh], [16], [100])[0, 0]
    assert hopeful > 5
    for _ in range(30):
        observe(fc, RequestForecast(), confident_chain(0.95), verified=16, accepted=[])
    assert fc.expected_tokens([fresh], [16], [100])[0, 0] < 1.5 < hopeful
