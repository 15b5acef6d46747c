#!/bin/bash
# Session 49, on the 2-core CPU machine: greedy acceptance of session 45's dspark drafter (the one stashed for the
# GPU runs since; carried tarball sha256 5bde1710aea8...) against the real Qwen2.5-Coder-0.5B GGUF, γ = 7,
# 8 eval sessions × 2 turns per workload, each turn's own max_tokens (128), fp32. Then the labelled projection
# on session 4's Qwen3-8B-shape timings (run C, H200). ~3 min a workload.
#   inputs, outside git:  cat .carry/q45/q.* > q.gguf        (the GGUF the device runs use, 491,400,064 bytes)
#                         cat .carry/dsq45a/dsq.* .carry/dsq45b/dsq.* > dsp.tgz && tar xzf dsp.tgz   (-> dsp/)
#                         tar xzf .carry/qs1000.tgz                                                    (-> qs1000/)
set -e
W=${W:-/work/s49}; OUT=${OUT:-docs/results/cpu/s49-acceptance}
for wl in coding creative extraction knowledge support; do
  python -m bench acceptance --target "$W/q.gguf" --drafter "$W/dsp" --workload "$W/qs1000/$wl.eval.jsonl" \
    --temperature 0 --gamma 7 --sessions 8 --threads 2 --keep-rounds --out "$OUT/$wl-t0.json"
done
# each sampled workload at its own sampling (the eval sessions' temperature and top-p)
for spec in coding:0.2:0.95 creative:0.88:0.95 knowledge:0.7:0.9 support:0.7:0.9; do
  IFS=: read -r wl t p <<< "$spec"
  python -m bench acceptance --target "$W/q.gguf" --drafter "$W/dsp" --workload "$W/qs1000/$wl.eval.jsonl" \
    --temperature "$t" --top-p "$p" --gamma 7 --sessions 8 --threads 2 --out "$OUT/$wl-own.json"
done
python -m bench sps-projection --timings docs/results/gpu/s4/runC/sps_projection.json \
  $(for wl in coding creative extraction knowledge support; do echo --acceptance "$OUT/$wl-t0.json"; done) \
  --draft-fraction 0.55,0.25,0.1 --scheduled --out "$OUT/projection-runC"
python -m bench sps-projection --timings docs/results/gpu/s4/runC/sps_projection.json \
  $(for f in coding-own creative-own extraction-t0 knowledge-own support-own; do echo --acceptance "$OUT/$f.json"; done) \
  --draft-fraction 0.55,0.25,0.1 --out "$OUT/projection-own-runC"
# the same greedy runs with session 44's drafter (.carry/dsqa + .carry/dsqb, sha256 1bd266d4...; session 45's
# warm-started from it): the same-input comparison of 1,895 steps against ~2,700
for wl in coding creative extraction knowledge support; do
  python -m bench acceptance --target "$W/q.gguf" --drafter "$W/d44/dsp" --workload "$W/qs1000/$wl.eval.jsonl" \
    --temperature 0 --gamma 7 --sessions 8 --threads 2 --out "$OUT/s44-drafter/$wl-t0.json"
done
