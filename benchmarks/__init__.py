"""Speed and cost measurements (benchmarks/README.md). A regular package, so that `benchmarks._report` is this
folder even where another distribution installs a top-level `benchmarks` package (Opacus does)."""
