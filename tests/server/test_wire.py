"""What the engine-core process sends per turn: chunks and usage pickled as their fields, and the
turn's counter increments summed into one update per counter."""

import pickle

from ddtree.server.core_process import _Outbox, _RecordedMetrics
from ddtree.server.jobs import Chunk, Usage


def test_chunks_and_usage_survive_pickling_field_for_field():
    usage = Usage(7, 3, "ddtree", "auto", 2, 1.5, seed=11)
    for chunk in (Chunk("", 1, usage, token_ids=(5,)), Chunk("é\n", 3, usage, "stop", (1, 2, 3)),
                  Chunk("x", 0, Usage(1, 0, "ar", None))):
        back = pickle.loads(pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL))
        assert back == chunk and type(back.usage) is Usage and back is not chunk


def test_a_turns_counter_increments_are_one_update_each_and_observations_stay():
    outbox = _Outbox()
    metrics = _RecordedMetrics(outbox)
    for count in (1, 4, 2):
        metrics.generated_tokens.inc(count)
    metrics.time_to_first_token.observe(0.25)
    metrics.engine_step_failures.inc()
    metrics.time_to_first_token.observe(0.5)
    _, updates = outbox.take()
    assert updates == [("generated_tokens", "inc", 7), ("engine_step_failures", "inc", 1),
                       ("time_to_first_token", "observe", 0.25), ("time_to_first_token", "observe", 0.5)]
    assert outbox.take() == ([], [])  # taken: the next turn starts empty
