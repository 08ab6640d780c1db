"""``pdserve bench serve``: an OpenAI-compatible streaming load generator and its reports.

Modules: ``workload`` (synthetic prompts, lengths, shared prefix, arrivals), ``client`` (one
streamed request -> ``RequestResult``), ``runner`` (closed-loop concurrency and open-loop Poisson
schedules), ``stats`` (TTFT/TPOT/ITL/E2E, throughput, goodput), ``report`` (tables, JSON, PNG),
``servers`` (launching colocated and PD servers for ``--compare``), ``interference`` (short
requests under long-prompt interference).
"""
