"""The benchmark behind BENCHMARKS.md (`python -m bench.run`; how it measures: the document's "How to read") and
the commands behind docs/benchmarks/."""
