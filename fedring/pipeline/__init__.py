"""Model parallelism across boards, combined with data parallelism.

A model given as an `nn.Sequential` (or a list of stage modules) is cut into S
stages, balanced by the boards' profiles with each layer's cost measured on a
sample batch (`cost`, `partition`). Each stage trains on its own board; micro-
batches flow through the stages in a GPipe or 1F1B order (`schedule`), their
activations forward and activation gradients backward as hash-checked frames
over the same `PeerChannel` the rings use (`stage`). D replicas of every stage
all-reduce that stage's gradients in their own ring with the engine's `Reducer`
(group-top-k + error feedback), so an S x D grid trains one model (`grid`).

See docs/pipeline.md.
"""
