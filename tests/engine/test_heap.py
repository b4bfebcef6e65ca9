"""frozen_heap: what is alive at start-up leaves the collector's walks while serving, and comes
back after; the commands step their engines inside it."""

import gc

import pytest

from ddtree.engine.heap import frozen_heap


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def test_the_heap_alive_at_the_freeze_is_frozen_until_the_exit():
    assert gc.get_freeze_count() == 0
    alive = [Node() for _ in range(1000)]
    with frozen_heap() as frozen:
        assert frozen >= 1000 and gc.get_freeze_count() >= 1000  # at least our nodes: every object alive
        tracked = len(gc.get_objects())
        assert tracked < frozen  # a walk now skips them (on a process of any size)
        young = Node()  # a cycle made while serving is still collected
        del young
        assert gc.collect() >= 1
    assert gc.get_freeze_count() == 0 and len(alive) == 1000


def test_the_heap_comes_back_when_the_body_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with frozen_heap():
            raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_generate_steps_its_engine_in_a_frozen_heap(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    from ddtree.cli import main
    from ddtree.engine import Engine

    from .pairs import EOS, make_pair

    target, drafter, _ = make_pair(tmp_path, tokenizer=True, eos_token_id=EOS)
    frozen = []
    step = Engine.step

    def counting_step(self):
        frozen.append(gc.get_freeze_count())
        return step(self)

    monkeypatch.setattr(Engine, "step", counting_step)
    assert main(["generate", "--target", str(target), "--drafter", str(drafter), "--device", "cpu",
                 "--max-new-tokens", "4", "--mode", "ar", "x"]) == 0
    assert frozen and min(frozen) > 1000 and gc.get_freeze_count() == 0
