"""Transports: how frames move between named endpoints."""

from fedring.transport.base import (
    Deadline,
    Delivery,
    Endpoint,
    EndpointClosed,
    LinkStats,
    MembershipEvent,
    PeerUnreachable,
    Transport,
    TransportError,
    TransportTimeout,
)
from fedring.transport.inproc import InprocEndpoint, InprocTransport

__all__ = [
    "Deadline",
    "Delivery",
    "Endpoint",
    "EndpointClosed",
    "InprocEndpoint",
    "InprocTransport",
    "LinkStats",
    "MembershipEvent",
    "PeerUnreachable",
    "Transport",
    "TransportError",
    "TransportTimeout",
]
