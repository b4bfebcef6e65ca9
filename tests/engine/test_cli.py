"""`ddtree generate`: streamed text and statistics, --json records, and one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from ddtree.cli import main  # noqa: E402

from .pairs import EOS, make_pair  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir, _ = make_pair(tmp_path_factory.mktemp("cli"), tokenizer=True, eos_token_id=EOS)
    return str(target_dir), str(drafter_dir)


def test_streams_text_then_statistics(pair, capsys):
    target, drafter = pair
    rc = main(["generate", "--target", target, "--drafter", drafter, "--device", "cpu", "--max-new-tokens", "12",
               "--budget", "8", "def f(x):", "import os"])
    out, err = capsys.readouterr()
    assert rc == 0
    # each prompt, then its completion, then a newline, in prompt order; greedy float32 trees
    # commit ar's tokens, so the completions are an ar engine's for the same prompts
    from ddtree import Engine

    prompts = ["def f(x):", "import os"]
    want = Engine.from_pretrained(target, drafter, device="cpu").generate(prompts, max_new_tokens=12, mode="ar")
    assert all(w.text for w in want)  # something to compare
    assert out == "".join(p + w.text + "\n" for p, w in zip(prompts, want))
    assert err.count("mean acceptance length") == 2 and "ms per stage: prefill" in err


def test_json_records_equal_across_modes(pair, capsys):
    target, drafter = pair
    records = {}
    for mode in ("ar", "ddtree"):
        assert main(["generate", "--target", target, "--drafter", drafter, "--device", "cpu", "--json", "--mode", mode,
                     "--max-new-tokens", "10", "--temperature", "0.8", "--seed", "3", "hello", "world"]) == 0
        records[mode] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in records["ar"]] == [r["token_ids"] for r in records["ddtree"]]
    first = records["ddtree"][0]
    assert first["seed"] == 3 and first["finish_reason"] in ("stop", "length") and isinstance(first["text"], str)
    assert 1 + sum(first["stats"]["acceptance_lengths"]) == len(first["token_ids"])


@pytest.mark.parametrize("argv,message", [
    (["--target", "/nonexistent/dir", "--mode", "ar", "x"], "--target /nonexistent/dir: no such directory"),
    (["--target", "{target}", "--drafter", "/nonexistent/d", "p"], "--drafter /nonexistent/d: no such directory"),
    (["--device", "mps", "p"], "--device mps: ddtree runs on cuda or cpu"),
    (["--device", "banana", "p"], "--device banana: not a device"),
    (["--budget", "512", "p"], "--budget 512 is above --max-budget 256"),
    (["--temperature", "-1", "p"], "argument --temperature: must be >= 0"),
    (["--top-k", "-2", "p"], "argument --top-k: must be >= 0"),
    (["--target", "{target}", "--budget", "x", "p"], 'argument --budget: must be "auto" or an int > 0, got x'),
    (["--target", "{target}", "--max-new-tokens", "0", "p"], "argument --max-new-tokens: must be > 0"),
    (["--target", "{target}", "p"], "--mode ddtree needs --drafter DIR"),
    (["--target", "{target}", "--drafter", "{drafter}", "--device", "cpu", "--top-p", "2", "p"],
     "argument --top-p: must be in (0, 1], got 2"),
    (["--target", "{target}", "--drafter", "{target}", "--device", "cpu", "p"], "drafter config.json lacks"),
    (["--target", "{target}", "--drafter", "{drafter}", "--device", "cpu", "--max-model-len", "16", "x" * 40],
     "exceeds max_model_len=16"),
])
def test_errors_are_one_line(pair, argv, message, capsys):
    target, drafter = pair
    argv = [a.format(target=target, drafter=drafter) for a in argv]
    try:
        rc = main(["generate", *argv])
    except SystemExit as stop:  # argparse's own errors
        rc = stop.code
    err = capsys.readouterr().err
    assert rc != 0
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_python_dash_m_runs_the_same_command(pair, tmp_path_factory):
    target, _ = pair
    run = subprocess.run([sys.executable, "-m", "ddtree", "generate", "--target", target, "--device", "cpu",
                          "--mode", "ar", "--max-new-tokens", "4", "--json", "abc"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout)["token_ids"]) <= 4
    bad = subprocess.run([sys.executable, "-m", "ddtree", "generate", "--target", "/nonexistent", "--mode", "ar", "x"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip() == "ddtree generate: error: --target /nonexistent: no such directory"
    empty = tmp_path_factory.mktemp("empty")  # a directory, but no model in it
    bad = subprocess.run([sys.executable, "-m", "ddtree", "generate", "--target", str(empty), "--mode", "ar", "x"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        f"ddtree generate: error: --target {empty}: no config.json there (a Hugging Face model directory holds one)")


@pytest.mark.parametrize("flag,want", [([], None), (["--cuda-graphs"], True), (["--no-cuda-graphs"], False)])
def test_cuda_graphs_flag_defaults_to_the_engine_choice(flag, want):
    from ddtree.cli import build_parser

    assert build_parser().parse_args(["generate", "hi", *flag]).cuda_graphs is want


def test_profile_writes_a_table_that_generate_reads(pair, tmp_path, capsys):
    target, drafter = pair
    path = tmp_path / "costs.json"
    assert main(["profile", "--target", target, "--drafter", drafter, "--device", "cpu", "--max-batch", "2",
                 "--max-budget", "8", "--repeats", "2", "--out", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "bucket | 0 | 1 | 2 | 4 | 8" and [line.split(" | ")[0] for line in out[1:]] == ["1", "2"]
    table = json.loads(path.read_text())
    assert sorted(table["seconds"]) == ["1", "2"] and table["details"]["repeats"] == 2
    assert main(["generate", "--target", target, "--drafter", drafter, "--device", "cpu", "--max-budget", "8",
                 "--max-batch", "2", "--round-costs", str(path), "--json", "--max-new-tokens", "8", "a", "b"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(len(r["stats"]["tree_sizes"]) == r["stats"]["rounds"] for r in records)
    assert all(set(r["stats"]["tree_sizes"]) <= {0, 1, 2, 4, 8} for r in records)
    rc = main(["generate", "--target", target, "--drafter", drafter, "--device", "cpu", "--round-costs", str(path),
               "--dtype", "bfloat16", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and "was measured for dtype = 'float32', but this engine has 'bfloat16'" in err  # the user's file


def test_generate_keeps_the_round_costs_it_measured(pair, capsys, monkeypatch):
    """The first auto generate measures the table and keeps it; the next one for the same pair and
    device loads it and measures nothing; --fresh-costs measures again; a kept file that cannot
    be read is a warning and measured over."""
    import ddtree.engine.profiling as profiling
    from ddtree.engine.kept_costs import cache_dir

    target, drafter = pair
    argv = ["generate", "--target", target, "--drafter", drafter, "--device", "cpu", "--max-batch", "2",
            "--max-budget", "8", "--json", "--max-new-tokens", "6", "a", "b"]
    assert main(argv) == 0
    kept = list((cache_dir() / "round_costs").glob("*.json"))
    assert len(kept) == 1 and sorted(json.loads(kept[0].read_text())["seconds"]) == ["1", "2"]
    first = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]

    measure = profiling.measure_round_costs
    calls = []
    monkeypatch.setattr(profiling, "measure_round_costs", lambda *a, **k: calls.append(1) or measure(*a, **k))
    assert main(argv) == 0
    assert calls == [] and [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()] == first
    assert main([*argv, "--fresh-costs"]) == 0 and calls == [1]
    kept[0].write_text("{not json")
    assert main(argv) == 0 and calls == [1, 1]
    assert "ignoring the kept round costs" in capsys.readouterr().err
    assert json.loads(kept[0].read_text())["format"] == "ddtree.round_costs/1"  # measured over


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_cuda_is_one_line_before_anything_loads():
    run = subprocess.run([sys.executable, "-m", "ddtree", "generate", "--device", "cuda", "x"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2
    assert run.stderr.strip().startswith("ddtree generate: error: --device cuda: this torch has no CUDA device")
    assert len(run.stderr.strip().splitlines()) == 1


def test_version_bare_command_and_defaults_in_help(capsys):
    from ddtree import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"ddtree {__version__}"
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ddtree") and "generate" in err and "serve" in err and "profile" in err
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("ddtree: a tree a round (default: ddtree)", "(default: auto)", "per prompt (default: 128)",
                  "(default: 0.0)", "(default: 256)"):
        assert shown in text, shown


def test_generate_sizes_its_cache_to_the_prompts(pair, capsys):
    """Without --max-batch / --max-model-len, generate holds a batch of its prompts and requests of
    the longest prompt + --max-new-tokens (at least 1024 tokens, within the model's positions), and
    says so in one start-up line; given flags win."""
    target, drafter = pair
    limit = min(json.loads((Path(target) / "config.json").read_text())["max_position_embeddings"], 8192)
    common = ["generate", "--target", target, "--drafter", drafter, "--device", "cpu", "--json", "--page-size", "8",
              "--max-budget", "8", "--max-new-tokens", "4"]
    assert main([*common, "a", "bc", "d"]) == 0
    line, weights = capsys.readouterr().err.splitlines()[:2]
    from ddtree.models import load_drafter, load_target

    models = load_target(target, dtype=torch.float32)
    mib = [sum(p.numel() * 4 for p in m.parameters()) / 2**20 for m in (models, load_drafter(drafter, models))]
    assert weights == (f"ddtree: weights: target {mib[0]:.1f} MiB, drafter {mib[1]:.1f} MiB "
                       "(ddtree plan computes this before loading)")
    width = -(-(min(1024, limit) + 8 + 1) // 8)  # pages a request may need: its length and one verify
    assert line == (f"ddtree: KV cache of {3 * width} pages x 8 slots ({3 * width * 8} tokens, "
                    f"{line.split('tokens, ')[1].split(' MiB')[0]} MiB) for up to 3 requests of {min(1024, limit)} tokens")
    assert main([*common, "--max-batch", "5", "--max-model-len", "40", "a"]) == 0
    assert "for up to 5 requests of 40 tokens" in capsys.readouterr().err.splitlines()[0]


def test_a_prompt_past_the_context_is_one_line_without_the_tokenizers_warning():
    """The demo pair's tokenizer warns about a prompt past its model_max_length; ddtree's own
    check says the same in its one line, and the warning does not print before it."""
    run = subprocess.run([sys.executable, "-m", "ddtree", "generate", "--device", "cpu", "x = 1\n" * 2000],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2  # the user's to fix: a shorter prompt or a larger --max-model-len
    err = run.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ddtree generate: error: prompt 1: prompt (") and err.endswith(
        "tokens) + max_new_tokens (128) exceeds max_model_len=4096"), err


def test_the_demo_pair_warns_past_its_trained_window():
    """The demo pair accepts 4096 positions but was trained on 1024-token windows: a request past
    1024 runs, after one warning line that says so."""
    run = subprocess.run([sys.executable, "-m", "ddtree", "generate", "--device", "cpu", "--mode", "ar",
                          "--max-new-tokens", "2", "x = 1\n" * 300], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    warning = run.stderr.splitlines()[0]
    assert warning.startswith("ddtree generate: warning: the demo pair was trained on 1024-token windows; a request of ")
    assert warning.endswith("+ 2 new runs past it and may come out garbled")
    short = subprocess.run([sys.executable, "-m", "ddtree", "generate", "--device", "cpu", "--mode", "ar",
                            "--max-new-tokens", "2", "x = 1"], capture_output=True, text=True, timeout=300)
    assert short.returncode == 0 and "warning" not in short.stderr
    past = subprocess.run([sys.executable, "-m", "ddtree", "generate", "--device", "cpu", "--mode", "ar",
                           "--max-model-len", "1100", "--max-new-tokens", "2", "x = 1\n" * 300],
                          capture_output=True, text=True, timeout=300)
    assert past.returncode == 2 and len(past.stderr.strip().splitlines()) == 1  # the error alone
    assert "exceeds max_model_len=1100" in past.stderr


def test_serve_and_profile_batch_defaults_by_device(pair, tmp_path, capsys):
    """--max-batch of serve and profile: 32 on CUDA, 8 on the CPU (where a batch of 32 measured its
    round costs for minutes before the server was ready), shown in --help."""
    from ddtree.arguments import serving_batch

    assert serving_batch("cpu") == 8 and serving_batch("cuda") == 32 and serving_batch("cuda:1") == 32
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "(default: 32 on CUDA, 8 on the CPU)" in " ".join(capsys.readouterr().out.split())
    target, drafter = pair
    path = tmp_path / "costs.json"
    assert main(["profile", "--target", target, "--drafter", drafter, "--device", "cpu", "--max-budget", "2",
                 "--repeats", "1", "--out", str(path)]) == 0
    assert sorted(json.loads(path.read_text())["seconds"], key=int) == ["1", "2", "4", "8"]


@pytest.mark.parametrize("argv,code,message", [
    (["generate", "--device", "mps", "x"], 2, "ddtree generate: error: --device mps: ddtree runs on cuda or cpu"),
    (["generate", "--target", "/nonexistent", "--mode", "ar", "x"], 2,
     "ddtree generate: error: --target /nonexistent: no such directory"),
    (["generate", "--budget", "512", "x"], 2,
     "ddtree generate: error: --budget 512 is above --max-budget 256 (raise --max-budget to allow it)"),
    (["generate", "--top-p", "2", "x"], 2, "ddtree generate: error: argument --top-p: must be in (0, 1], got 2"),
    (["serve", "--host", "no-such-host.invalid"], 1, "ddtree: error: --host no-such-host.invalid: not an address"),
])
def test_a_newcomers_errors_from_a_process(argv, code, message):
    """As a user meets them: the `ddtree` process, its exit code, and one line on stderr."""
    run = subprocess.run([sys.executable, "-m", "ddtree", *argv], capture_output=True, text=True, timeout=300)
    assert run.returncode == code, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and run.stderr.startswith(message), run.stderr


def test_the_commands_keep_tritons_kernels_in_the_ddtree_cache(tmp_path, monkeypatch, capsys):
    """With DDTREE_CACHE_DIR set, Triton compiles into DDTREE_CACHE_DIR/triton (one folder a restart
    reuses); a TRITON_CACHE_DIR of the user's wins."""
    import os

    config = tmp_path / "model"
    config.mkdir()
    (config / "config.json").write_text((Path(__file__).resolve().parents[2] / "benchmarks/configs/kimi-k2.6.json").read_text())
    argv = ["plan", "--target", str(config), "--tensor-parallel", "8", "--gpu-memory", "141"]
    monkeypatch.setenv("DDTREE_CACHE_DIR", str(tmp_path / "kept"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert main(argv) == 0
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "kept" / "triton")
    triton = pytest.importorskip("triton")
    assert triton.knobs.cache.dir == str(tmp_path / "kept" / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert main(argv) == 0 and os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    capsys.readouterr()
