# Offline install, for GPU machines without network access (air-gapped clusters). Source it from the repo root:
#     source tools/offline_env.sh
# It installs the pinned packages from a wheelhouse in ./.whl into /tmp/site (once per machine), builds DeepSpeed there
# from its source archive (its ops JIT-compile on first use), and puts both on the paths. Fill ./.whl on a machine
# with network access and copy it over with the repo:
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl \
#         trl==1.16.0 transformers==5.24.0 ...    # every pin of requirements*.txt the GPU machine's image lacks
#     pip download --no-deps --no-binary=:all: -d .whl deepspeed==0.19.8    # DeepSpeed as its source archive
# Keep torch and triton out of it: the GPU machine's own CUDA build of torch stays in use.
# It also defines `keep DIR`: copy a benchmark's outputs from /tmp/DIR to $OUT/DIR (OUT defaults to results/incoming).
if [ ! -d /tmp/site/deepspeed ] || [ ! -d /tmp/site/trl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
        --target /tmp/site .whl/deepspeed-*.tar.gz
fi
# and this checkout's `longdpo` package importable, as `pip install -e .` makes it where pip can build
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
keep() {
    local OUT=${OUT:-results/incoming}
    mkdir -p "$OUT/$1"
    cp /tmp/"$1"/results.json /tmp/"$1"/results.md /tmp/"$1"/memory_vs_length.png /tmp/"$1"/bench.log "$OUT/$1/" 2>/dev/null
    cp -r /tmp/"$1"/profiles "$OUT/$1/" 2>/dev/null || true
}
