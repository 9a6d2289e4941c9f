"""fedring: collaborative training across edge boards.

Agents compress what they send with group-top-k sparsification and error
feedback, and exchange the pieces in a ring (reduce-scatter, then all-gather)
over an MQTT broker, Flower, or in-process queues. See README.md.
"""

__version__ = "0.1.0"
