"""RoundCosts: measured values, interpolation only between measured sizes, JSON with the pair's
signature, and clear refusals of a table that does not fit."""

import json

import pytest

from ddtree.engine.costs import FORMAT, RoundCosts, StepCorrection

SIGNATURE = {"device": "cpu", "dtype": "float32", "cuda_graphs": False, "target": {"hidden_size": 64}}


def table() -> RoundCosts:
    return RoundCosts(dict(SIGNATURE), {1: {0: 0.001, 4: 0.003, 16: 0.007}, 2: {0: 0.002, 16: 0.01}}, {"prefix": 8},
                      {1: {0: 1.0, 4: 2.5, 16: 3.0}})


def test_measured_and_interpolated_costs():
    costs = table()
    assert costs.cost(1, 4) == 0.003
    assert costs.cost(1, 10) == pytest.approx(0.003 + 0.004 * 6 / 12)
    assert costs.cost(1, 2) == pytest.approx(0.002)
    assert costs.has(1, (0, 4, 16)) and not costs.has(2, (0, 4))
    with pytest.raises(KeyError, match="outside the sizes measured at bucket 1"):
        costs.cost(1, 17)
    with pytest.raises(KeyError, match=r"no costs measured at batch bucket 4 \(measured: \[1, 2\]\)"):
        costs.cost(4, 0)


def test_json_round_trip_and_signature_checks(tmp_path):
    path = tmp_path / "costs.json"
    table().save(path)
    assert json.loads(path.read_text())["format"] == FORMAT
    back = RoundCosts.load(path, SIGNATURE)
    assert back.seconds == table().seconds and back.details == {"prefix": 8}
    assert back.tokens == table().tokens and back.tokens_per_step(1, 5) == 2.5 and back.tokens_per_step(2, 0) == 0.0
    with pytest.raises(ValueError, match=r"measured for dtype = 'float32', but this engine has 'bfloat16'"):
        RoundCosts.load(path, {**SIGNATURE, "dtype": "bfloat16"})
    with pytest.raises(ValueError, match="measured for target"):
        RoundCosts.load(path, {**SIGNATURE, "target": {"hidden_size": 128}})


