"""The checkpoints the parallel tests split over ranks: a tiny target with 16-bit and with INT4
experts, and a drafter for it, written once per session."""

import pytest


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    pytest.importorskip("transformers")
    from ..engine.pairs import drafter_config, save_drafter
    from ..models.checkpoints import save_tiny, save_tiny_int4, tiny_config

    root = tmp_path_factory.mktemp("tp")
    save_tiny(root / "bf16", tiny_config())
    save_tiny_int4(root / "int4", tiny_config())
    save_drafter(root / "drafter", drafter_config(96, 4))
    return root
