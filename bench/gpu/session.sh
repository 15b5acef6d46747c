#!/usr/bin/env bash
# The GPU measurements of issues 4-7 on one device machine, as a few consecutive calls (each <= 10 min).
#
# Provenance: run from .carry/clean (bench/gpu/export.sh writes its COMMIT), or, run from the repository root,
# write `git rev-parse HEAD > COMMIT` first and remove it after: the device's copy of a checkout carries the last
# landed commit's git metadata, so without the marker the reports name that commit (session 23, run BT).
#
#   bash bench/gpu/session.sh piece N      # upload: append .carry/q.NN to /tmp/m/q.gguf (N=0 truncates first)
#   bash bench/gpu/session.sh train-serve  # GPU0: drafter pipeline (issue 5) | GPU1: tier-bandwidth (issue 7: kvd's
#                                          #   tier copies, side-stream overlap), then serve-plan gpu-all (issues 4, 7)
#   bash bench/gpu/session.sh speed        # GPU0: bench speedup (issue 6)    | GPU1: sps-projection (Qwen3-8B shape)
#   bash bench/gpu/session.sh train-kv     # GPU0: one dspark drafter, 10x the data (issue 6's drafter; resumable:
#                                          #   run it again until it reports) | GPU1: serve-plan gpu-kv (issue 7)
#   bash bench/gpu/session.sh train        # one GPU: train-kv's drafter alone, through training (resumable)
#   bash bench/gpu/session.sh step-profile # one GPU, no GGUF: prompt steps against decode steps (bench/step_profile.py),
#                                          #   with KVSPEC_FUSED=0 and 1 (the default), then bench/kernels_gpu.py
#   bash bench/gpu/session.sh answers-stacks  # one GPU: the data stage's Python stacks every 20 s for 80 s
#   bash bench/gpu/session.sh train-probe  # one GPU, no GGUF: drafter training steps by batch size (train_probe.py),
#                                          #   this export and, with OLD=<export dir>, an older one; with
#                                          #   PROBE_FEATURES=bfloat16, this export again with a bf16 target pass;
#                                          #   PROBE_METHODS=eagle3: batched loss against the per-sequence one
#   bash bench/gpu/session.sh drafter-out  # the trained dspark drafter in bf16, as 15 MB pieces dsq.NN, four a call
#                                          # from PIECE_FROM (default 0), to carry later;
#                                          # DRAFTER=dflash (pieces dfq.NN) or eagle3 (e3q.NN): those `train` left
#   bash bench/gpu/session.sh data-out     # the data stage `train` left, as 15 MB pieces dpd.NN (DATA_FROM=4: the next
#                                          # four); stashed, TRAIN_ANSWERS=carried trains without answering again
#   bash bench/gpu/session.sh stash DIR    # copy a carried folder's files to /tmp/stash (the drafter's pieces)
#   bash bench/gpu/session.sh final        # GPU0: bench speedup with the carried drafter, the draft-round profile,
#                                          #   sps-projection | GPU1: serve-plan gpu-kv (issue 7, per-cell stats;
#                                          #   KV_PLAN=gpu-creative runs the creative case instead)
#   bash bench/gpu/session.sh probe        # GPU0: bench speedup --profile (cProfile of the timed runs: where a
#                                          #   drafting step's time goes), then serve-plan gpu-creative |
#                                          #   GPU1: serve-plan ${KV_PLAN:-gpu-agentic-idle}
#   bash bench/gpu/session.sh last         # GPU0: prefill tile sweep, bench speedup (none/dspark/dspark-g7), gpu-agentic
#                                          #   | GPU1: serve-plan gpu-agentic-idle (session 4's closing measurements)
#   bash bench/gpu/session.sh speedup      # one GPU: bench speedup only (${SPEED_ROWS}, ${SPEED_REPEATS:-2} repeats)
#   bash bench/gpu/session.sh lockstep     # one GPU: bench speedup twice on the same drafter and rows, each turn's own
#                                          #   max_tokens (answers end at EOS) at ${LOCK_CONCURRENCY:-16,32}, then the
#                                          #   table's 48-token answers at ${LOCK_FIXED:-32} (session 43: is c = 32's
#                                          #   loss the 48-token cap's lockstep?); turn.tgz and fixed48.tgz
#   bash bench/gpu/session.sh projection   # one GPU, no GGUF: the draft-round profile and sps-projection at the
#                                          #   Qwen3-8B shape, with the CPU machine's acceptance JSONs (session 49)
#   bash bench/gpu/session.sh markov       # one GPU, no GGUF: bench.markov_slot_cost (the fused Markov slot against
#                                          #   the torch passes it replaced, with its checks), then `projection`; with
#                                          #   MARKOV_AGAINST=<an export of an older commit, e.g. .carry/base>
#                                          #   `projection` from that tree too, in the same lease (session 51)
#   bash bench/gpu/session.sh graphs-check # one GPU, no GGUF: the drafter graphs' CUDA tests and the draft-round
#                                          #   profile (absorb_eager vs absorb_graph: the context projection,
#                                          #   built in session 29 without a GPU run)
#   bash bench/gpu/session.sh nucleus      # one GPU, no GGUF: bench.sampling_cost on spread and peaked rows, this
#                                          #   tree's two-level nucleus kernels against ${AGAINST:-.carry/one_level.py}
#                                          #   (`git show acf227e:kvspec_kernels/nucleus.py`, the one-level ladder)
#                                          #   in the same call (session 31; run in session 32)
#   bash bench/gpu/session.sh verdict      # one GPU: the chain against the rejection sampler on extraction (fresh
#                                          #   engine), the full table, the draft-round profile (session 16)
#   bash bench/gpu/session.sh idle         # one GPU: serve-plan ${KV_PLAN:-gpu-agentic-idle} only; with
#                                          #   KV_MODEL=.carry/q8r.tgz KV_PLAN=gpu-agentic-8b: the Qwen3-8B shape with
#                                          #   random weights, no GGUF upload (session 19); KV_PLAN=gpu-agentic-8b-32:
#                                          #   the same with 32 sessions; KV_PLAN=gpu-zero-hit-8b-aa: the 0%-hit
#                                          #   cell with an A/A row (both session 25, run CD and CE in
#                                          #   session 27); KV_PLAN=gpu-agentic-8b-32-long4: 32 sessions
#                                          #   with long files, all four configs (session 27, run CG; the
#                                          #   tree must be under 64 MiB with the carry: move docs/results/gpu out)
#   bash bench/gpu/session.sh kv8b         # one GPU, no GGUF: serve-plan ${KV_PLAN:-gpu-agentic-8b}, then gpu-zero-hit-8b,
#                                          #   with KV_MODEL=${KV_MODEL:-.carry/q8r.tgz} (Qwen3-8B shape, random weights)
#   bash bench/gpu/session.sh closing      # GPU0: bench speedup (none/dspark/dspark-g7/ngram), then serve-plan
#                                          #   gpu-zero-hit | GPU1: serve-plan gpu-agentic-idle (session 5's last call)
#   bash bench/gpu/session.sh pair         # GPU0: bench speedup (${SPEED_ROWS}, ${SPEED_REPEATS:-2} repeats) |
#                                          #   GPU1: serve-plan ${KV_PLAN:-gpu-mooncake} (session 6)
#
# Why this shape: the device machine keeps /tmp only while warm (30 s between calls), a call carries at
# most 64 MiB with the working tree (~32 MB since session 6's raw results): the 491 MB GGUF goes in
# thirteen 38 MB pieces, N=0..12, made with `split -b 38000000 -d -a 2 GGUF .carry/q38/q.` and appended
# with `PIECES=.carry/q38 bash bench/gpu/session.sh piece N` carrying `.carry/q38/q.NN` (~90 s of device time
# in session 8; the tracked tree is ~26 MB since session 7; until session 5: eleven 45 MB pieces in
# .carry/q.NN, the default PIECES; sessions 6-7: seventeen 30 MB pieces in .carry/q30). Session 10: the
# tracked tree is 30 MiB, and a 38 MB piece with it is over the 64 MiB a call carries: upload the seventeen
# 30 MB pieces of .carry/q30 instead (`cat .carry/q30/q.NN >> /tmp/m/q.gguf`, carrying that piece only;
# ~125 s of device time from a cold machine, ~80 s of it the start). Session 16: the tracked tree is 36.8 MB,
# and a 30 MB piece with it is refused: upload the twenty 25 MB pieces of .carry/q25 (25,000,000 bytes each,
# the last 16,400,064), and stash the drafter in three calls (.carry/dsq10a/dsq.00, .carry/dsq10a/dsq.01,
# .carry/dsq10b); a refused call costs no device time. Session 17: the tracked tree is 38.2 MB, so a call
# carries one 15 MB drafter piece at a time (four stash calls, .carry/dsq17a/dsq.00 ... .carry/dsq17b/dsq.03);
# and at most 8 files come back: each phase packs its results into one tarball under $OUT. Lately (session 52) the
# raw results (docs/results/gpu, ~80 MB) are moved out of the tree before device calls, which leaves ~17 MB:
# the eleven 45 MB pieces of .carry/q45 (bootstrap.sh), `PIECES=.carry/q45 bash bench/gpu/session.sh piece N`.
# Run it from a clean export of a commit, so the results name the code that made them: `bash bench/gpu/export.sh`
# here (writes .carry/clean and its COMMIT file, read by bench/provenance.py), carry .carry/clean, and on the
# device: ln -sfn $PWD/.carry .carry/clean/.carry; ln -sfn $PWD/.whl .carry/clean/.whl; cd .carry/clean
# Inputs prepared on the CPU machine (the corpora do not travel), carried with the call; on a new machine
# `bash bench/gpu/bootstrap.sh` rebuilds the GGUF pieces, .carry/qs1000.tgz, .whl and .carry/clean:
#   .carry/qwen-sessions  python -m bench drafter-pipeline --prepare --sessions .carry/qwen-sessions \
#                             --out .carry/qwen-sessions --train-sessions 48 --eval-sessions 16 --turns 2 \
#                             --max-tokens 128 --max-chars 3000
#   .carry/qs1000.tgz     (session 9) the same --prepare with --train-sessions 1000 into /tmp/qs1000, then
#                             tar czf .carry/qs1000.tgz -C /tmp qs1000: train with TRAIN_DATA=.carry/qs1000.tgz
#                             TRAIN_SESSIONS=1000 (5.4 MB carried instead of 24 MB; same eval sessions)
#   .carry/sessions       python -m bench serve-plan --plan gpu-all --build --sessions .carry/sessions
#   .whl                  wheels: pyzmq, pydantic(+core, annotated-types, typing-inspection), gguf,
#                             fastapi, starlette, uvicorn, opentelemetry-api, kvikio-cu13 (+libkvikio-cu13,
#                             rapids-logger, cuda-pathfinder)
set -uo pipefail
MODEL=/tmp/m/q.gguf
SHA=${QWEN_SHA256:-}
RES=/tmp/res
mkdir -p /tmp/m "$RES" /tmp/logs
if [ ! -d /tmp/site ] && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > /tmp/logs/pip.log 2>&1 || { tail /tmp/logs/pip.log; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR=/tmp/triton-cache   # known place, so triton_compiles can count the kernels built

triton_compiles() {  # compiled Triton kernels so far, per kernel name (one cache entry per specialisation)
  find "$TRITON_CACHE_DIR" -name '*.json' ! -name '__grp__*' 2>/dev/null | xargs -r -n1 basename | sort | uniq -c
}
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
second_gpu() { if [ "$GPUS" -ge 2 ]; then echo 1; else echo 0; fi; }

# a drafter carried back in bf16 pieces (drafter-out): method -> "pieces folder" (pieces /tmp/stash/<pieces>.NN,
# unpacked into /tmp/<folder>); dspark's names are session 8's
carried() { case "$1" in dspark) echo "dsq dsp" ;; dflash) echo "dfq dfl" ;; eagle3) echo "e3q e3d" ;; *) return 1 ;; esac; }

