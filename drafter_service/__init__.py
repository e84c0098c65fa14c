"""drafter_service."""
