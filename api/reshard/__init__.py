"""Reshard checks: verify that moving a run between two layouts of a sweep's problem keeps
every tensor and the loss curve. One feature folder: ``routes`` (thin HTTP), ``schemas`` (bodies),
``service`` (validate, run on the trials' backend, store), ``models`` (the table, on the store's Base)."""
