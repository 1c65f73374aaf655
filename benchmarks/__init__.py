"""The GPU benchmark suite: one command per suite (`python benchmarks/<suite>.py`), our figure against each peer's
measured in the same process. `harness` times, measures memory, prints the tables and writes JSON lines; `shapes`
builds ours and each peer at equal shapes. See benchmarks/RESULTS.md for the commands and the measured history."""
