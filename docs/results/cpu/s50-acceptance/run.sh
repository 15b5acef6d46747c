#!/bin/bash
# Session 50, on the 2-core CPU machine: greedy acceptance of session 50's dspark drafter (session 45's trained
# 2,231 more steps on the H100, run `docs/results/gpu/s50/train`; carried tarball sha256 a4c5d674957c...) on the
# same inputs as session 49's (docs/results/cpu/s49-acceptance/run.sh): the real Qwen2.5-Coder-0.5B GGUF, γ = 7,
# 8 eval sessions × 2 turns per workload, each turn's own max_tokens (128), fp32. Then the labelled projection
# on this session's Qwen3-8B-shape timings (docs/results/gpu/s50/projection, H100) with the measured draft round.
#   inputs, outside git:  cat .carry/q45/q.* > q.gguf        (the GGUF the device runs use, 491,400,064 bytes)
#                         cat .carry/dsq50a/dsq.* .carry/dsq50b/dsq.* > dsp.tgz && tar xzf dsp.tgz   (-> dsp/)
#                         tar xzf .carry/qs1000.tgz                                                    (-> qs1000/)
set -e
W=${W:-/work/s49}; D=${D:-/work/s50/d50/dsp}; OUT=${OUT:-docs/results/cpu/s50-acceptance}
for wl in coding creative extraction knowledge support; do
  python -m bench acceptance --target "$W/q.gguf" --drafter "$D" --workload "$W/qs1000/$wl.eval.jsonl" \
    --temperature 0 --gamma 7 --sessions 8 --threads 2 --keep-rounds --out "$OUT/$wl-t0.json"
done
G=docs/results/gpu/s50/projection
python -m bench sps-projection --timings "$G/sps/sps_projection.json" \
  $(for wl in coding creative extraction knowledge support; do echo --acceptance "$OUT/$wl-t0.json"; done) \
  --draft-round "$G/draft-round/draft_round-qwen3-8b.json" --draft-setting greedy \
  --draft-fraction 0.55,0.25,0.1 --scheduled --out "$OUT/projection-s50"
