"""The collective algorithms: MPI's own calls (``native``), the hand-written ring
(``ring``), the two-level all-reduce (``hierarchical``), and the choice between them
per call (``select``, with the crossovers a ``tuning`` file records)."""
