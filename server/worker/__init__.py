"""One worker process: its entry point (``main``), the ``WorkerLoop`` that owns every socket and
delivers a scheduler's outboxes, control I/O, the peer pinger, CPU placement and core lending."""
