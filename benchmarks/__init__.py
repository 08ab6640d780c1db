"""Studies of single mechanisms (a kernel, a seal, a grammar engine, a migration) and the results
files of every benchmark (``benchmarks/results/*.json``, rendered by ``benchmarks/render.py``).

Run from the repository root (``python -m benchmarks.NAME --help``); not part of the wheel. The
product's benchmarks are ``pdserve bench`` (package ``bench``)."""
