"""Which path a collective takes: `plan.plan()` and the one table of thresholds it reads, and
the α–β cost model. Above the transport, below the algorithms: they cut their pieces by its
sizes, and it names them only as `Path` members."""
