"""kv_manager."""
