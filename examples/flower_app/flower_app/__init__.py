"""A plain Flower app with fedring's group-top-k uplinks, adopted in two lines."""
