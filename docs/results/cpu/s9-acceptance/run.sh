#!/bin/bash
# CPU acceptance, same run: run T's drafter (session 8) against run W's (session 9), greedy, γ = 7
cd /work/main
for w in coding creative extraction knowledge support; do
  for d in s8 s9; do
    python -m bench acceptance --target /work/models/qwen05/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
      --drafter /work/models/dspark-$d/dsp --workload .carry/qwen-sessions500/$w.eval.jsonl --sessions 8 \
      --max-new-tokens 48 --temperature 0 --gamma 7 --threads 2 --out /tmp/acc/$w-$d.json > /tmp/acc/$w-$d.log 2>&1
    echo "$w $d rc=$? $(tail -c 300 /tmp/acc/$w-$d.log | grep -o '"tau": [0-9.]*')"
  done
done
echo done
