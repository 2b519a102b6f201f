# Sourced by the results/*/run.sh scripts on the GPU machine (repo root, $OUT set, .whl carried; see
# ../shared/device/README.md): installs the carried wheels into /tmp/site, builds DeepSpeed there from its source
# archive, and defines `keep DIR`, which copies a benchmark's outputs from /tmp/DIR to $OUT/DIR.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
    --target /tmp/site .whl/deepspeed-*.tar.gz
export PYTHONPATH=/tmp/site:$PYTHONPATH PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
keep() {
    mkdir -p "$OUT/$1"
    cp /tmp/"$1"/results.json /tmp/"$1"/results.md /tmp/"$1"/memory_vs_length.png /tmp/"$1"/bench.log "$OUT/$1/" 2>/dev/null
}
