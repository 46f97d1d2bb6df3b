# Sourced by the study scripts beside it: PY, OUT and the two steps every study takes.
PY=${PYTHON:-.venv/bin/python}

run() {  # run NAME ARGS...: one experiments.run into $OUT/NAME, unless it already finished
    local name=$1
    shift
    if [ -f "$OUT/$name/summary.json" ]; then
        echo "== $name: done already"
    elif [ -d "$OUT/$name" ]; then
        "$PY" -m experiments.run --no-progress --out "$OUT/$name" "$@" --resume
    else
        "$PY" -m experiments.run --no-progress --out "$OUT/$name" "$@"
    fi
}

run_ranks() {  # run_ranks N NAME ARGS...: the same under torchrun on N local ranks (peer arms); such
    # runs do not resume, so an unfinished one starts over
    local n=$1 name=$2
    shift 2
    if [ -f "$OUT/$name/summary.json" ]; then
        echo "== $name: done already"
        return
    fi
    rm -rf "$OUT/$name"
    OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" \
        -m experiments.run --no-progress --torch-threads 1 --out "$OUT/$name" "$@"
}

canterbury_corpus() {  # canterbury_corpus DIR: three Canterbury-corpus texts in DIR, prepared
    # From the test data of the PyPI sdist brotli==1.2.1 (network access to PyPI once): Alice in
    # Wonderland, Paradise Lost, a technical lecture (Shakespeare's asyoulik.txt left out).
    local dir=$1
    if [ ! -f "$dir/alice29.txt" ]; then
        mkdir -p "$OUT/downloads" "$dir"
        "$PY" -m pip download --no-deps --no-binary :all: brotli==1.2.1 -d "$OUT/downloads"
        "$PY" - "$OUT/downloads/brotli-1.2.1.tar.gz" "$dir" <<'PY'
import sys, tarfile
from pathlib import Path

with tarfile.open(sys.argv[1]) as sdist:
    for name in ("alice29.txt", "plrabn12.txt", "lcet10.txt"):
        data = sdist.extractfile(f"brotli-1.2.1/tests/testdata/{name}").read()
        (Path(sys.argv[2]) / name).write_bytes(data)
PY
    fi
    "$PY" -m experiments.prepare --corpus "$dir"
}

text_part() {  # text_part PART: EXTRA, the runner's flags for one text: none for sh (Shakespeare),
    # the Canterbury texts (made once under $OUT) for ca
    EXTRA=()
    case $1 in
        sh) ;;
        ca)
            canterbury_corpus "$OUT/corpus-canterbury"
            EXTRA=(--corpus "$OUT/corpus-canterbury")
            ;;
        *) echo "PART must be sh or ca, not '$1'" >&2; return 2 ;;
    esac
}
