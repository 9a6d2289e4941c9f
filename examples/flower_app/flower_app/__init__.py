"""A plain Flower app with fedring's group-top-k uplinks, adopted in four lines: an import
and an edit in client_app.py and in server_app.py."""