send_pieces() {  # send_pieces NAME FROM: /tmp/NAME.NN for NN = FROM..FROM+3 into $OUT, those that exist (a call
                 # brings back 64 MB at most: four 15 MB pieces); drafter-out and data-out
  local i f
  for i in $(seq "$2" $(( $2 + 3 ))); do
    f=/tmp/$1.$(printf %02d "$i")
    if [ -f "$f" ]; then cp "$f" "$OUT/"; fi    # not `[ -f ] && cp`: a missing last piece made the call's rc 1
  done
}

unpack_carried() {  # unpack_carried METHOD: its stashed pieces into /tmp/<folder>, once
  local names pieces folder
  names=$(carried "$1") || { echo "no carried drafter for $1"; exit 2; }
  read -r pieces folder <<< "$names"
  if [ ! -d "/tmp/$folder" ]; then
    cat /tmp/stash/"$pieces".* > "/tmp/$folder.tgz" && tar xzf "/tmp/$folder.tgz" -C /tmp && ls -la "/tmp/$folder" || exit 1
  fi
}

unpack_drafter() { unpack_carried dspark; }  # the dspark drafter of train-kv, carried back and stashed

speed_drafters() {  # DRAFTERS for speedup_run: ${SPEED_DRAFTERS} (empty: none), default the stashed dspark, unpacked
  DRAFTERS=${SPEED_DRAFTERS-dspark=/tmp/dsp}   # dspark=/tmp/dp/drafters/dspark: the one `train` left on this machine
  case "$DRAFTERS" in *=/tmp/dsp*) unpack_carried dspark ;; esac   # dflash=/tmp/dfl, eagle3=/tmp/e3d: carried too
  case "$DRAFTERS" in *=/tmp/dfl*) unpack_carried dflash ;; esac
  case "$DRAFTERS" in *=/tmp/e3d*) unpack_carried eagle3 ;; esac
}

