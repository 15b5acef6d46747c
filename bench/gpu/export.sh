#!/usr/bin/env bash
# Write a clean export of HEAD into .carry/clean (git-ignored), with the COMMIT file bench/provenance.py reads.
# Why: the device call copies the whole working tree, helpers' uncommitted edits included; the GPU runs must
# execute exactly one commit and say which. Carry `.carry/clean` and run from it (see bench/gpu/session.sh).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .carry/clean
mkdir -p .carry/clean
git archive HEAD | tar -x -C .carry/clean
git rev-parse HEAD > .carry/clean/COMMIT
# the raw results of earlier runs are not needed to run and would push a call past its 64 MiB
rm -rf .carry/clean/docs/results/gpu
echo "exported $(cat .carry/clean/COMMIT) to .carry/clean ($(du -sh .carry/clean | cut -f1))"
