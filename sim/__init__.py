"""The fleet simulator: splitserve's own decision code on a virtual clock, the forward pass and
the wire replaced by a cost model (sim/cost_model.py)."""
