#!/usr/bin/env bash
# One call on the GPU machine that times kernel variants against this tree: each variant is a copy of the tree
# with some files replaced, all built at once (the build cache keys on the sources, so each gets its own library),
# then the same command runs in each copy in turn, so the GPU times them one after another in one run.
# Env: AB_VARIANTS "name=dir ..." (dir, relative to the repo root, holds the replacing files at their repo paths;
# carry it when it is git-ignored), AB_CMD (run in each copy with $V the variant's name and $OUT its output
# folder; default: the halo split table of dcgan_up1 at batch 64 with tile 12 and the KernelBench TF32 problems
# with the default choice). The tree itself runs as "base". Logs and JSON go to $OUT/<name>/, the tables come last.
#   AB_VARIANTS="lag=_ab/lag round=_ab/round" bash bench/device/ab.sh
set -uo pipefail
source bench/device/env.sh
root=$PWD
AB_CMD=${AB_CMD:-'timeout 120 python3 -m bench.kernels.splits --config 12 --layers dcgan_up1 --batches 64 --reps 30 \
  --out $OUT/splits.json; timeout 240 python3 -m bench.kernels.kernelbench --modes tf32 --no-tune --layers-hw 0 --reps 20 \
  --out $OUT/kernelbench.json'}
names=(base)
dirs=("$root")
for spec in ${AB_VARIANTS:-}; do
  name=${spec%%=*}
  src=$root/${spec#*=}
  [ -d "$src" ] || { echo "variant $name: no folder $src"; exit 2; }
  dst=/tmp/ab-$name
  rm -rf "$dst"; mkdir -p "$dst"
  tar -C "$root" --exclude=./.whl --exclude=./_ab -cf - . | tar -C "$dst" -xf -
  cp -r "$src/." "$dst/"
  names+=("$name"); dirs+=("$dst")
done
# Builds, all at once (nvcc runs single-threaded per file; the machine has 16 cores).
t0=$SECONDS
for i in "${!names[@]}"; do
  mkdir -p "$OUT/${names[$i]}"
  (cd "${dirs[$i]}" && python3 -c "import kernels.build as b; b.load()" > "$OUT/${names[$i]}/build.log" 2>&1 \
    || echo "build of ${names[$i]} failed") &
done
wait
echo "builds: $((SECONDS - t0)) s"
for i in "${!names[@]}"; do
  V=${names[$i]}
  log=$OUT/$V/run.log
  (cd "${dirs[$i]}" && export V OUT="$OUT/$V" PYTHONPATH="${dirs[$i]}:${dirs[$i]}/client:/tmp/site" \
    && bash -c "$AB_CMD" > "$log" 2>&1)
done
for V in "${names[@]}"; do
  echo "== $V"
  grep -v -e '^{' -e '^wrote' "$OUT/$V/run.log" | tail -16
done
