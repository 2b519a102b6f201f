# Sourced on a GPU machine without network access (repo root, the pinned packages carried as wheels in ./.whl):
# installs them into /tmp/site unless an earlier command on the same machine did, builds DeepSpeed there from its
# source archive (its ops JIT-compile on first use), puts both on the paths, and defines `keep DIR`, which copies a
# benchmark's outputs from /tmp/DIR to $OUT/DIR.
if [ ! -d /tmp/site/deepspeed ] || [ ! -d /tmp/site/trl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
        --target /tmp/site .whl/deepspeed-*.tar.gz
fi
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
keep() {
    mkdir -p "$OUT/$1"
    cp /tmp/"$1"/results.json /tmp/"$1"/results.md /tmp/"$1"/memory_vs_length.png /tmp/"$1"/bench.log "$OUT/$1/" 2>/dev/null
    cp -r /tmp/"$1"/profiles "$OUT/$1/" 2>/dev/null || true
}
