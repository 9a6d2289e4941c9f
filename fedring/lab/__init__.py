"""The edge lab: namespaces, shaped links, and the processes in them."""
