"""Requests and their scheduling: the request and its sampling, the scheduler and its fair
order, the KV cache manager and block pool, prefix hashing, n-choice forks, the roles' turn,
a step's outputs and detokenizer, the step-time model and its fit (torch-free but `forks`)."""
