"""Every result names the code it measured: the stamp for a copy without git, refused once stale."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import common  # noqa: E402


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A checkout's code folders under tmp_path, with the stamp's path there."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    monkeypatch.setattr(common, "ROOT", tmp_path)
    monkeypatch.setattr(common, "STAMP", tmp_path / ".provenance.json")
    monkeypatch.delenv("DDTREE_COMMIT", raising=False)
    return tmp_path


def test_digest_follows_content_and_paths(tree):
    first = common.code_digest(tree)
    assert common.code_digest(tree) == first
    (tree / "src" / "a.py").write_text("x = 2\n")
    second = common.code_digest(tree)
    assert second != first
    (tree / "src" / "a.py").rename(tree / "src" / "b.py")
    assert common.code_digest(tree) not in (first, second)


def test_a_fresh_stamp_names_the_commit_and_a_stale_one_is_refused(tree, monkeypatch):
    common.STAMP.write_text(json.dumps({"commit": "abc1234+changes", "digest": common.code_digest()}))
    assert common.commit() == "abc1234+changes"
    (tree / "src" / "a.py").write_text("x = 3\n")  # the code changed after stamping
    with pytest.raises(RuntimeError, match="other code than this checkout's"):
        common.commit()
    monkeypatch.setenv("DDTREE_COMMIT", "def5678")
    assert common.commit() == "def5678"


def test_results_without_a_commit_are_refused(tmp_path):
    env = {"gpu": "none (CPU)", "commit": "unknown"}
    with pytest.raises(RuntimeError, match="no commit to record"):
        common.write_results("x", {"environment": env}, "table", tmp_path)
    assert not list(tmp_path.iterdir())
    env["commit"] = "abc1234"
    path = common.write_results("x", {"environment": env}, "table", tmp_path)
    assert "- commit: abc1234" in path.read_text()
