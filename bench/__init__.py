"""The benchmark behind BENCHMARKS.md: `python -m bench.run` (through scripts/run_benchmarks.sh).

Machines are noisy, so every comparison is measured in one process run with its sides interleaved (A B,
B A, A B ...), each side's figure is the median over repetitions, and a ratio is taken pair by pair within
a repetition before its median is quoted. Engine and model loading is timed apart and never counts in a
throughput. The pipeline itself (eagle_pipeline/, the stage scripts) never imports this package.
"""