train_data() {  # the training sessions: ${TRAIN_DATA:-.carry/qwen-sessions500}, a folder or a .tgz of one folder
                # (session 9: .carry/qs1000.tgz, 1,000 train sessions per workload, 5.4 MB instead of 24 MB;
                # its eval sessions are qwen-sessions500's); a .tgz is unpacked once into /tmp/train-data
  local d=${TRAIN_DATA:-.carry/qwen-sessions500}
  case "$d" in
    *.tgz)
      if [ ! -d /tmp/train-data ]; then mkdir -p /tmp/train-data && tar xzf "$d" -C /tmp/train-data || return 1; fi
      ls -d /tmp/train-data/*/ | head -n 1 | sed 's#/$##' ;;
    *) echo "$d" ;;
  esac
}

train_dspark() {  # train_dspark OUT TIMEOUT [ARGS...]: train-kv's recipe on GPU0 (dspark alone, or the drafters
                  # TRAIN_METHODS names, e.g. dspark,dflash,eagle3: equal parts of the training window, the same
                  # data and recipe, for issue 6's table of every method; TRAIN_SESSIONS
                  # train sessions per workload answered by the serving engine, TRAIN_BATCH sequences a step of
                  # TRAIN_ANCHORS anchors each, default 8 x 16; TRAIN_LAYERS draft layers, default 1, the
                  # DSpark paper's drafter has 2; TRAIN_INIT=/tmp/dsp warm-starts from the stashed drafter,
                  # after `unpack_drafter`; TRAIN_INITS=dflash=/tmp/dfl,eagle3=/tmp/e3d warm-starts those from
                  # their carried pieces (drafter-out), unpacked in `train`; TRAIN_ANSWERS=carried takes the data
                  # stage from the stashed pieces of data-out, dpd.NN); TRAIN_WEIGHTS=dspark=2 gives dspark
                  # twice each other method's part of the window (session 61: equal time, 630 dspark steps
                  # against 1,056 dflash ones); resumable from /tmp/dp
  local out=$1 limit=$2 data extra=() w
  shift 2
  data=$(train_data) || return 1
  for w in $(echo "${TRAIN_INITS:-}" | tr , ' '); do extra+=(--init "$w"); done
  if [ "${TRAIN_ANSWERS:-}" = carried ]; then    # the data stage carried back by data-out, stashed as dpd.NN
    if [ ! -d /tmp/dpd ]; then mkdir -p /tmp/dpd && cat /tmp/stash/dpd.* | tar xz -C /tmp/dpd || return 1; fi
    extra+=(--answers-from /tmp/dpd)
  fi
  CUDA_VISIBLE_DEVICES=0 timeout "$limit" python -m bench drafter-pipeline --target "$MODEL" \
    --sessions "$data" --work /tmp/dp --out "$out" --methods "${TRAIN_METHODS:-dspark}" \
    --steps "${TRAIN_STEPS:-2500}" --train-sessions "${TRAIN_SESSIONS:-500}" --answers engine \
    --budget-s "${TRAIN_BUDGET:-900}" --gamma 7 --device cuda --batch-size "${TRAIN_BATCH:-8}" \
    --anchors "${TRAIN_ANCHORS:-16}" --layers "${TRAIN_LAYERS:-1}" ${TRAIN_INIT:+--init-dspark "$TRAIN_INIT"} \
    ${TRAIN_WEIGHTS:+--train-weights "$TRAIN_WEIGHTS"} "${extra[@]}" "$@" \
    >> /tmp/logs/drafter-pipeline.log 2>&1
}

train_probe() {  # train_probe TREE NAME [ARGS...]: bench/gpu/train_probe.py on TREE's code, into
                 # $RES/train-probe/NAME.json and /tmp/logs/train-probe-NAME.log
  local tree=$1 name=$2
  shift 2
  PYTHONPATH=$tree:/tmp/site timeout "${PROBE_TIMEOUT:-200}" python bench/gpu/train_probe.py \
    --prompts .carry/answers-prompts.json --batches "${PROBE_BATCHES:-8,16,32,8x64,32x64}" "$@" \
    --out "$RES/train-probe/$name.json" > "/tmp/logs/train-probe-$name.log" 2>&1
  echo "train-probe $name rc=$?"; grep "a step" "/tmp/logs/train-probe-$name.log"
}

pack() {  # pack $RES/<phase> (+ logs) into one tarball under $OUT
  tar czf "$OUT/$1.tgz" -C "$RES" "$1" -C /tmp logs 2>/dev/null
  ls -la "$OUT"
}

speedup_run() {  # speedup_run GPU DRAFTERS ROWS BUDGET_S OUT: bench speedup on the five eval workloads
                 # (SPEED_REQUESTS, SPEED_CONCURRENCY: longer or fewer cells; session 10: at 8 requests a run
                 # lasts 0.4-1.3 s and the A/A row fails the per-cell never-slower rule in 9-16 of 25 cells;
                 # SPEED_WAVES: requests per concurrency slot, session 11: one wave makes speculation pay the tail;
                 # SPEED_WORKLOADS: a comma list of workload names, e.g. knowledge,extraction (default: all five);
                 # SPEED_PROFILE: a folder for cProfile tables of the timed runs, per row and concurrency;
                 # SPEED_TORCH_PROFILE: a folder for torch.profiler tables, the rows side by side;
                 # SPEED_GATE_TRACE: reports each gate cell keeps in the JSON (default 16; --gate-trace-steps);
                 # SPEED_GC: freeze (the default, session 18) or default, bench speedup's --gc;
                 # SPEED_CPUS: pin the run to these CPUs, e.g. 2 (bench speedup's --cpus, bench/cpu_pin.py);
                 # SPEED_MAX_TOKENS: answer length, default 48 (every answer reaches it, so `none` runs a wave's
                 # requests in lockstep: session 28); `turn`: each turn's own 128, answers end at EOS;
                 # SPEED_QUEUED: keep this many more requests waiting in the engine's queue (bench speedup's
                 # --queued; session 33: a queued request had kept rest spans from forming)
                 # SPEED_SEEDS: by-repeat moves every request's seed each repeat (bench speedup's --seeds; session 45:
                 # at turn lengths a sampled row's fixed seeds gave the same answer lengths in every repeat)
                 # SPEED_AUTO_WARMUPS: bench speedup's --auto-warmups (whole-answer warm-ups of the auto row while
                 # its method chooser explores; default 3, 0: explore in the timed runs as in session 56)
  local W name len=(--max-tokens "${SPEED_MAX_TOKENS:-48}")
  if [ "${SPEED_MAX_TOKENS:-}" = turn ]; then len=(); fi   # each turn's own max_tokens (128): EOS ends answers
  W=$(ls "$(train_data)"/*.eval.jsonl | paste -sd, -)    # the eval sessions beside the training ones (TRAIN_DATA)
  if [ -n "${SPEED_WORKLOADS:-}" ]; then
    W=$(for name in ${SPEED_WORKLOADS//,/ }; do ls "$(train_data)/$name.eval.jsonl"; done | paste -sd, -)
  fi
  CUDA_VISIBLE_DEVICES=$1 python -m bench speedup --model "$MODEL" --drafters "$2" --rows "$3" --workloads "$W" \
    --concurrency "${SPEED_CONCURRENCY:-1,4,8,16,32}" --requests "${SPEED_REQUESTS:-8}" --waves "${SPEED_WAVES:-1}" \
    "${len[@]}" ${SPEED_QUEUED:+--queued "$SPEED_QUEUED"} ${SPEED_SEEDS:+--seeds "$SPEED_SEEDS"} ${SPEED_GC:+--gc "$SPEED_GC"} ${SPEED_CPUS:+--cpus "$SPEED_CPUS"} ${SPEED_PROFILE:+--profile "$SPEED_PROFILE"} ${SPEED_TORCH_PROFILE:+--torch-profile "$SPEED_TORCH_PROFILE"} ${SPEED_GATE_TRACE:+--gate-trace-steps "$SPEED_GATE_TRACE"} ${SPEED_AUTO_WARMUPS:+--auto-warmups "$SPEED_AUTO_WARMUPS"} \
    --repeats "${SPEED_REPEATS:-2}" --device cuda --budget-s "$4" --out "$5" > /tmp/logs/speedup.log 2>&1
  echo "speedup rc=$?"
}

kv_model() {  # the model serve-plan serves: ${KV_MODEL:-$MODEL}; a .tgz of one directory (the random-weights
              # Qwen3-8B shape that bootstrap.sh packs as .carry/q8r.tgz, specd/loader/random_weights.py) is
              # unpacked once into /tmp/kv-model
  local m=${KV_MODEL:-$MODEL}
  case "$m" in
    *.tgz)
      if [ ! -d /tmp/kv-model ]; then mkdir -p /tmp/kv-model && tar xzf "$m" -C /tmp/kv-model || return 1; fi
      ls -d /tmp/kv-model/*/ | head -n 1 | sed 's#/$##' ;;
    *) echo "$m" ;;
  esac
}

