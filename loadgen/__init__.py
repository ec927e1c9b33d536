"""`splitserve bench`: load generation against a running cluster, with a progress bar, a
summary table, goodput against SLOs, one JSON line, and PNG plots (torch-free)."""
