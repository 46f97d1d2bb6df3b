"""The test modules import the helper modules beside them (``_procs``, ``_hm_local``, ...): under
``--import-mode=importlib`` the tests folder is not on sys.path by itself."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
