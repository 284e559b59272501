"""Cluster probes: what a short measurement of the cluster found (tuner/_probe.py's figures), stored
per cluster fingerprint and model, and used by ``plan``, the engine's prior and the dashboard in
place of the datasheet's figures. One feature folder: ``models`` (the table, on the store's Base),
``service`` (find a fresh probe or run one on the trials' backend, store it in one transaction),
``routes`` (thin HTTP)."""
