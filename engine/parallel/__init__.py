"""Tensor parallelism: how a model's heads and weights split, the leader's channel to its
follower ranks, and the ranks' processes."""