plan_run() {  # plan_run GPU PLAN OUT WORK BUDGET_S LOG: one serve-plan, its log in /tmp/logs/LOG.log
  CUDA_VISIBLE_DEVICES=$1 python -m bench serve-plan --plan "$2" --model "$(kv_model)" --device cuda \
    --sessions .carry/sessions --out "$3" --work "$4" --budget-s "$5" --no-progress > "/tmp/logs/$6.log" 2>&1
  echo "$2 plan rc=$?"
}

case "${1:-}" in
  piece)
    n=$(printf "%02d" "$2")
    P=${PIECES:-.carry}
    # a later piece onto no file means piece 0 never ran (session 35: its call got no machine, the next one
    # started a fresh machine, and pieces 1-8 made a 436 MB file that was no GGUF): refuse, start again at 0
    if [ "$2" != 0 ] && [ ! -f "$MODEL" ]; then echo "piece $2: no $MODEL (piece 0 did not run here): upload from 0"; exit 2; fi
    if [ "$2" = 0 ]; then cat "$P/q.$n" > "$MODEL"; else cat "$P/q.$n" >> "$MODEL"; fi
    ls -la "$MODEL"
    if [ -n "$SHA" ]; then echo "$SHA  $MODEL" | sha256sum -c - 2>/dev/null || true; fi
    ;;
  train-serve)
    mkdir -p "$RES/train-serve"
    nvidia-smi --query-gpu=name,memory.used --format=csv
    CUDA_VISIBLE_DEVICES=0 python -m bench drafter-pipeline --target "$MODEL" --sessions .carry/qwen-sessions \
      --work /tmp/dp --out "$RES/train-serve/acceptance" --budget-s "${TRAIN_BUDGET:-470}" --gamma 7 --device cuda \
      > /tmp/logs/drafter-pipeline.log 2>&1 &
    a=$!
    # tier copies first (~20 s): if kvikio cannot move blocks here, the serve plan's NVMe tier uses POSIX
    CUDA_VISIBLE_DEVICES=$(second_gpu) timeout 120 python -m bench tier-bandwidth --out "$RES/train-serve/tiers" \
      --nvme-dir /tmp > /tmp/logs/tiers.log 2>&1 || export KVD_NO_KVIKIO=1
    echo "tier-bandwidth done (KVD_NO_KVIKIO=${KVD_NO_KVIKIO:-0})"; tail -n 16 /tmp/logs/tiers.log
    CUDA_VISIBLE_DEVICES=$(second_gpu) python -m bench serve-plan --plan gpu-all --model "$MODEL" --device cuda \
      --sessions .carry/sessions --out "$RES/train-serve/serve" --work /tmp/sp --budget-s "${SERVE_BUDGET:-480}" \
      --no-progress > /tmp/logs/serve-plan.log 2>&1 &
    b=$!
    wait $a; echo "drafter-pipeline rc=$?"; wait $b; echo "serve-plan rc=$?"
    tail -n 25 /tmp/logs/drafter-pipeline.log; tail -n 25 /tmp/logs/serve-plan.log
    pack train-serve
    ;;
  speed)
    mkdir -p "$RES/speed"
    D=/tmp/dp/drafters
    W=$(ls .carry/qwen-sessions/*.eval.jsonl | paste -sd, -)
    ACC=""
    if [ -f "$RES/train-serve/acceptance/acceptance-qwen.json" ]; then   # dspark at T=0, averaged over workloads
      ACC=/tmp/acc-dspark-t0.json
      python - "$RES/train-serve/acceptance/acceptance-qwen.json" "$ACC" <<'PY'
import json, sys
rep = json.load(open(sys.argv[1]))
cells = [c["0"] for c in rep["results"]["dspark"].values() if "0" in c]
k = max(len(c["acceptance_by_position"]) for c in cells)
alpha = []
for j in range(k):
    vals = [c["acceptance_by_position"][j] for c in cells if j < len(c["acceptance_by_position"])
            and c["acceptance_by_position"][j] is not None]
    alpha.append(sum(vals) / len(vals) if vals else None)
json.dump({"acceptance_by_position": alpha, "tau": sum(c["tau"] for c in cells) / len(cells),
           "draft_cost_fraction": sum(c["draft_cost_fraction"] for c in cells) / len(cells),
           "source": "dspark, T=0, mean over the five workloads of " + sys.argv[1]}, open(sys.argv[2], "w"))
PY
    fi
    CUDA_VISIBLE_DEVICES=0 python -m bench speedup --model "$MODEL" \
      --drafters "dspark=$D/dspark,dflash=$D/dflash,eagle3=$D/eagle3" --workloads "$W" \
      --concurrency 1,4,8,16,32 --requests 8 --max-tokens "${SPEED_TOKENS:-48}" --repeats 2 --device cuda \
      --out "$RES/speed/speedup" > /tmp/logs/speedup.log 2>&1 &
    a=$!
    CUDA_VISIBLE_DEVICES=$(second_gpu) python -m bench sps-projection --shape qwen3-8b --context 1024 \
      ${ACC:+--acceptance "$ACC"} --device cuda --out "$RES/speed/sps" > /tmp/logs/sps.log 2>&1 &
    b=$!
    wait $b; echo "sps rc=$?"
    wait $a; echo "speedup rc=$?"
    tail -n 30 /tmp/logs/speedup.log; tail -n 20 /tmp/logs/sps.log
    pack speed
    ;;
  train-kv)
    mkdir -p "$RES/train-kv"
    nvidia-smi --query-gpu=name,memory.used --format=csv
    # the drafter: dspark alone, 500 train sessions per workload answered by the serving engine; the whole run
    # takes ~15 min, so a call is cut by `timeout` and the next call resumes from the stage markers/checkpoint
    train_dspark "$RES/train-kv/acceptance" "${TRAIN_TIMEOUT:-540}" &
    a=$!
    if [ ! -f /tmp/kv-started ]; then   # the serving plan runs once, beside the first training call
      touch /tmp/kv-started
      CUDA_VISIBLE_DEVICES=$(second_gpu) python -m bench serve-plan --plan gpu-kv --model "$MODEL" --device cuda \
        --sessions .carry/sessions --out "$RES/train-kv/serve" --work /tmp/sp --budget-s "${SERVE_BUDGET:-500}" \
        --no-progress > /tmp/logs/serve-plan.log 2>&1 &
      b=$!
      wait $b; echo "serve-plan rc=$?"; tail -n 25 /tmp/logs/serve-plan.log
    fi
    wait $a; echo "drafter-pipeline rc=$?"
    grep -v "it/s\]" /tmp/logs/drafter-pipeline.log | tail -n 25
    pack train-kv
    ;;
  train)
    # session 7: the dspark drafter alone (train-kv's recipe, no serving plan beside it: one GPU), through
    # training only (no tuning or acceptance evaluation); resumable: run it again until it prints "trained";
    # TRAIN_METHODS=dspark,dflash,eagle3 trains the three on the same data, then SPEED_DRAFTERS=dspark=/tmp/dp/
    # drafters/dspark,dflash=/tmp/dp/drafters/dflash,eagle3=/tmp/dp/drafters/eagle3 runs them in `speedup`;
    # TRAIN_METHODS=dflash,eagle3 gives those two the whole window beside a stashed dspark (dspark=/tmp/dsp)
    mkdir -p "$RES/train"
    case "${TRAIN_INIT:-}" in /tmp/dsp*) unpack_drafter ;; esac
    case "${TRAIN_INITS:-}" in *=/tmp/dfl*) unpack_carried dflash ;; esac     # carried dflash / eagle3 pieces
    case "${TRAIN_INITS:-}" in *=/tmp/e3d*) unpack_carried eagle3 ;; esac
    train_dspark "$RES/train/acceptance" "${TRAIN_TIMEOUT:-560}" --stop-after train
    rc=$?; echo "drafter-pipeline rc=$rc"
    grep -v "it/s\]" /tmp/logs/drafter-pipeline.log | tail -n 12
    for m in $(echo "${TRAIN_METHODS:-dspark}" | tr , ' '); do     # each drafter's records; dspark's also at the top
      if [ -f "/tmp/dp/drafters/$m/drafter.safetensors" ]; then echo "trained $m"; ls -la "/tmp/dp/drafters/$m"; fi
      mkdir -p "$RES/train/$m"; cp "/tmp/dp/drafters/$m"/*.json "$RES/train/$m/" 2>/dev/null
    done
    triton_compiles | tee "$RES/train/triton-compiles.txt"
    cp -r /tmp/dp/stages "$RES/train/" 2>/dev/null; cp /tmp/dp/drafters/dspark/*.json "$RES/train/" 2>/dev/null
    pack train
    ;;
  train-probe)
    # session 8: the training step by batch size, random Qwen-0.5B weights (bench/gpu/train_probe.py); needs
    # .carry/answers-prompts.json (answers_probe --prepare). OLD=.carry/old42 times an older export too
    # PROBE_METHODS=eagle3 (session 42) times each named method's batched loss against its per-sequence
    # reference instead, in the same call: <method>.json and <method>-reference.json
    mkdir -p "$RES/train-probe"
    if [ -n "${PROBE_METHODS:-}" ]; then
      for m in $(echo "$PROBE_METHODS" | tr , ' '); do
        train_probe . "$m" --method "$m" --profile-batch 8x64
        train_probe . "$m-reference" --method "$m" --reference --profile-batch 8x64
      done
    else
      for tree in . ${OLD:-}; do
        train_probe "$tree" "$(basename "$(cd "$tree" && pwd)")" --profile-batch 8x16
      done
    fi
    if [ -n "${PROBE_FEATURES:-}" ]; then   # session 9: this tree again, its target pass in PROBE_FEATURES (bfloat16)
      train_probe . "features-$PROBE_FEATURES" --features-dtype "$PROBE_FEATURES"
    fi
    pack train-probe
    ;;
  step-profile)
    # session 14: prompt steps against decode steps, random Qwen-0.5B weights, no GGUF (bench/step_profile.py):
    # 110-token prompts (session 13's estimate of coding's; tokenized, its median is 696) beside 4, 16 and 32
    # decoders, then 400-token prompts beside 16; the last two cases again with KVSPEC_FUSED=1 (one-launch norms
    # and rotary, kvspec_kernels/rms_norm.py and kvspec_kernels/rotary.py: the default since session 15)
    mkdir -p "$RES/step-profile"
    for case in "110 4,16,32 0" "400 16 0" "110 4,16,32 1" "400 16 1"; do
      set -- $case
      KVSPEC_FUSED=$3 timeout "${STEP_PROFILE_TIMEOUT:-240}" python -m bench.step_profile --prompt-len "$1" \
        --decoders "$2" --prompts 0,1,2,3 --out "$RES/step-profile/len$1-fused$3" >> /tmp/logs/step-profile.log 2>&1
      echo "step-profile len $1 fused $3 rc=$?"
    done
    # every kernel against its reference at Qwen shapes, the one-launch norm and rotary among them
    timeout "${KERNELS_TIMEOUT:-240}" python -m bench.kernels_gpu --out "$RES/step-profile/kernels_gpu.json" \
      >> /tmp/logs/step-profile.log 2>&1
    echo "kernels_gpu rc=$?"
    tail -n 20 /tmp/logs/step-profile.log
    pack step-profile
    ;;
  answers-stacks)
    # session 7: the data stage (--answers engine) ran 540 s on the H200 with no output; dump its stacks
    # every DUMP_EVERY s for DUMP_FOR s (bench/gpu/stack_dump.py), then cut it
    mkdir -p "$RES/answers-stacks"
    CUDA_VISIBLE_DEVICES=0 python -m bench.gpu.stack_dump --every "${DUMP_EVERY:-20}" --for "${DUMP_FOR:-80}" \
      --out "$RES/answers-stacks/stacks.txt" -- bench drafter-pipeline --target "$MODEL" \
      --sessions .carry/qwen-sessions500 --work /tmp/dp-diag --out "$RES/answers-stacks/acceptance" --methods dspark \
      --train-sessions 500 --answers engine --stop-after data --device cuda > /tmp/logs/answers-stacks.log 2>&1
    echo "answers-stacks rc=$?"; tail -n 5 /tmp/logs/answers-stacks.log
    triton_compiles | tee "$RES/answers-stacks/triton-compiles.txt"
    pack answers-stacks
    ;;
  drafter-out)
    # the trained drafter (DRAFTER, default dspark) in bf16 as 15 MB pieces, all in one call (a file comes
    # back only up to 16 MiB: session 8's two 30 MB halves did not). Keep them in carried folders of <= 30 MB
    # (.carry/dsq8a: dsq.00-01, .carry/dsq8b: the rest) and bring them back with `stash` (a call each); then
    # SPEED_DRAFTERS=dspark=/tmp/dsp,dflash=/tmp/dfl,eagle3=/tmp/e3d unpacks each one named. dflash and eagle3
    # in bf16 are ~38 MB each (session 41's: 75.7 and 73.4 MB in fp32), three pieces
    M=${DRAFTER:-dspark}
    names=$(carried "$M") || { echo "DRAFTER=$M: dspark, dflash or eagle3"; exit 2; }
    read -r pieces folder <<< "$names"
    D=/tmp/dp/drafters/$M
    [ -f "$D/drafter.safetensors" ] || { echo "no trained $M drafter in $D (run train first)"; exit 2; }
    if [ ! -f "/tmp/$M-bf16.tgz" ]; then
      python - "$D" "/tmp/$M-bf16.safetensors" <<'PY'
import sys, torch
from safetensors.torch import load_file, save_file
d, out = sys.argv[1], sys.argv[2]
state = load_file(f"{d}/drafter.safetensors")
save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, out)
PY
      mkdir -p "/tmp/$folder" && cp "/tmp/$M-bf16.safetensors" "/tmp/$folder/drafter.safetensors"
      cp "$D"/*.json "/tmp/$folder/" && tar czf "/tmp/$M-bf16.tgz" -C /tmp "$folder" && rm -f /tmp/"$pieces".*
      split -b 15000000 -d -a 2 "/tmp/$M-bf16.tgz" "/tmp/$pieces."
      ls -la "/tmp/$folder" /tmp/"$pieces".*; sha256sum "/tmp/$M-bf16.tgz"
    fi
    send_pieces "$pieces" "${PIECE_FROM:-0}"    # dspark's own 38.4 M parameters: 77 MB in bf16, 6 pieces
    ;;
  data-out)
    # session 42: the data stage `train` left (/tmp/dp/data and its marker) as 15 MB pieces dpd.NN, four a call
    # from DATA_FROM (default 0; a call brings back 64 MB at most): carried in folders of <= 30 MB and
    # stashed, TRAIN_ANSWERS=carried trains on them without answering again (drafter-pipeline --answers-from)
    [ -f /tmp/dp/stages/data.json ] || { echo "no data stage in /tmp/dp (run train first)"; exit 2; }
    if [ ! -f /tmp/dpd.tgz ]; then
      tar czf /tmp/dpd.tgz -C /tmp/dp data stages/data.json && split -b 15000000 -d -a 2 /tmp/dpd.tgz /tmp/dpd.
      ls -la /tmp/dpd.*; sha256sum /tmp/dpd.tgz
    fi
    send_pieces dpd "${DATA_FROM:-0}"
    ;;
  stash)
    mkdir -p /tmp/stash && cp "$2"/* /tmp/stash/ && ls -la /tmp/stash
    ;;
  final)
    mkdir -p "$RES/final"
    nvidia-smi --query-gpu=name,memory.used --format=csv
    unpack_drafter
    W=$(ls .carry/qwen-sessions500/*.eval.jsonl | paste -sd, -)
    (
      CUDA_VISIBLE_DEVICES=0 python -m bench speedup --model "$MODEL" --drafters dspark=/tmp/dsp \
        --rows none,dspark,dspark-g7,ngram --workloads "$W" --concurrency 1,4,8,16,32 --requests 8 \
        --max-tokens "${SPEED_TOKENS:-48}" --repeats 2 --device cuda --budget-s "${SPEED_BUDGET:-290}" \
        --out "$RES/final/speedup" > /tmp/logs/speedup.log 2>&1
      echo "speedup rc=$?"
      mkdir -p "$RES/final/draft-round"
      CUDA_VISIBLE_DEVICES=0 timeout "${PROFILE_TIMEOUT:-50}" python -m bench.gpu_profile --draft-round \
        --out "$RES/final/draft-round" > /tmp/logs/draft-round.log 2>&1
      echo "draft-round rc=$?"
      # the Markov loop's share of a round at real size (issue 6's overheads), and the labelled projection
      CUDA_VISIBLE_DEVICES=0 timeout "${SPS_TIMEOUT:-70}" python -m bench sps-projection --shape qwen3-8b \
        --batches 1,8,32,128 --repeats 3 --context 1024 --acceptance .carry/acc-dspark-t0.json --device cuda \
        --out "$RES/final/sps" > /tmp/logs/sps.log 2>&1
      echo "sps-projection rc=$?"
    ) &
    a=$!
    CUDA_VISIBLE_DEVICES=$(second_gpu) python -m bench serve-plan --plan "${KV_PLAN:-gpu-kv}" --model "$MODEL" --device cuda \
      --sessions .carry/sessions --out "$RES/final/serve" --work /tmp/sp2 --budget-s "${SERVE_BUDGET:-450}" \
      --no-progress > /tmp/logs/serve-plan.log 2>&1 &
    b=$!
    wait $b; echo "serve-plan rc=$?"; wait $a
    grep -v "it/s" /tmp/logs/serve-plan.log | tail -n 20; tail -n 30 /tmp/logs/speedup.log; tail -n 20 /tmp/logs/draft-round.log
    tail -n 12 /tmp/logs/sps.log
    pack final
    ;;
  probe)
    mkdir -p "$RES/probe"
    unpack_drafter
    W=$(ls .carry/qwen-sessions500/{coding,creative}.eval.jsonl | paste -sd, -)
    CUDA_VISIBLE_DEVICES=0 python -m bench speedup --model "$MODEL" --drafters dspark=/tmp/dsp \
      --rows none,dspark,dspark-g7 --workloads "$W" --concurrency 1,8,32 --requests 8 --max-tokens 48 \
      --repeats 1 --device cuda --budget-s "${SPEED_BUDGET:-200}" --profile "$RES/probe/profile" \
      --out "$RES/probe/speedup" > /tmp/logs/speedup.log 2>&1
    echo "speedup rc=$?"
    # then the creative case (never finished inside gpu-kv's budget) on the same GPU
    CUDA_VISIBLE_DEVICES=0 python -m bench serve-plan --plan gpu-creative --model "$MODEL" --device cuda \
      --sessions .carry/sessions --out "$RES/probe/creative" --work /tmp/sp4 --budget-s "${CREATIVE_BUDGET:-230}" \
      --no-progress > /tmp/logs/creative-plan.log 2>&1 &
    a=$!
    CUDA_VISIBLE_DEVICES=$(second_gpu) python -m bench serve-plan --plan "${KV_PLAN:-gpu-agentic-idle}" --model "$MODEL" \
      --device cuda --sessions .carry/sessions --out "$RES/probe/serve" --work /tmp/sp3 --budget-s "${SERVE_BUDGET:-450}" \
      --no-progress > /tmp/logs/serve-plan.log 2>&1 &
    b=$!
    wait $a; echo "creative plan rc=$?"; wait $b; echo "serve-plan rc=$?"
    grep -v "it/s" /tmp/logs/serve-plan.log | tail -n 30; tail -n 12 /tmp/logs/speedup.log
    grep -v "it/s" /tmp/logs/creative-plan.log | tail -n 12
    pack probe
    ;;
  last)
    # GPU0: the prefill tile sweep, bench speedup (none / scheduled dspark / dspark γ=7), serve-plan gpu-agentic |
    # GPU1: serve-plan gpu-agentic-idle. Budgets sized so the call ends inside ~500 s (session 4: the idle
    # plan's five configs need ~460 s; at 440 s `standard` was cut).
    mkdir -p "$RES/last"
    unpack_drafter
    (
      # the prefill tile-size sweep first (~1 min): bench/kernels_gpu.py sweep_prefill
      CUDA_VISIBLE_DEVICES=0 timeout "${SWEEP_TIMEOUT:-90}" python -m bench.kernels_gpu --prefill-sweep \
        --out "$RES/last/prefill-sweep.json" > /tmp/logs/prefill-sweep.log 2>&1
      echo "prefill sweep rc=$?"
      speedup_run 0 dspark=/tmp/dsp "${SPEED_ROWS:-none,dspark,dspark-g7}" "${SPEED_BUDGET:-165}" "$RES/last/speedup"
      plan_run 0 gpu-agentic "$RES/last/agentic" /tmp/sp5 "${AGENTIC_BUDGET:-225}" agentic-plan
    ) &
    a=$!
    plan_run "$(second_gpu)" gpu-agentic-idle "$RES/last/idle" /tmp/sp6 "${SERVE_BUDGET:-480}" serve-plan &
    b=$!
    wait $a; wait $b
    tail -n 3 /tmp/logs/prefill-sweep.log; tail -n 14 /tmp/logs/speedup.log
    grep -v "it/s" /tmp/logs/agentic-plan.log | tail -n 8
    grep -v "it/s" /tmp/logs/serve-plan.log | tail -n 8
    pack last
    ;;
  speedup)
    # the gate's measurement alone (session 5): ~200 s for three rows
    # SPEED_DRAFTERS= (empty) for rows that need no trained drafter (none, ngram, ngram-gated): no stash needed
    mkdir -p "$RES/speedup"
    speed_drafters
    speedup_run 0 "$DRAFTERS" "${SPEED_ROWS:-none,dspark,dspark-g7}" "${SPEED_BUDGET:-200}" "$RES/speedup/speedup"
    tail -n 14 /tmp/logs/speedup.log
    pack speedup
    ;;
  lockstep)
    # session 43: every answer of the table is capped at 48 tokens and nearly every one reaches the cap, so
    # `none` finishes a cohort of requests in one step and their successors share prompt steps; drafting
    # spreads the finishes, and each successor's prompt takes a step of its own (bench.step_split). Served
    # answers end at EOS. The same rows, drafter and repeats at each turn's own max_tokens, then at 48 tokens,
    # in one call on one card, say how much of the loss at c = 32 is the cap's lockstep
    speed_drafters
    rows=${SPEED_ROWS:-none,none-aa,dspark}
    mkdir -p "$RES/turn" "$RES/fixed48"
    SPEED_MAX_TOKENS=turn SPEED_CONCURRENCY=${LOCK_CONCURRENCY:-16,32} \
      speedup_run 0 "$DRAFTERS" "$rows" "${LOCK_BUDGET:-280}" "$RES/turn/speedup"
    cp /tmp/logs/speedup.log "$RES/turn/"; tail -n 8 /tmp/logs/speedup.log
    SPEED_MAX_TOKENS=48 SPEED_CONCURRENCY=${LOCK_FIXED:-32} \
      speedup_run 0 "$DRAFTERS" "$rows" "${LOCK_FIXED_BUDGET:-60}" "$RES/fixed48/speedup"
    cp /tmp/logs/speedup.log "$RES/fixed48/"; tail -n 8 /tmp/logs/speedup.log
    tar czf "$OUT/turn.tgz" -C "$RES" turn; tar czf "$OUT/fixed48.tgz" -C "$RES" fixed48; ls -la "$OUT"
    ;;
  verdict)
    # session 16's measurements in one call (~480 s with the upload and stash done): (1) a fresh engine on
    # extraction, the argmax chain against the rejection sampler for greedy drafts, scheduled and fixed
    # (dspark(-g7) against dspark(-g7)-rejection, rows alternated; its "built Triton kernels" count checks
    # kvspec_kernels/alignment.py), (2) the full table (issue 6's verdict), (3) the draft-round profile, both verify
    # paths. TRAIN_DATA defaults to .carry/qs1000.tgz (carry it); the drafter must be stashed.
    mkdir -p "$RES/verdict"
    export TRAIN_DATA=${TRAIN_DATA:-.carry/qs1000.tgz} SPEED_WAVES=${SPEED_WAVES:-4} SPEED_REPEATS=${SPEED_REPEATS:-3}
    speed_drafters
    SPEED_WORKLOADS=extraction SPEED_CONCURRENCY=1,8 speedup_run 0 "$DRAFTERS" \
      none,dspark,dspark-rejection,dspark-g7,dspark-g7-rejection "${CHAIN_BUDGET:-110}" "$RES/verdict/chain"
    cp /tmp/logs/speedup.log /tmp/logs/speedup-chain.log
    SPEED_WORKLOADS= SPEED_CONCURRENCY=1,4,8,16,32 speedup_run 0 "$DRAFTERS" none,none-aa,dspark,dspark-g7 \
      "${SPEED_BUDGET:-400}" "$RES/verdict/table"
    mkdir -p "$RES/verdict/draft-round"
    CUDA_VISIBLE_DEVICES=0 timeout "${PROFILE_TIMEOUT:-60}" python -m bench.gpu_profile --draft-round \
      --out "$RES/verdict/draft-round" > /tmp/logs/draft-round.log 2>&1
    echo "draft-round rc=$?"
    tail -n 12 /tmp/logs/speedup-chain.log; tail -n 14 /tmp/logs/speedup.log
    grep -o "'verify_[a-z_]*': ([0-9.]*, [0-9.]*)" /tmp/logs/draft-round.log
    pack verdict
    ;;
  idle)
    mkdir -p "$RES/idle"
    plan_run 0 "${KV_PLAN:-gpu-agentic-idle}" "$RES/idle/idle" /tmp/sp6 "${SERVE_BUDGET:-480}" serve-plan
    grep -v "it/s" /tmp/logs/serve-plan.log | tail -n 8
    pack idle
    ;;
  kv8b)
    # one GPU, no GGUF upload (session 19): the agentic-idle load at the Qwen3-8B shape with random weights
    # (${KV_PLAN:-gpu-agentic-8b}, ~310-330 s), then the 0%-hit overhead at that shape (gpu-zero-hit-8b, ~135 s);
    # carry .carry/q8r.tgz and .carry/sessions (bootstrap.sh builds both)
    mkdir -p "$RES/kv8b"
    export KV_MODEL=${KV_MODEL:-.carry/q8r.tgz}
    plan_run 0 "${KV_PLAN:-gpu-agentic-8b}" "$RES/kv8b/agentic" /tmp/sp6 "${SERVE_BUDGET:-390}" serve-plan
    grep -v "it/s" /tmp/logs/serve-plan.log | tail -n 4
    plan_run 0 gpu-zero-hit-8b "$RES/kv8b/zero-hit" /tmp/sp7 "${ZERO_HIT_BUDGET:-170}" zero-hit
    grep -v "it/s" /tmp/logs/zero-hit.log | tail -n 4
    pack kv8b
    ;;
  pair)
    mkdir -p "$RES/pair"
    speed_drafters
    speedup_run 0 "$DRAFTERS" "${SPEED_ROWS:-none,dspark,ngram-gated}" "${SPEED_BUDGET:-280}" "$RES/pair/speedup" &
    a=$!
    plan_run "$(second_gpu)" "${KV_PLAN:-gpu-mooncake}" "$RES/pair/plan" /tmp/sp8 "${SERVE_BUDGET:-400}" serve-plan &
    b=$!
    wait $a; wait $b
    tail -n 14 /tmp/logs/speedup.log
    grep -v "it/s" /tmp/logs/serve-plan.log | tail -n 12
    pack pair
    ;;
  closing)
    mkdir -p "$RES/closing"
    unpack_drafter
    (
      speedup_run 0 dspark=/tmp/dsp "${SPEED_ROWS:-none,dspark,dspark-g7,ngram}" "${SPEED_BUDGET:-250}" \
        "$RES/closing/speedup"
      plan_run 0 gpu-zero-hit "$RES/closing/zero-hit" /tmp/sp7 "${ZERO_BUDGET:-170}" zero-hit
    ) &
    a=$!
    plan_run "$(second_gpu)" gpu-agentic-idle "$RES/closing/idle" /tmp/sp6 "${SERVE_BUDGET:-470}" serve-plan &
    b=$!
    wait $a; wait $b
    tail -n 14 /tmp/logs/speedup.log
    grep -v "it/s" /tmp/logs/zero-hit.log | tail -n 8
    grep -v "it/s" /tmp/logs/serve-plan.log | tail -n 8
    pack closing
    ;;
  nucleus)
    mkdir -p "$RES/nucleus"
    for rows in spread:0.9,2.2 peaked:1.3,3.0; do
      CUDA_VISIBLE_DEVICES=0 timeout "${NUCLEUS_TIMEOUT:-200}" python -m bench.sampling_cost --zipf-a "${rows#*:}" \
        --against "${AGAINST:-.carry/one_level.py}" --out "$RES/nucleus/sampling_cost-${rows%%:*}.json" \
        > "/tmp/logs/nucleus-${rows%%:*}.log" 2>&1
      echo "${rows%%:*} rc=$?"; tail -n 8 "/tmp/logs/nucleus-${rows%%:*}.log"
    done
    pack nucleus
    ;;
  graphs-check)
    mkdir -p "$RES/graphs-check"
    timeout "${CHECK_TIMEOUT:-240}" python -m pytest -q -p no:cacheprovider tests/engine/test_absorb_graphs.py \
      tests/engine/test_eagle3_graphs.py \
      tests/engine/test_block_graphs.py tests/engine/test_draft_graphs.py > "$RES/graphs-check/pytest.txt" 2>&1
    echo "pytest rc=$?"; tail -n 3 "$RES/graphs-check/pytest.txt"
    CUDA_VISIBLE_DEVICES=0 timeout "${PROFILE_TIMEOUT:-120}" python -m bench.gpu_profile --draft-round \
      --out "$RES/graphs-check" > /tmp/logs/draft-round.log 2>&1
    echo "draft-round rc=$?"; tail -n 4 /tmp/logs/draft-round.log
    pack graphs-check
    ;;
  markov)
    # session 51, one GPU, no GGUF, no stash: the fused Markov slot (kvspec_kernels/markov_slot.py, never run on a
    # GPU when written) checked and timed on random inputs against the round the engine ran before it
    # (bench.markov_slot_cost), then the projection phase on this tree (the Markov loop's share of a round at the
    # 8B shape) and, with MARKOV_AGAINST, on an older export (`git archive C | tar -x -C DIR`, COMMIT in it, and
    # carry DIR): the same measurement before the kernels, in the same lease
    mkdir -p "$RES/markov"
    CUDA_VISIBLE_DEVICES=0 timeout "${MARKOV_TIMEOUT:-240}" python -m bench.markov_slot_cost \
      --out "$RES/markov/markov_slot.json" > /tmp/logs/markov.log 2>&1
    echo "markov_slot_cost rc=$?"; grep -v Warn /tmp/logs/markov.log | tail -n 14
    pack markov
    bash "$0" projection > /tmp/logs/projection-this.out 2>&1; echo "projection (this tree) rc=$?"
    grep -E "^\| (1|8|32|128) \| [0-9.]+ \| [0-9]+ \|" /tmp/logs/projection-this.out | head -4
    mv "$OUT/projection.tgz" "$OUT/projection-this.tgz"
    if [ -n "${MARKOV_AGAINST:-}" ]; then
      here=$PWD
      (cd "$MARKOV_AGAINST" && ln -sfn "$here/.whl" .whl && bash bench/gpu/session.sh projection) \
        > /tmp/logs/projection-against.out 2>&1; echo "projection ($MARKOV_AGAINST) rc=$?"
      grep -E "^\| (1|8|32|128) \| [0-9.]+ \| [0-9]+ \|" /tmp/logs/projection-against.out | head -4
      mv "$OUT/projection.tgz" "$OUT/projection-against.tgz"
    fi
    ;;
  projection)
    # session 49, one GPU, no GGUF, no stash (a session's first call can be this one): issue 6's timing at real
    # size on this tree (Qwen3-8B shape, random weights: SPS(B), verify cost by k, the Markov loop's share of a
    # round; last measured in session 4, before the two-level nucleus kernels) and the labelled projection with
    # the acceptance measured on the CPU machine (PROJ_ACCEPTANCE, default session 49's greedy runs of session
    # 45's drafter, pooled by counts, with their rounds: the scheduler is replayed on them); the sensitivity
    # table at draft cost fractions PROJ_FRACTIONS
    # first the drafter's work of a step at the same shape and context (block forward, Markov round, context
    # projection, from their graphs), which the projection then charges instead of an assumed fraction
    mkdir -p "$RES/projection"
    B=${PROJ_BATCHES:-1,8,32,128}
    CUDA_VISIBLE_DEVICES=0 timeout "${PROFILE_TIMEOUT:-180}" python -m bench.gpu_profile --draft-round \
      --shape qwen3-8b --batches "$B" --context 1024 --out "$RES/projection/draft-round" > /tmp/logs/draft-round.log 2>&1
    echo "draft-round rc=$?"; tail -n 4 /tmp/logs/draft-round.log
    acc=()
    for f in ${PROJ_ACCEPTANCE:-docs/results/cpu/s49-acceptance/*-t0.json}; do acc+=(--acceptance "$f"); done
    round=(); [ -f "$RES/projection/draft-round/draft_round-qwen3-8b.json" ] && \
      round=(--draft-round "$RES/projection/draft-round/draft_round-qwen3-8b.json" --draft-setting "${PROJ_SETTING:-greedy}")
    CUDA_VISIBLE_DEVICES=0 timeout "${SPS_TIMEOUT:-240}" python -m bench sps-projection --shape qwen3-8b \
      --batches "$B" --repeats 3 --context 1024 "${acc[@]}" "${round[@]}" --scheduled \
      --draft-fraction "${PROJ_FRACTIONS:-0.55,0.25,0.1}" --device cuda --out "$RES/projection/sps" \
      > /tmp/logs/sps.log 2>&1
    echo "sps-projection rc=$?"; tail -n 40 "$RES/projection/sps/sps_projection.md"
    pack projection
    ;;
  *)
    sed -n "2,$(( $(grep -n '^# Why this shape' "$0" | cut -d: -f1) - 1 ))p" "$0"; exit 2 ;;   # the usage block above
esac
