"""Shared test settings: hypothesis without per-example deadlines (threads, 2 cores)."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "fedring",
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("fedring")
