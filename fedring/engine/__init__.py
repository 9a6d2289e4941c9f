"""fedring's training engine: the public API that every runner drives.

A group (who trains together, this agent's rank, the layout), a reducer (error
feedback, compressor, collective, kept residual), and a distributed optimizer that
wraps any `torch.optim` optimizer. `fedring simulate`, the agent daemon, the Flower
apps and a user's own script all train through these.
"""
