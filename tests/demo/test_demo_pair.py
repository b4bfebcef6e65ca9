"""The demo pair shipped in the package: an ordinary Hugging Face checkpoint within its size
budget, loaded by default, lossless against ar and accepting several tokens a round on the CPU."""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from ddtree import Engine  # noqa: E402
from ddtree.cli import main  # noqa: E402
from ddtree.demo import DRAFTER_DIR, TARGET_DIR, demo_pair  # noqa: E402
from ddtree.models import load_target  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "demo_prompts.jsonl"


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(device="cpu", max_budget=16, max_batch=4)


def held_out_prompts(count: int) -> list[str]:
    return [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()[:count]]


def test_shipped_files_fit_the_budget():
    assert demo_pair() == (TARGET_DIR, DRAFTER_DIR)
    files = [p for d in (TARGET_DIR, DRAFTER_DIR) for p in d.iterdir()]
    assert sum(p.stat().st_size for p in files) <= 32 << 20
    assert max(p.stat().st_size for p in files) <= 16 << 20
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        assert (TARGET_DIR / name).is_file()


def test_transformers_reads_the_target_as_deepseek_v3():
    import transformers

    ours = load_target(TARGET_DIR, dtype=torch.float32)
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    ids = torch.tensor([[313, 285, 3588, 270, 1064, 605, 9, 79, 296, 265, 426, 1971]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits.float(), ours.logits(ids), rtol=1e-4, atol=1e-4)


def test_default_pair_is_lossless_and_accepts_several_tokens(engine):
    assert engine.tokenizer is not None and engine.drafter is not None
    prompts = held_out_prompts(3)
    ar = engine.generate(prompts, max_new_tokens=32, mode="ar")
    for mode in ("chain", "ddtree"):
        outs = engine.generate(prompts, max_new_tokens=32, mode=mode, budget=16)
        assert [o.token_ids for o in outs] == [a.token_ids for a in ar]
        lengths = [n for o in outs for n in o.stats.acceptance_lengths]
        assert sum(lengths) / len(lengths) >= 2.0, (mode, lengths)  # a random drafter gets ~1


def test_generate_with_no_checkpoint_named(engine, capsys):
    prompt = "def fibonacci(n):"
    assert main(["generate", prompt, "--max-new-tokens", "16", "--budget", "16", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    # the demo pair's completion: the prompt, then what ar gives (greedy trees are lossless), then a newline
    want = engine.generate([prompt], max_new_tokens=16, mode="ar")[0].text
    assert want and out == prompt + want + "\n"
    assert "mean acceptance length" in err
