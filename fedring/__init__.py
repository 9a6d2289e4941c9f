"""fedring."""
