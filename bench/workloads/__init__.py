"""Benchmark workloads: five real traffic profiles written as session JSONL files (see docs/workloads.md).

`format` is the file contract, `split` the recorded train/eval split, one module per profile builds
sessions, and `build` is the command line.
"""
