"""Fetch, split, tokenize and cache a corpus, once: the only experiment step that uses the network.

python -m experiments.prepare                          # Shakespeare, BPE vocab 2048
python -m experiments.prepare --tokenizer byte         # Shakespeare, bytes (vocab 256)
python -m experiments.prepare --corpus path/to/texts/  # any plain-text file or folder of *.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

from distro_opt.cli_args import Parser, fail, os_error_message

from .data import SHAKESPEARE, TOKENIZERS, CorpusError, default_cache_dir, load_corpus, prepare


def main(argv=None) -> int:
    p = Parser(prog="python -m experiments.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--corpus", default=SHAKESPEARE, help=f"'{SHAKESPEARE}' (default) or a text file/folder path"
    )
    p.add_argument("--tokenizer", default="bpe", choices=TOKENIZERS)
    p.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary (ignored for byte)")
    p.add_argument("--cache", type=Path, default=None, help=f"cache folder (default {default_cache_dir()})")
    p.add_argument("--force", action="store_true", help="rebuild even if a valid cache exists")
    args = p.parse_args(argv)
    try:
        out = prepare(args.corpus, args.tokenizer, args.vocab_size, args.cache, force=args.force)
        corpus = load_corpus(args.corpus, args.tokenizer, args.vocab_size, args.cache)
    except (CorpusError, ValueError) as exc:
        return fail(str(exc))
    except OSError as exc:  # --cache unusable: a file in the way, no permission
        return fail(os_error_message(exc))
    print(
        f"{out}: {corpus.train.size:,} train and {corpus.val.size:,} validation tokens, "
        f"vocab {corpus.vocab_size}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
