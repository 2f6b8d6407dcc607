"""The transport, the lowest layer of `nanoddp.comm`: send/recv by group rank and tags, byte
counting, the simulated slow link, one runner thread per group, the hang watchdog, and groups
that have collectives only. It imports nothing else of `nanoddp.comm`."""
