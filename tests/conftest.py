"""The test modules import the helper modules beside them (``_procs``, ``_models``, ...): under
``--import-mode=importlib`` the tests folder is not on sys.path by itself. Fixtures more than one
test module uses live here."""
import pathlib
import sys

import numpy as np
import pytest

from distro_opt.experiments import data

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small byte-level corpus in its own cache: offline and fast. Returns (texts folder, cache)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["thou", "art", "king", "lear", "to", "be", "or", "not", "love", "night", "the", "and"]
    folder = root / "texts"
    folder.mkdir()
    (folder / "play.txt").write_text(" ".join(words[i] for i in rng.integers(0, len(words), size=20_000)))
    data.prepare(str(folder), "byte", cache=root / "cache")
    return folder, root / "cache"
