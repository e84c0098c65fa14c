"""verifier_service."""
