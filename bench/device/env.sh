# Sourced by the device scripts (bench/device/*.sh): $OUT, the carried wheels installed into /tmp/site (from
# ../shared/device/fetch-wheels, in .whl), the import path and the kernel build cache.
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=$PWD:$PWD/client:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export DECONV_KERNEL_CACHE=${DECONV_KERNEL_CACHE:-/tmp/deconv-kernel-cache}
# A kernel build brought back from an earlier call (its library only, packed as .kcache/kcache.tar.xz, carried):
# unpacked into the build cache, so that an unchanged build is loaded instead of compiled again.
if [ -f .kcache/kcache.tar.xz ] && [ ! -d "$DECONV_KERNEL_CACHE" ]; then
  mkdir -p "$(dirname "$DECONV_KERNEL_CACHE")" && tar -C "$(dirname "$DECONV_KERNEL_CACHE")" -xJf .kcache/kcache.tar.xz
fi
