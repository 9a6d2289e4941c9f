"""What an operator sees of a running job: one feed, read by every view.

A runner (the coordinator, `fedring simulate`, an agent daemon) writes into a
`JobFeed` as the job moves: each round's metrics row (the same row that
``metrics.jsonl`` gets), the members and layout of each epoch, events such as a lost
agent or a re-formation, and its `Counters`. The views only read it, each at its
own pace and from its own thread: the progress line on stderr
(`fedring.monitor.progress`), the Prometheus endpoint and the live dashboard. A
view never slows a round: writing is a short append under a lock, reading takes a
copy.
"""

from fedring.monitor.feed import JobFeed, Snapshot

__all__ = ["JobFeed", "Snapshot"]
