"""Tools for trying hybridpipe as on a cluster, on one machine (emulated hosts)."""
