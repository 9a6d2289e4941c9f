"""Training: datasets, models, sharding, learning-rate rules, sync modes, monitoring.

The round logic here is shared by `fedring simulate`, the agent daemon and the
Flower apps; it knows rings and channels, never a particular transport.
"""
