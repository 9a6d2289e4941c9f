"""Tests of the edge lab: delay proxy on loopback, loss in namespaces the tests make."""
