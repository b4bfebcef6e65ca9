"""The engine over 2 and 4 gloo ranks, rank 0 driving (Engine.from_pretrained(tensor_parallel=N)):
what it generates in ar, chain, ddtree and auto, greedy and seeded, with 16-bit and INT4 experts, is
token for token what one process generates; a rank that dies, or hangs, fails the next step with
an error (the hung one within DDTREE_TP_TIMEOUT_S)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from ddtree import Engine  # noqa: E402
from ddtree.parallel.relay import RankLost  # noqa: E402

from ..engine.pairs import prompts  # noqa: E402

SETTINGS = dict(max_batch=4, page_size=8, max_model_len=96, num_pages=48, stop_token_ids=())
RUNS = [("ar", 1, {}), ("chain", 1, {}), ("ddtree", 6, {}), ("ddtree", "auto", {}),
        ("ddtree", 6, dict(temperature=0.9, top_p=0.9, seed=7)), ("ddtree", "auto", dict(temperature=1.1, seed=3))]


def flat_costs(engine: Engine):
    """A cost table that makes trees cheap (auto takes trees and probes plain steps), so that no
    measurement runs: this test is about what ranks compute, not what rounds cost."""
    from ddtree.engine.costs import RoundCosts

    row = {s: 1.0 if s == 0 else 1.2 + s / 1000 for s in engine.sizer.sizes}
    return RoundCosts(engine.signature, {b: dict(row) for b in (1, 2, 4)})


def generate_all(engine: Engine) -> list:
    batch = prompts(5, 96, seed=11)  # 5 prompts through 4 slots: admission and release mid-batch
    return [[o.token_ids for o in engine.generate(batch, max_new_tokens=10, mode=mode, budget=budget, **sampling)]
            for mode, budget, sampling in RUNS]


@pytest.mark.parametrize("experts,world", [("bf16", 2), ("int4", 2), ("bf16", 4)])
def test_ranks_generate_what_one_process_generates(checkpoints, experts, world):
    args = dict(device="cpu", dtype=torch.float32, **SETTINGS)
    one = Engine.from_pretrained(checkpoints / experts, checkpoints / "drafter", **args)
    one.sizer.costs = flat_costs(one)
    want = generate_all(one)
    engine = Engine.from_pretrained(checkpoints / experts, checkpoints / "drafter", tensor_parallel=world, **args)
    engine.sizer.costs = flat_costs(engine)  # the sizer runs on rank 0 alone; measuring is a plain step loop
    try:  # rank 0's share: its vocabulary rows and experts
        assert engine.target.embed_tokens.num_embeddings == 96 // world
        assert engine.target.layers[1].mlp.local == slice(0, 8 // world)
        assert generate_all(engine) == want
    finally:
        engine.close()
    engine.close()  # twice: nothing more to release


def test_a_dead_rank_fails_the_next_step(checkpoints):
    engine = Engine.from_pretrained(checkpoints / "bf16", checkpoints / "drafter", tensor_parallel=2, device="cpu",
                                    dtype=torch.float32, **SETTINGS)
    try:
        for process in engine.ranks.processes.processes:
            process.kill()
            process.join()
        with pytest.raises(RuntimeError, match="a tensor-parallel rank is gone .its process died or stopped answering."):
            engine.generate(prompts(1, 96, seed=1), max_new_tokens=4, mode="ar")
    finally:
        engine.close()  # tolerates the dead follower


def test_a_hung_rank_fails_the_step_within_the_timeout(checkpoints, monkeypatch):
    """A rank that stops answering (SIGSTOP: alive, silent) fails the next step with an error
    within DDTREE_TP_TIMEOUT_S, rather than hanging."""
    import os
    import signal
    import time

    monkeypatch.setenv("DDTREE_TP_TIMEOUT_S", "20")  # the ranks' start-up under a loaded CI machine fits in it
    engine = Engine.from_pretrained(checkpoints / "bf16", checkpoints / "drafter", tensor_parallel=2, device="cpu",
                                    dtype=torch.float32, **SETTINGS)
    follower = engine.ranks.processes.processes[0]
    try:
        os.kill(follower.pid, signal.SIGSTOP)
        start = time.monotonic()
        # the relayed call's send, or a collective of rank 0's own part, times out first
        lost = "a tensor-parallel (rank is gone|.* failed on rank 0, so the ranks are out of step)"
        with pytest.raises(RankLost, match=lost):
            engine.generate(prompts(1, 96, seed=1), max_new_tokens=4, mode="ar")
        assert time.monotonic() - start < 60  # the 20 s timeout, not the default 120 s, nor forever
    finally:
        os.kill(follower.pid, signal.SIGKILL)
        follower.join()
        engine.close()


@pytest.mark.parametrize("value", ["0", "-3", "soon"])
def test_a_bad_rank_timeout_is_one_clear_error(value, monkeypatch):
    from ddtree.parallel.launch import rank_timeout

    monkeypatch.setenv("DDTREE_TP_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=f"DDTREE_TP_TIMEOUT_S must be a positive number of seconds, got '{value}'"):
        rank_timeout()


def _children(pid: int) -> list[int]:
    """The live child processes of `pid` (from /proc)."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def test_a_lost_rank_ends_the_server_with_its_error(checkpoints):
    """`ddtree serve --tensor-parallel 2`'s engine-core process with its follower killed: the
    request fails with 503 engine_dead naming the lost rank, the server is told to end (on_death),
    and the core process exits (its ranks with it)."""
    import functools
    import os
    import signal
    import threading
    import time

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from ddtree.server.app import ServerConfig, create_app, engine_facts
    from ddtree.server.engine_core import EngineCore

    from ..server.harness import LiveServer

    build = functools.partial(Engine.from_pretrained, str(checkpoints / "bf16"), str(checkpoints / "drafter"),
                              tensor_parallel=2, device="cpu", dtype=torch.float32, **SETTINGS)
    core = EngineCore(build, engine_facts, max_queue=8)
    core.launch()
    died = threading.Event()
    core.on_death = died.set
    try:
        with LiveServer(create_app(core, ServerConfig(model_name="tiny", default_mode="ar"))) as live:
            followers = _children(core.pid)
            assert followers, "the core started no rank"
            for pid in followers:
                os.kill(pid, signal.SIGKILL)
            answer = httpx.post(f"{live.url}/v1/completions", json={"prompt": [5, 9, 11], "max_tokens": 4},
                                timeout=120)
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_dead", answer.text
            assert "a tensor-parallel rank is gone" in answer.json()["error"]["message"]
            assert died.wait(10) and "a tensor-parallel rank is gone" in core.died
            deadline = time.monotonic() + 30
            while core._process.is_alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not core._process.is_alive() and core._process.exitcode == 1
    finally:
        core.stop(timeout_s=5)
