"""Harnesses for benchmarks and tests: a launched ``pdserve`` server (``subprocess_server``) and the
real PD schedulers wired in one process (``pd_harness``). Nothing in the serving path imports them."""
