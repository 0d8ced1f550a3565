"""Communication: collectives over the grid's communicators (and, later, stage-to-stage p2p)."""
