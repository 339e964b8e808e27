"""Demonstrations the notebooks run: the ladder of fixes to the naive step (`ladder`), what
breaks CUDA-graph capture (`capture_breakers`), three ways to balance experts (`balancing`)."""
