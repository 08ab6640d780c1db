"""The wire: typed control messages (``protocol``), sampling parameters as they travel
(``sampling_params``) and what a scheduler hands its loop to send (``outbox``). Plain data, no torch,
no sockets; the lowest layer, imported by the engine, the workers and the router alike."""
