#!/usr/bin/env bash
# The wheels scripts/gpu_step15.sh installs on the GPU machine, downloaded here into .whl/ (ignored
# by git; the device tool carries it: `carry: [".whl"]`). That machine has no network, and its
# python3 (3.12, /opt/torch/.venv) already holds torch, triton, transformers, numpy, tokenizers,
# safetensors, huggingface-hub, jinja2, anyio, click, h11, httpx, httpcore, idna, certifi, tqdm,
# pyyaml, requests, prometheus-client, annotated-doc, typing-extensions, pytest and pytest-xdist
# (/work/.library/device/KINDS.md's list). What part 15, shared/ and the GPU script's tests and
# benchmarks import beyond that, each pinned to the version this repo's suite passes with here:
#
#   fastapi, starlette, uvicorn, sse-starlette     the servers (part15_full.server, shared.serving)
#   opentelemetry-api                              fastapi >= 0.16x imports it at import time
#   pydantic, pydantic-core, annotated-types,      the request models (part15_full.protocol,
#     typing-inspection                            shared.protocol); fastapi
#   msgspec, pyzmq                                 engine messages and transport (parts 10-15)
#   gguf                                           the embedded model's GGUF (shared.gguf_convert)
#   xgrammar, apache-tvm-ffi                       structured outputs (imported only when a request
#                                                  asks for one; XGRAMMAR=0 leaves them out)
#
# Not carried: openai, jsonschema (test-only, for the server and structured-output tests, which the
# GPU script does not run), distro/jiter/sniffio (openai's and old anyio's), and everything above
# that the image has. typing-extensions goes to .whl/fallback/: the GPU script installs it only if
# the image's is older than pydantic needs.
#
#   bash scripts/gpu_wheels.sh                           # .whl/ for the GPU machine (CPython 3.12)
#   PYVER=3.11 DEST=/tmp/whl311 bash scripts/gpu_wheels.sh   # the same set for a 3.11 dry run
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}   # the GPU image's python3 is 3.12.3 (KINDS.md)
DEST=${DEST:-.whl}
XGRAMMAR=${XGRAMMAR:-1}

PKGS=(
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 sse-starlette==3.7.0 opentelemetry-api==1.45.2
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  msgspec==0.23.0 pyzmq==27.3.0 gguf==0.19.0
)
[ "$XGRAMMAR" = 1 ] && PKGS+=(xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2)
FALLBACK=(typing-extensions==4.16.0)

# The platform tags the device README lists (pip matches each manylinux_2_N exactly).
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${PLATFORMS[@]}" -d "$@"
}

rm -rf "$DEST"   # one version of each: two of one package stop the whole install
mkdir -p "$DEST/fallback"
download "$DEST" "${PKGS[@]}"
download "$DEST/fallback" "${FALLBACK[@]}"
ls -1 "$DEST" "$DEST/fallback"
du -sh "$DEST"