@pytest.mark.parametrize("text,match", [
    ("{", "is not valid JSON"),
    ('{"format": "other"}', "is not a ddtree round-cost table"),
    (json.dumps({"format": FORMAT, "seconds": {"1": {"0": -1.0}}}), "bucket 1 has invalid entries"),
    (json.dumps({"format": FORMAT, "seconds": {"1": "fast"}}), "malformed 'seconds'"),
    (json.dumps({"format": FORMAT, "seconds": {"0": {"0": 1.0}}}), "bucket 0 has invalid entries"),
])
def test_bad_files_are_refused(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        RoundCosts.load(path)


def test_merge_takes_the_other_tables_values():
    costs = table()
    costs.merge(RoundCosts(dict(SIGNATURE), {2: {4: 0.005}, 8: {0: 0.004}}))
    assert costs.seconds[2] == {0: 0.002, 16: 0.01, 4: 0.005} and costs.buckets() == [1, 2, 8]
    with pytest.raises(ValueError, match="merged table was measured for device"):
        costs.merge(RoundCosts({**SIGNATURE, "device": "NVIDIA H200"}, {}))


def test_step_correction_learns_how_far_the_table_is_off():
    correction = StepCorrection(memory=4, min_count=2)
    assert correction.ratio(1, 4) == correction.ratio(1, 0) == 1.0  # nothing seen: the table as it is
    correction.observe(1, 4, seconds=3.0, predicted=1.5)
    assert correction.ratio(1, 4) == 1.0  # one step is not enough
    correction.observe(1, 4, seconds=2.0, predicted=1.0)
    assert correction.ratio(1, 4) == pytest.approx(2.0)
    assert correction.ratio(1, 16) == pytest.approx(2.0)  # a tree size not seen: the bucket's trees' ratio
    assert correction.ratio(1, 0) == 1.0 and correction.ratio(2, 4) == 1.0  # plain steps, other buckets: their own
    for _ in range(3):
        correction.observe(1, 0, seconds=0.5, predicted=1.0)
    assert correction.ratio(1, 0) == pytest.approx(0.5) and correction.ratio(1, 4) == pytest.approx(2.0)
    correction.observe(1, 4, seconds=1000.0, predicted=1.0)  # a stall, one step in three: moves nothing
    assert correction.ratio(1, 4) == pytest.approx(2.0) and correction.ratios[(1, 4)][1] == 3
    correction.observe(1, 4, seconds=3.0, predicted=1.0)  # the median of the last four: 2, 2, 3, 4
    assert correction.ratio(1, 4) == pytest.approx(2.5)
    for _ in range(3):  # only the last `memory` steps count: the old ratios are gone
        correction.observe(1, 4, seconds=1.0, predicted=1.0)
    assert correction.ratio(1, 4) == pytest.approx(1.0) and correction.ratio(1, 32) == pytest.approx(1.0)


def test_a_correction_expires_after_horizon_steps_of_other_shapes():
    """Plain steps once read at 2x the table, then only trees for `horizon` steps: the plain step
    falls back to the table's cost (so it is tried again), and a fresh reading counts alone."""
    correction = StepCorrection(memory=4, min_count=2, horizon=10)
    for _ in range(2):
        correction.observe(1, 0, seconds=2.0, predicted=1.0)
    assert correction.ratio(1, 0) == pytest.approx(2.0)
    for step in range(9):
        correction.observe(1, 8, seconds=1.0, predicted=1.0)
        assert correction.ratio(1, 0) == pytest.approx(2.0 if step < 8 else 1.0)  # the first gone 10 steps on
        assert correction.seen(1, 0) == (step < 8)  # expired: as never seen (tried in bursts, probed twice)
    for _ in range(2):
        correction.observe(1, 0, seconds=1.1, predicted=1.0)
    assert correction.ratio(1, 0) == pytest.approx(1.1)  # the old 2.0s are gone, not averaged in
    assert correction.ratios[(1, 0)] == (pytest.approx(1.1), 4) and correction.ratio(1, 8) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="horizon >= 1"):
        StepCorrection(horizon=0)


def test_a_correction_read_between_readings_equals_one_computed_afresh():
    """Ratios read (and cached) between random readings of several shapes, with readings expiring,
    equal the median computed from every reading so far."""
    import random

    rng = random.Random(7)
    memory, min_count, horizon = 5, 2, 12
    correction = StepCorrection(memory=memory, min_count=min_count, horizon=horizon)
    shapes = [(1, 0), (1, 4), (1, 8), (8, 0)]
    readings = []  # (step, bucket, size, ratio)

    def afresh(bucket, size):
        step = len(readings)
        for key_size in [size] + ([StepCorrection.ANY_TREE] if size > 0 else []):
            mine = [r for s, b, z, r in readings if b == bucket and (z == key_size or (key_size < 0 and z > 0))]
            steps = [s for s, b, z, r in readings if b == bucket and (z == key_size or (key_size < 0 and z > 0))]
            kept = sorted(r for s, r in zip(steps[-memory:], mine[-memory:]) if s > step - horizon)
            if len(kept) >= min_count:
                half = len(kept) // 2
                return kept[half] if len(kept) % 2 else (kept[half - 1] + kept[half]) / 2
        return 1.0

    for _ in range(400):
        bucket, size = shapes[rng.randrange(len(shapes))] if rng.random() < 0.9 else (1, 16)
        ratio = round(rng.uniform(0.6, 3.5), 3)
        correction.observe(bucket, size, seconds=ratio, predicted=1.0)
        readings.append((len(readings) + 1, bucket, size, ratio))
        for b, z in shapes + [(1, 16), (8, 4)]:
            assert correction.ratio(b, z) == pytest.approx(afresh(b, z)), (len(readings), b, z)
