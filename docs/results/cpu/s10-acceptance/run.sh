#!/bin/bash
# CPU acceptance of session 10's drafter (run AB: run W's warm-started, 1,600 more steps on 1,000 sessions per
# workload), greedy, γ = 7, with exactly session 9's settings (docs/results/cpu/s9-acceptance/run.sh): greedy
# drafting and verification are deterministic, so its s9 JSONs are the same-input comparison
cd /work/main
for w in coding creative extraction knowledge support; do
  python -m bench acceptance --target /work/models/qwen05/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
    --drafter /work/models/dspark-s10/dsp --workload .carry/qwen-sessions500/$w.eval.jsonl --sessions 8 \
    --max-new-tokens 48 --temperature 0 --gamma 7 --threads 2 --out /tmp/acc10/$w-s10.json > /tmp/acc10/$w-s10.log 2>&1
  echo "$w s10 rc=$? $(tail -c 300 /tmp/acc10/$w-s10.log | grep -o '"tau": [0-9.]*')"
done
echo done
