"""What a new user meets first (issue 37), through real processes where a user would run one:
prompts on standard input, the Python API's kept round costs, errors that name their flag, the
seed in text mode, a CUDA device that is not there, and --version without torch."""

import json
import logging
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from ddtree import Engine  # noqa: E402
from ddtree.engine.kept_costs import cache_dir  # noqa: E402

from .pairs import EOS, make_pair  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir, _ = make_pair(tmp_path_factory.mktemp("first"), tokenizer=True, eos_token_id=EOS)
    return str(target_dir), str(drafter_dir)


def ddtree(*argv, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddtree", *argv], input=stdin, capture_output=True, text=True,
                          timeout=300)


def records(run: subprocess.CompletedProcess) -> list[dict]:
    assert run.returncode == 0, run.stderr
    return [json.loads(line) for line in run.stdout.splitlines()]


def test_standard_input_is_one_prompt_or_one_per_line(pair):
    target, _ = pair
    common = ["generate", "--target", target, "--device", "cpu", "--mode", "ar", "--max-new-tokens", "5", "--json"]
    by_argument = records(ddtree(*common, "def f(", "x = [1, 2"))
    assert len(by_argument) == 2
    # echo's final newline is not part of the prompt
    assert records(ddtree(*common, "-", stdin="def f(\n"))[0]["token_ids"] == by_argument[0]["token_ids"]
    lines = records(ddtree(*common, "--lines", "-", stdin="def f(\n\nx = [1, 2\n"))
    assert [r["token_ids"] for r in lines] == [r["token_ids"] for r in by_argument]
    empty = ddtree(*common, "-", stdin="\n")
    assert empty.returncode == 2 and empty.stderr.strip() == "ddtree generate: error: standard input held no prompt"
    mixed = ddtree(*common, "-", "x")
    assert mixed.returncode == 2 and mixed.stderr.strip() == "ddtree generate: error: - (standard input) must be the only prompt"
    assert "standard input" in " ".join(ddtree("generate", "--help").stdout.split())


