"""GPU measurements and tools (benchmarks/README.md), run as python3 -m benchmarks.NAME."""
