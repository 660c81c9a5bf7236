"""The Context Cache Manager: session records, token history, TTLs, affinity and quotas."""