def test_the_api_keeps_the_round_costs_it_measured(pair, monkeypatch, caplog):
    """Engine.from_pretrained uses and keeps the table as the commands do; "fresh" measures again,
    "off" neither reads nor writes; the measurement says so in a log line."""
    import ddtree.engine.profiling as profiling

    target, drafter = pair
    load = dict(device="cpu", max_batch=1, max_budget=8)
    calls = []
    measure = profiling.measure_round_costs
    monkeypatch.setattr(profiling, "measure_round_costs", lambda *a, **k: calls.append(1) or measure(*a, **k))
    params = dict(max_new_tokens=6)
    with caplog.at_level(logging.INFO, logger="ddtree.engine"):
        first = Engine.from_pretrained(target, drafter, **load).generate(["a"], **params)
    assert calls == [1] and "measuring round costs for batch buckets [1]" in caplog.text
    kept = list((cache_dir() / "round_costs").glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["format"] == "ddtree.round_costs/1"
    assert f"round costs kept in {kept[0]}" in caplog.text

    again = Engine.from_pretrained(target, drafter, **load)
    assert again.sizer.costs is not None and again.sizer.costs.buckets() == [1]
    assert again.generate(["a"], **params)[0].token_ids == first[0].token_ids and calls == [1]
    Engine.from_pretrained(target, drafter, kept_costs="fresh", **load).generate(["a"], **params)
    assert calls == [1, 1]
    kept[0].unlink()
    off = Engine.from_pretrained(target, drafter, kept_costs="off", **load)
    off.generate(["a"], **params)
    assert calls == [1, 1, 1] and not kept[0].exists()
    with pytest.raises(ValueError, match='kept_costs must be "use", "fresh" or "off", got \'always\''):
        Engine.from_pretrained(target, drafter, kept_costs="always", **load)


@pytest.mark.parametrize("argv,message", [
    (["--seed", "-1"], "ddtree generate: error: argument --seed: must be in [0, 9223372036854775807], got -1"),
    (["--stop", ""], "ddtree generate: error: argument --stop: must not be empty"),
    (["--lines"], "ddtree generate: error: --lines reads prompts from standard input: give - as the prompt"),
])
def test_mistakes_past_the_flags_name_them_and_exit_2(argv, message):
    run = ddtree("generate", "--mode", "ar", *argv, "x")
    assert run.returncode == 2 and run.stderr.strip() == message, run.stderr


def test_a_directory_without_a_config_and_a_prompt_too_long_exit_2(pair, tmp_path):
    target, _ = pair
    (tmp_path / "weights.safetensors").write_bytes(b"")
    run = ddtree("generate", "--target", target, "--drafter", str(tmp_path), "x")
    assert run.returncode == 2 and run.stderr.strip() == (
        f"ddtree generate: error: --drafter {tmp_path}: no config.json there (a Hugging Face model directory holds one)")
    run = ddtree("generate", "--target", target, "--device", "cpu", "--mode", "ar", "--max-model-len", "8",
                 "--max-new-tokens", "4", "a", "a b c d e f g")
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("ddtree generate: error: prompt 2: prompt (")


def test_text_mode_reports_the_seed_that_replays_it(pair):
    target, _ = pair
    common = ["generate", "--target", target, "--device", "cpu", "--mode", "ar", "--max-new-tokens", "8",
              "--temperature", "1.5", "x"]
    first = ddtree(*common)
    assert first.returncode == 0, first.stderr
    stats = [line for line in first.stderr.splitlines() if "mean acceptance length" in line]
    assert len(stats) == 1 and ", seed " in stats[0]
    seed = int(stats[0].split(", seed ")[1].split(",")[0])
    replay = ddtree(*common, "--seed", str(seed))
    assert replay.returncode == 0 and replay.stdout == first.stdout
    greedy = ddtree(*common[:-3], "x")
    assert greedy.returncode == 0 and ", seed " not in greedy.stderr  # greedy: nothing to replay


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_the_api_names_a_cuda_device_that_is_not_there(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match=r"^device cuda: this torch has no CUDA device \(torch .*\); use cpu$"):
        Engine.from_pretrained(target, drafter, device="cuda")
    with pytest.raises(ValueError, match="device tpu: not a device"):
        Engine.from_pretrained(target, drafter, device="tpu")


def test_version_and_help_print_without_importing_torch():
    code = ("import sys\nfrom ddtree.cli import main\n"
            "for argv in (['--version'], ['--help'], ['generate', '--help'], ['serve', '--help'], ['profile', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr.strip() == "False", run.stderr
    assert ddtree("--version").stdout.strip().startswith("ddtree ")


def test_what_the_users_directories_and_files_hold_is_their_mistake(tmp_path):
    """A model directory or --round-costs file that cannot be read: one line naming it, exit 2."""
    (tmp_path / "config.json").write_text("{}")
    run = ddtree("generate", "--target", str(tmp_path), "--mode", "ar", "x")
    assert run.returncode == 2 and run.stderr.strip() == (
        f"ddtree generate: error: {tmp_path / 'config.json'} lacks 'vocab_size', which a DeepSeek-V3 / Kimi K2 "
        "config holds")
    (tmp_path / "config.json").write_text("not json")
    run = ddtree("generate", "--target", str(tmp_path), "--mode", "ar", "x")
    assert run.returncode == 2 and run.stderr.strip().startswith(
        f"ddtree generate: error: {tmp_path / 'config.json'} is not valid JSON (")
    run = ddtree("generate", "--round-costs", str(tmp_path), "x")
    assert run.returncode == 2 and run.stderr.strip() == f"ddtree generate: error: --round-costs {tmp_path}: no such file"


def test_an_unknown_flag_is_named_with_the_closest_one():
    run = ddtree("generate", "--max-new-tokenz", "4", "x")
    assert run.returncode == 2 and run.stderr.strip() == (
        "ddtree generate: error: unrecognized arguments: --max-new-tokenz; did you mean --max-new-tokens?")
    run = ddtree("--bogus")
    assert run.returncode == 2 and run.stderr.strip() == "ddtree: error: unrecognized arguments: --bogus"


def test_a_cpu_cost_table_belongs_to_its_thread_count(pair):
    """A server leaves a core to its HTTP side: its table must not stand in for a command's."""
    target, drafter = pair
    threads = torch.get_num_threads()
    engine = Engine.from_pretrained(target, drafter, device="cpu", max_batch=1, kept_costs="off")
    assert engine.signature["cpu_threads"] == threads
    try:
        torch.set_num_threads(threads + 1)
        assert Engine.from_pretrained(target, drafter, device="cpu", max_batch=1,
                                      kept_costs="off").signature["cpu_threads"] == threads + 1
    finally:
        torch.set_num_threads(threads)

