"""server/responses.py: a stream's events rendered from a cached head equal the dict path's."""

import json
import random

import pytest

from ddtree.server.jobs import Usage
from ddtree.server.responses import ResponseShape, sse


def _texts(rng: random.Random) -> list[str]:
    alphabet = ['a', ' ', '"', '\\', '\n', '\t', '\x00', '\x1f', 'é', '中', '🙂', '</', "'"]
    return [""] + ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12))) for _ in range(40)]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_chunk_events_equal_the_dict_paths_byte_for_byte(kind):
    rng = random.Random(3)
    for request_id, model in (("cmpl-1", "ddtree-demo"), ('id "quoted" \\', "modèle/中")):
        shape = ResponseShape(kind, request_id, model)
        for text in _texts(rng):
            for finish in (None, "stop", "length"):
                for usage in (None, Usage(rng.randrange(100), rng.randrange(100), "ddtree", "auto", 3, 4.25, 7)):
                    event = shape.chunk_event(text, finish, usage)
                    assert event == sse(shape.chunk(text, finish, usage))
                    body = json.loads(event.decode("utf-8")[len("data: "):])
                    assert body["id"] == request_id and body["choices"][0]["finish_reason"] == finish
